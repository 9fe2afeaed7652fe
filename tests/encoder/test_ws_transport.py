"""The WebSocket fallback against the real service: a joining viewer gets a keyframe at once,
the session's own encoded frames (one encode for WebRTC and WebSocket viewers alike), the same
input messages drive the app, and the route is authenticated like every other."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import av
import numpy as np
import pytest
from av.video.frame import VideoFrame

from encoder.service import StreamService
from encoder.wsviewer import HEADER, KEYFRAME, VERSION
from tests.encoder import tokens
from tests.encoder.rtcviewer import RtcViewer
from tests.encoder.test_stream_video import api, run

GAME = {"app": "game", "width": 320, "height": 240, "fps": 30}

pytestmark = pytest.mark.usefixtures("no_orphans")


class WsClient:
    """A WebSocket viewer: decodes the video with PyAV, speaks the input JSON."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.decoder = av.CodecContext.create("h264", "r")
        self.hello: dict[str, Any] = {}
        self.replies: list[dict[str, Any]] = []

    async def start(self) -> WsClient:
        self.hello = await self.ws.receive_json(timeout=10)
        assert self.hello["t"] == "hello", self.hello
        return self

    async def message(self, timeout_s: float = 10.0) -> tuple[bool, int, VideoFrame | None]:
        """The next video message: (keyframe, capture time in us, decoded frame or None)."""
        while True:
            msg = await self.ws.receive(timeout=timeout_s)
            if msg.type == aiohttp.WSMsgType.TEXT:
                self.replies.append(msg.json())
                continue
            assert msg.type == aiohttp.WSMsgType.BINARY, msg
            version, flags, capture_us = HEADER.unpack_from(msg.data)
            assert version == VERSION
            frames = self.decoder.decode(av.Packet(msg.data[HEADER.size :]))
            frame = frames[-1] if frames else None
            assert frame is None or isinstance(frame, VideoFrame)
            return bool(flags & KEYFRAME), capture_us, frame

    async def frame(self) -> VideoFrame:
        while True:
            _key, _at, frame = await self.message()
            if frame is not None:
                return frame

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_json(message)


def sprite(frame: VideoFrame) -> tuple[int, int] | None:
    rgb = frame.to_ndarray(format="rgb24").astype(np.int16)
    mask = (rgb[..., 1] > 180) & (rgb[..., 0] < 90) & (rgb[..., 2] < 90)
    if mask.sum() < 50:
        return None
    ys, xs = np.nonzero(mask)
    return round(float(xs.mean())), round(float(ys.mean()))


def test_a_websocket_viewer_gets_a_keyframe_at_once_and_its_keys_move_the_sprite(
    stream_service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", GAME)
        assert status == 201, session
        sid = session["session_id"]
        ws_url = f"{url}/api/streams/sessions/{sid}/ws?role=player"
        # a WebRTC spectator watches the same encode
        spectator = await RtcViewer(http, url, sid).join("spectator")
        async with http.ws_connect(ws_url) as ws:
            client = await WsClient(ws).start()
            assert client.hello["role"] == "player" and client.hello["controlling"]
            key, capture_us, frame = await client.message()
            assert key, "the first message a joining WebSocket viewer gets is a keyframe"
            assert abs(capture_us / 1e6 - time.time()) < 5, "the header carries capture time"
            assert frame is not None and (frame.width, frame.height) == (320, 240)

            start = None
            while start is None:
                start = sprite(await client.frame())
            await client.send({"t": "kd", "code": "ArrowRight"})
            await client.send({"t": "ku", "code": "ArrowRight"})
            deadline = time.monotonic() + 15
            moved = start
            while moved[0] <= start[0] + 10 and time.monotonic() < deadline:
                moved = sprite(await client.frame()) or moved
            assert moved[0] > start[0] + 10, (start, moved)

            # the same round trip as the data channel's
            await client.send({"t": "ping", "ts": 42})
            while not any(r.get("t") == "pong" and r.get("ts") == 42 for r in client.replies):
                await client.message()

            _status, state = await api(http, "GET", f"{url}/api/streams/sessions/{sid}")
            transports = sorted(v.get("transport", "webrtc") for v in state["viewers"])
            assert transports == ["webrtc", "websocket"]
            # one encode for both viewers: the spectator decodes the same frames
            await spectator.next_frame()
        await spectator.close()
        await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")

    run(stream_service, body)


def test_the_websocket_needs_a_token_for_its_session(stream_service: StreamService) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", GAME)
        assert status == 201, session
        sid = session["session_id"]
        try:
            async with aiohttp.ClientSession() as bare:
                path = f"{url}/api/streams/sessions/{sid}/ws"
                for query, expected in (
                    ("", 401),
                    (f"?token={tokens.viewer('another-session')}", 403),
                    (f"?token={tokens.viewer(sid, role='spectator')}&role=player", 403),
                ):
                    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                        await bare.ws_connect(path + query)
                    assert refused.value.status == expected, query
                ok = f"{path}?token={tokens.viewer(sid, role='spectator')}&role=spectator"
                async with bare.ws_connect(ok) as ws:
                    hello = await WsClient(ws).start()
                    assert hello.hello["role"] == "spectator"
        finally:
            await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")

    run(stream_service, body)


def test_a_websocket_viewer_that_stops_reading_is_dropped_to_a_keyframe_not_queued(
    stream_service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        pattern = {"app": "testpattern", "width": 1280, "height": 720, "fps": 30}
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", pattern)
        assert status == 201, session
        sid = session["session_id"]
        try:
            ws_url = f"{url}/api/streams/sessions/{sid}/ws?role=spectator"
            async with http.ws_connect(ws_url, max_msg_size=0) as ws:
                client = await WsClient(ws).start()
                await client.message()
                # stop reading: the socket's buffers fill, the viewer falls behind
                deadline = time.monotonic() + 30
                viewer: dict[str, Any] = {}
                while time.monotonic() < deadline:
                    _s, state = await api(http, "GET", f"{url}/api/streams/sessions/{sid}")
                    viewer = state["viewers"][0]
                    if viewer["catch_ups"] > 0:
                        break
                    await asyncio.sleep(0.2)  # polling the API while the client reads nothing
                assert viewer["catch_ups"] > 0, viewer
                assert viewer["frames_dropped"] > 0
        finally:
            await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")

    run(stream_service, body)
