"""An aiortc client of the stream service for tests and benchmarks: signalling per the contract,
a receiver that completes a frame on the RTP marker bit, and the test pattern's stamp reader."""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import av
import numpy as np
import numpy.typing as npt
from aiortc import RTCPeerConnection, RTCRtpTransceiver, RTCSessionDescription
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtcrtpsender import RTCRtpSender
from aiortc.rtp import RtpPacket

from encoder import testpattern

#: aiortc's video jitter buffer size (packets); a 720p keyframe fits many times over
JITTER_CAPACITY = 512


class MarkerJitterBuffer(JitterBuffer):
    """aiortc's jitter buffer, but a frame is complete when its last packet (RTP marker bit) is in.

    The stock buffer hands a frame to the decoder only when the first packet of the *next* frame
    arrives, which adds one whole frame interval (16.7 ms at 60 fps) to every frame. Browsers
    complete frames on the marker bit; so does this. A frame whose marker packet never came is
    still emitted when the next timestamp starts, as the stock buffer does.
    """

    def __init__(self, capacity: int = JITTER_CAPACITY) -> None:
        super().__init__(capacity=capacity, is_video=True)

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        assert self._origin is not None
        packets: list[RtpPacket] = []
        timestamp: int | None = None
        for count in range(self._capacity):
            packet = self._packets[(self._origin + count) % self._capacity]
            if packet is None:
                return None
            if timestamp is not None and packet.timestamp != timestamp:
                self.remove(count)
                return _joined(packets, timestamp)
            timestamp = packet.timestamp
            packets.append(packet)
            if packet.marker:
                self.remove(count + 1)
                return _joined(packets, timestamp)
        return None


class CountingJitterBuffer(MarkerJitterBuffer):
    """A marker-aware buffer that counts complete frames and bytes and never decodes them.

    For viewers whose pixels nobody looks at (spectators in a density benchmark): the client then
    costs next to no CPU, so the machine's cores go to the senders being measured.
    """

    def __init__(self, capacity: int = JITTER_CAPACITY) -> None:
        super().__init__(capacity)
        self.frames = 0
        self.bytes = 0
        self.last_frame_s = 0.0

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        pli, frame = super().add(packet)
        if frame is not None:
            self.frames += 1
            self.bytes += len(frame.data)
            self.last_frame_s = time.monotonic()
        return pli, None


def _joined(packets: list[RtpPacket], timestamp: int) -> JitterFrame:
    return JitterFrame(data=b"".join(p._data for p in packets), timestamp=timestamp)  # type: ignore[attr-defined]


def install_jitter_buffer(receiver: RTCRtpReceiver, buffer: JitterBuffer) -> None:
    """Swap the receiver's jitter buffer (before any packet arrives)."""
    # aiortc keeps it in a name-mangled private attribute; there is no public hook
    setattr(receiver, "_RTCRtpReceiver__jitter_buffer", buffer)  # noqa: B010


def prefer_h264(transceiver: RTCRtpTransceiver) -> None:
    """Offer H.264 only, so a plain aiortc sender encodes what the stream service sends."""
    caps = RTCRtpSender.getCapabilities("video")
    transceiver.setCodecPreferences(
        [c for c in caps.codecs if c.mimeType in ("video/H264", "video/rtx")]
    )


# ---------------------------------------------------------------- the test pattern's stamp


Luma = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class Stamp:
    counter: int
    capture_us: int  # the sender's time.time() in microseconds when the frame was captured

    @property
    def capture_s(self) -> float:
        return self.capture_us / 1e6


def read_stamp_luma(luma: Luma) -> Stamp:
    """The stamp of encoder/testpattern.py, each square read as the mean of a 4x4 patch at its
    centre (robust to the encoder's ringing where a single pixel might not be)."""
    x0, y0 = testpattern.ORIGIN
    sq, n = testpattern.SQUARE_PX, testpattern.BITS_PER_ROW
    xs = (x0 + np.arange(n) * sq + sq // 2)[:, None] + np.arange(-2, 2)
    weights = np.uint64(1) << np.arange(n, dtype=np.uint64)
    words = []
    for row in range(testpattern.STAMP_ROWS):
        y = y0 + row * sq + sq // 2
        means = luma[y - 2 : y + 2][:, xs.ravel()].reshape(4, n, 4).mean(axis=(0, 2))
        words.append(int(((means >= 128).astype(np.uint64) * weights).sum()))
    return Stamp(counter=words[0], capture_us=words[1] | (words[2] << 32))


def luma_of(frame: av.VideoFrame) -> Luma:
    """The Y plane of a decoded frame without converting the whole picture (a view, no copy)."""
    if frame.format.name not in ("yuv420p", "yuvj420p", "nv12"):
        return np.asarray(frame.to_ndarray(format="gray"), dtype=np.uint8)
    plane = frame.planes[0]
    rows = np.frombuffer(memoryview(plane), np.uint8).reshape(plane.height, plane.line_size)
    return rows[:, : plane.width]


def read_stamp(frame: av.VideoFrame) -> Stamp:
    return read_stamp_luma(luma_of(frame))


# ---------------------------------------------------------------- the plain aiortc baseline

#: (counter, capture_us) -> one yuv420p picture as a (h * 3 / 2, w) uint8 array
Painter = Callable[[int, int], npt.NDArray[np.uint8]]


class PatternTrack(MediaStreamTrack):
    """The test pattern as an aiortc video track, for aiortc's own encoder (the baseline arm).

    Each frame is painted (the service's picture, encoder/testpattern.py) when it is due and
    stamped with that moment, as a capture would be; a late frame is sent late, never skipped,
    which is what a plain aiortc track does.
    """

    kind = "video"

    def __init__(self, width: int, height: int, fps: float, painter: Painter | None = None) -> None:
        super().__init__()
        self.fps = fps
        self.painter = painter or testpattern.Scene(width, height).yuv420p
        self.count = 0
        self._start = 0.0

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self.count == 0:
            self._start = now
        due = self._start + self.count / self.fps
        if due > now:
            await asyncio.sleep(due - now)
        frame = av.VideoFrame.from_ndarray(
            self.painter(self.count, time.time_ns() // 1000), format="yuv420p"
        )
        frame.pts = round(self.count * 90000 / self.fps)
        frame.time_base = fractions.Fraction(1, 90000)
        self.count += 1
        return frame


# ---------------------------------------------------------------- signalling and viewers


class StreamRefused(Exception):
    """The service answered an error ({"error": {"code", "message"}})."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


@dataclass
class ReceivedFrame:
    arrival_s: float  # time.time() when the decoded frame reached the client
    frame: av.VideoFrame


FrameCallback = Callable[[ReceivedFrame], None]
Signal = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class Viewer:
    """One peer connection receiving a stream: decoded frames, an "input" data channel, ping."""

    def __init__(self, decode: bool = True, on_frame: FrameCallback | None = None) -> None:
        self.pc = RTCPeerConnection()
        self.transceiver = self.pc.addTransceiver("video", direction="recvonly")
        prefer_h264(self.transceiver)
        self.counter: CountingJitterBuffer | None = None
        if decode:
            install_jitter_buffer(self.transceiver.receiver, MarkerJitterBuffer())
        else:
            self.counter = CountingJitterBuffer()
            install_jitter_buffer(self.transceiver.receiver, self.counter)
        self.channel = self.pc.createDataChannel("input", ordered=True)
        self.on_frame = on_frame
        self.frames = 0
        self.latest: ReceivedFrame | None = None
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.viewer_id = ""
        self.role = ""
        self._frame_event = asyncio.Event()
        self._open = asyncio.Event()
        self._pongs: dict[float, asyncio.Future[float]] = {}
        self._reader: asyncio.Task[None] | None = None
        self.channel.on("open", self._open.set)
        self.channel.on("message", self._on_message)
        self.pc.on("track", self._on_track)

    async def connect(self, signal: Signal) -> None:
        """Offer (ICE gathering complete), let `signal` return the answer, apply it."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        answer = await signal({"type": "offer", "sdp": self.pc.localDescription.sdp})
        self.viewer_id = str(answer.get("viewer_id", ""))
        self.role = str(answer.get("role", ""))
        await self.pc.setRemoteDescription(RTCSessionDescription(answer["sdp"], "answer"))

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "video" and self.counter is None:
            self._reader = asyncio.ensure_future(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            received = ReceivedFrame(time.time(), frame)  # type: ignore[arg-type]
            self.frames += 1
            self.latest = received
            if self.on_frame is not None:
                self.on_frame(received)
            self._frame_event.set()

    def _on_message(self, message: str | bytes) -> None:
        body = json.loads(message)
        if body.get("t") == "pong":
            future = self._pongs.pop(float(body["ts"]), None)
            if future is not None and not future.done():
                future.set_result(time.perf_counter() * 1000 - float(body["ts"]))
        else:
            self.messages.put_nowait(body)

    async def wait_open(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self._open.wait(), timeout_s)

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send(json.dumps(message))

    async def ping(self, timeout_s: float = 5.0) -> float:
        """Round trip over the data channel, ms."""
        await self.wait_open(timeout_s)
        ts = time.perf_counter() * 1000
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._pongs[ts] = future
        self.send({"t": "ping", "ts": ts})
        return await asyncio.wait_for(future, timeout_s)

    async def next_frame(self, timeout_s: float = 10.0) -> ReceivedFrame:
        """The next decoded frame to arrive from now on."""
        self._frame_event.clear()
        await asyncio.wait_for(self._frame_event.wait(), timeout_s)
        assert self.latest is not None
        return self.latest

    async def wait_frame(
        self, predicate: Callable[[ReceivedFrame], bool], timeout_s: float = 10.0
    ) -> ReceivedFrame:
        """The first frame from now on for which `predicate` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            frame = await self.next_frame(max(0.01, deadline - time.monotonic()))
            if predicate(frame):
                return frame

    @property
    def frames_received(self) -> int:
        return self.counter.frames if self.counter is not None else self.frames

    async def close(self) -> None:
        await self.pc.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


class StreamClient:
    """The stream service's HTTP API (contract: /api/streams/...) over one aiohttp session."""

    def __init__(self, base_url: str, http: aiohttp.ClientSession) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        async with self.http.request(method, self.base_url + path, json=body) as resp:
            if resp.status == 204:
                return None
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                error = data.get("error", {}) if isinstance(data, dict) else {}
                raise StreamRefused(
                    resp.status, str(error.get("code", "")), str(error.get("message", data))
                )
            return data

    async def apps(self) -> list[dict[str, Any]]:
        return list((await self._call("GET", "/api/streams/apps"))["apps"])

    async def create_session(
        self, app: str, width: int | None = None, height: int | None = None, fps: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"app": app}
        for key, value in (("width", width), ("height", height), ("fps", fps)):
            if value is not None:
                body[key] = value
        return dict(await self._call("POST", "/api/streams/sessions", body))

    async def session(self, sid: str) -> dict[str, Any]:
        return dict(await self._call("GET", f"/api/streams/sessions/{sid}"))

    async def delete_session(self, sid: str) -> None:
        await self._call("DELETE", f"/api/streams/sessions/{sid}")

    async def take_control(self, sid: str, viewer_id: str) -> None:
        await self._call("POST", f"/api/streams/sessions/{sid}/control", {"viewer_id": viewer_id})

    async def join(
        self,
        sid: str,
        role: str = "player",
        decode: bool = True,
        on_frame: FrameCallback | None = None,
        rewrite_answer: Callable[[str], Awaitable[str]] | None = None,
    ) -> Viewer:
        """A connected viewer of session `sid` (close it with `leave`); ``rewrite_answer``
        may change the service's answer first (a relay's address for its candidates)."""
        viewer = Viewer(decode=decode, on_frame=on_frame)

        async def signal(offer: dict[str, Any]) -> dict[str, Any]:
            path = f"/api/streams/sessions/{sid}/viewers"
            answer = dict(await self._call("POST", path, {**offer, "role": role}))
            if rewrite_answer is not None:
                answer["sdp"] = await rewrite_answer(str(answer["sdp"]))
            return answer

        try:
            await viewer.connect(signal)
        except BaseException:
            await viewer.close()
            raise
        return viewer

    async def leave(self, sid: str, viewer: Viewer) -> None:
        await viewer.close()
        if viewer.viewer_id:
            # the service may have dropped the peer already when it closed
            with contextlib.suppress(StreamRefused):
                await self._call(
                    "DELETE", f"/api/streams/sessions/{sid}/viewers/{viewer.viewer_id}"
                )
