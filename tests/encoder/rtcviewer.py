"""A viewer for the tests: a real aiortc peer that joins a stream session over the HTTP API,
decodes the video, and speaks the input data channel."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RTCP_PSFB_APP, RtcpPsfbPacket, pack_remb_fci
from av.video.frame import VideoFrame


@dataclass
class Received:
    frame: VideoFrame
    keyframe: bool
    at: float

    def rgb(self) -> npt.NDArray[np.uint8]:
        return np.asarray(self.frame.to_ndarray(format="rgb24"), dtype=np.uint8)

    def luma(self) -> npt.NDArray[np.uint8]:
        return np.asarray(self.frame.to_ndarray(format="gray"), dtype=np.uint8)


class RtcViewer:
    """Joins ``session_id`` at ``base_url`` as ``role``; frames land in ``frames``."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, session_id: str) -> None:
        self.http, self.base_url, self.session_id = http, base_url, session_id
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.frames: asyncio.Queue[Received] = asyncio.Queue()
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.channel = self.pc.createDataChannel("input")
        self.channel_open = asyncio.Event()
        self.viewer_id = ""
        self.role = ""
        self.remote_ssrc = 0
        self._reader: asyncio.Task[None] | None = None
        self.channel.on("open", self.channel_open.set)
        self.channel.on("message", lambda raw: self.messages.put_nowait(json.loads(raw)))
        self.pc.on("track", self._on_track)

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._reader = asyncio.ensure_future(self._read(track))

    async def _read(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                assert isinstance(frame, VideoFrame)
                self.frames.put_nowait(Received(frame, bool(frame.key_frame), time.monotonic()))

    async def join(self, role: str = "player", name: str = "", remb: bool = True) -> RtcViewer:
        """Join; ``remb=False`` leaves REMB out of the offer, so that only ``send_remb`` sets
        the bitrate (aiortc's own estimator would send its figures too)."""
        self.pc.addTransceiver("video", direction="recvonly")
        await self.pc.setLocalDescription(await self.pc.createOffer())
        sdp = self.pc.localDescription.sdp
        if not remb:
            sdp = re.sub(r"^a=rtcp-fb:\d+ goog-remb\r?\n", "", sdp, flags=re.MULTILINE)
        url = f"{self.base_url}/api/streams/sessions/{self.session_id}/viewers"
        body = {"type": "offer", "sdp": sdp, "role": role, "name": name}
        async with self.http.post(url, json=body) as resp:
            data = await resp.json()
            assert resp.status == 200, data
        self.viewer_id, self.role = data["viewer_id"], data["role"]
        found = re.search(r"^a=ssrc:(\d+) ", data["sdp"], re.MULTILINE)
        assert found, "the answer names no SSRC"
        self.remote_ssrc = int(found.group(1))
        await self.pc.setRemoteDescription(RTCSessionDescription(data["sdp"], "answer"))
        return self

    async def next_frame(self, timeout_s: float = 10.0) -> Received:
        return await asyncio.wait_for(self.frames.get(), timeout_s)

    def drain(self) -> list[Received]:
        out = []
        while not self.frames.empty():
            out.append(self.frames.get_nowait())
        return out

    async def send(self, message: dict[str, Any]) -> None:
        await asyncio.wait_for(self.channel_open.wait(), 10)
        self.channel.send(json.dumps(message))

    async def reply(self, kind: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """The next message of type ``kind`` from the service (others are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            message = await asyncio.wait_for(self.messages.get(), max(0.01, left))
            if message.get("t") == kind:
                return message

    async def roundtrip(self) -> None:
        """Every message sent before has been handled by the service (the channel is ordered)."""
        stamp = time.time()
        await self.send({"t": "ping", "ts": stamp})
        while (await self.reply("pong"))["ts"] != stamp:
            pass

    async def send_pli(self) -> None:
        receiver = self.pc.getTransceivers()[0].receiver
        await receiver._send_rtcp_pli(self.remote_ssrc)

    async def send_remb(self, bps: int) -> None:
        """A receiver estimate of ``bps`` for the session's video (RTCP PSFB REMB)."""
        receiver = self.pc.getTransceivers()[0].receiver
        packet = RtcpPsfbPacket(
            fmt=RTCP_PSFB_APP, ssrc=1, media_ssrc=0, fci=pack_remb_fci(bps, [self.remote_ssrc])
        )
        await receiver._send_rtcp(packet)

    async def close(self) -> None:
        await self.pc.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
