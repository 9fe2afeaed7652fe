"""The benchmarks' baseline: plain aiortc serving the test pattern with its built-in encoder,
one encoder per viewer, behind the stream service's HTTP contract (the subset a viewer needs).

    python -m tests.encoder.plainservice [--host 127.0.0.1] [--port 0]

prints one JSON line {"url": ..., "pid": ...} once it serves, like `farm stream`, and serves until
it is terminated. Each viewer gets its own peer connection and its own libx264 encoder, fed from
the session's one live source: frames are painted at the source's clock and appended to every
viewer's FIFO, as aiortc's MediaPlayer and MediaRelay do with a capture device. Theirs are
unbounded; these hold QUEUE_FRAMES (newer frames are dropped when full) so that a viewer whose
encoder falls behind costs latency, as in aiortc, but not the machine's memory.

With --source pull each viewer's encoder instead pulls frames from a track of its own that
paints a frame when asked (when it is due, or at once when late): nothing ever waits in a
queue, but the source's rate drops to what the encoder keeps up with.

A session of an app (APPS: the built-in game, the timecode probe) runs it in an Xvfb of its own
and captures it as aiortc's users do: MediaPlayer's x11grab at the session's rate, one
MediaRelay subscriber per viewer (unbuffered: each viewer's encoder takes the newest frame).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import av
from aiohttp import web
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaPlayer, MediaRelay
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from encoder.display import XDisplay
from farm import lifetime
from tests.encoder.streamclient import PatternTrack, prefer_h264

#: apps a session may run besides the test pattern: argv, started with DISPLAY set
APPS = {
    "game": [sys.executable, "-m", "encoder.game"],
    "timecode": [sys.executable, "-m", "encoder.timecode"],
}

#: frames a viewer's FIFO holds (1 s at 60 fps)
QUEUE_FRAMES = 60


class LiveSource:
    """The session's source, running at its own clock while anyone watches."""

    def __init__(self, track: PatternTrack) -> None:
        self.track = track
        self.queues: list[asyncio.Queue[av.VideoFrame]] = []
        self.task: asyncio.Task[None] | None = None

    def subscribe(self, viewer: ViewerTrack) -> None:
        self.queues.append(viewer.queue)
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())

    def unsubscribe(self, viewer: ViewerTrack) -> None:
        if viewer.queue in self.queues:
            self.queues.remove(viewer.queue)
        if not self.queues and self.task is not None:
            self.task.cancel()
            self.task = None

    async def _run(self) -> None:
        while True:
            frame = await self.track.recv()
            for queue in self.queues:
                if not queue.full():
                    queue.put_nowait(frame)

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None
        self.track.stop()


class ViewerTrack(MediaStreamTrack):
    """One viewer's FIFO of the source's frames (what its encoder reads)."""

    kind = "video"

    def __init__(self, source: LiveSource) -> None:
        super().__init__()
        self.source = source
        self.queue: asyncio.Queue[av.VideoFrame] = asyncio.Queue(QUEUE_FRAMES)
        self.subscribed = False

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if not self.subscribed:
            # from the encoder's first read on: frames painted while the peer was still
            # connecting would otherwise sit in the FIFO for the whole session
            self.subscribed = True
            self.source.subscribe(self)
        return await self.queue.get()

    def stop(self) -> None:
        super().stop()
        self.source.unsubscribe(self)


class AppSource:
    """An app in its own Xvfb, captured by MediaPlayer (x11grab) and fanned out by MediaRelay."""

    def __init__(self, app: str, width: int, height: int, fps: int) -> None:
        self.display = XDisplay(width, height)
        self.display.start()
        env = {**os.environ, "DISPLAY": self.display.name}
        self.proc = subprocess.Popen(
            [*APPS[app], *([str(fps)] if app == "timecode" else [])],
            env=env,
            stdin=subprocess.DEVNULL,
            preexec_fn=lifetime.die_with_parent(signal.SIGKILL),
        )
        options = {"framerate": str(fps), "video_size": f"{width}x{height}", "draw_mouse": "1"}
        self.player = MediaPlayer(self.display.name, format="x11grab", options=options)
        self.relay = MediaRelay()

    def track(self) -> MediaStreamTrack:
        assert self.player.video is not None
        return self.relay.subscribe(self.player.video, buffered=False)

    def stop(self) -> None:
        if self.player.video is not None:
            self.player.video.stop()
        self.proc.terminate()
        self.proc.wait()
        self.display.stop()


STATIC = Path(__file__).resolve().parents[2] / "encoder" / "static"


class PlainSession:
    def __init__(self, width: int, height: int, fps: int, app: str = "testpattern") -> None:
        self.id = uuid.uuid4().hex[:12]
        self.app = app
        self.width, self.height, self.fps = width, height, fps
        self.source = LiveSource(PatternTrack(width, height, fps))
        self.app_source = AppSource(app, width, height, fps) if app in APPS else None
        self.peers: dict[str, RTCPeerConnection] = {}

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.id,
            "app": self.app,
            "device_id": "plain-aiortc",
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "state": "running",
            "viewers": [
                {"viewer_id": v, "role": "player", "controlling": False} for v in self.peers
            ],
            "encoder": "aiortc-libx264",
        }

    async def close(self) -> None:
        await asyncio.gather(*(pc.close() for pc in self.peers.values()))
        self.peers.clear()
        self.source.stop()
        if self.app_source is not None:
            self.app_source.stop()


SESSIONS = web.AppKey("sessions", dict[str, PlainSession])
PULL = web.AppKey("pull", bool)


def error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


async def create_session(request: web.Request) -> web.Response:
    body = await request.json()
    app = str(body.get("app", "testpattern"))
    if app != "testpattern" and app not in APPS:
        return error(404, "not_found", f"no app {app!r}")
    session = PlainSession(
        int(body.get("width", 1280)), int(body.get("height", 720)), int(body.get("fps", 30)), app
    )
    request.app[SESSIONS][session.id] = session
    return web.json_response(session.to_json(), status=201)


async def get_session(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].get(request.match_info["sid"])
    if session is None:
        return error(404, "not_found", "no such session")
    return web.json_response(session.to_json())


async def delete_session(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].pop(request.match_info["sid"], None)
    if session is None:
        return error(404, "not_found", "no such session")
    await session.close()
    return web.Response(status=204)


async def add_viewer(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].get(request.match_info["sid"])
    if session is None:
        return error(404, "not_found", "no such session")
    body = await request.json()
    pc = RTCPeerConnection()
    viewer_id = uuid.uuid4().hex[:12]
    session.peers[viewer_id] = pc

    def on_channel(channel: Any) -> None:
        def on_message(message: str) -> None:
            msg = json.loads(message)
            if msg.get("t") == "ping":
                channel.send(json.dumps({"t": "pong", "ts": msg["ts"]}))

        channel.on("message", on_message)

    pc.on("datachannel", on_channel)

    await pc.setRemoteDescription(RTCSessionDescription(body["sdp"], "offer"))
    for transceiver in pc.getTransceivers():
        if transceiver.kind == "video":
            prefer_h264(transceiver)
            transceiver.direction = "sendonly"
            if session.app_source is not None:
                track: MediaStreamTrack = session.app_source.track()
            elif request.app[PULL]:
                track = PatternTrack(session.width, session.height, session.fps)
            else:
                track = ViewerTrack(session.source)
            transceiver.sender.replaceTrack(track)
    await pc.setLocalDescription(await pc.createAnswer())
    return web.json_response(
        {
            "viewer_id": viewer_id,
            "role": body.get("role", "player"),
            "type": "answer",
            "sdp": pc.localDescription.sdp,
        }
    )


async def delete_viewer(request: web.Request) -> web.Response:
    session = request.app[SESSIONS].get(request.match_info["sid"])
    pc = session.peers.pop(request.match_info["vid"], None) if session else None
    if pc is None:
        return error(404, "not_found", "no such viewer")
    await pc.close()
    return web.Response(status=204)


def static_file(name: str) -> Any:
    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / name)

    return handler


async def close_sessions(app: web.Application) -> None:
    await asyncio.gather(*(s.close() for s in app[SESSIONS].values()))


def create_app(pull: bool = False) -> web.Application:
    app = web.Application()
    app[SESSIONS] = {}
    app[PULL] = pull
    app.router.add_post("/api/streams/sessions", create_session)
    app.router.add_get("/api/streams/sessions/{sid}", get_session)
    app.router.add_delete("/api/streams/sessions/{sid}", delete_session)
    app.router.add_post("/api/streams/sessions/{sid}/viewers", add_viewer)
    app.router.add_delete("/api/streams/sessions/{sid}/viewers/{vid}", delete_viewer)
    app.router.add_get("/player", static_file("player.html"))
    app.router.add_get("/player.js", static_file("player.js"))
    app.router.add_get("/player.css", static_file("player.css"))
    # the player's modules (its request helper) load from /static/
    app.router.add_get("/static/request.js", static_file("request.js"))
    app.on_shutdown.append(close_sessions)
    return app


async def serve(host: str, port: int, pull: bool) -> None:
    runner = web.AppRunner(create_app(pull))
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    print(json.dumps({"url": f"http://{bound[0]}:{bound[1]}", "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--source", choices=("live", "pull"), default="live")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.source == "pull"))


if __name__ == "__main__":
    main()
