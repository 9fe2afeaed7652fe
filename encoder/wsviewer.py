"""WebSocket viewers, the fallback where WebRTC cannot connect (UDP blocked, no TURN): the
session's own encoded H.264 access units and Opus packets as binary messages (no second
encode), each with its capture time, the same JSON input messages as the data channel, latest
frame wins for a slow viewer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType, web
from aiortc.mediastreams import MediaStreamError

from encoder.audio import AudioTrack
from encoder.capture import capture_us_of
from encoder.peers import MAX_PENDING_FRAMES, PacketTrack, with_service_share
from encoder.videoencoder import Packet

log = logging.getLogger("tessera.stream")

#: a media message: this header, then one H.264 access unit (Annex B, SPS/PPS in keyframes) or
#: one Opus packet (48 kHz stereo, 20 ms). Version (1), flags (bit 0: keyframe, bit 1: sound),
#: capture time of its first sample or pixel (microseconds since the epoch)
HEADER = struct.Struct("!BBQ")
VERSION = 1
KEYFRAME = 0x01
SOUND = 0x02
#: the socket's send buffer (bytes; the kernel doubles it): what a viewer's connection may hold
#: beyond the frames queued for it. Small, so that a viewer that cannot keep up drops to the next
#: keyframe within a few frames instead of watching seconds-old video out of a deep buffer
SEND_BUFFER_BYTES = 256 * 1024


def video_message(packet: Packet, keyframe: bool) -> bytes:
    capture_us = capture_us_of(packet.pts or 0)
    return HEADER.pack(VERSION, KEYFRAME if keyframe else 0, capture_us) + bytes(packet)


def sound_message(packet: Packet, capture_us: int) -> bytes:
    return HEADER.pack(VERSION, SOUND, capture_us) + bytes(packet)


class WsViewer:
    """One viewer on a WebSocket: the video sender and the input channel in one connection.

    Its ``track`` is the WebRTC viewers' packet queue: it starts on a keyframe (asked for at
    once), and a viewer whose socket cannot keep up drops to the next keyframe instead of
    queueing. Its ``audio`` (a session with sound) is a WebRTC viewer's sound track: a stuck
    viewer's oldest packets are dropped.
    """

    transport = "websocket"

    def __init__(
        self,
        viewer_id: str,
        role: str,
        name: str,
        ws: web.WebSocketResponse,
        on_keyframe_request: Callable[[], None],
        on_message: Callable[[WsViewer, object], dict[str, Any] | None],
        on_closed: Callable[[WsViewer], None],
        fps: int = 30,
        audio: AudioTrack | None = None,
    ) -> None:
        self.id, self.role, self.name = viewer_id, role, name
        self.ws = ws
        self.audio = audio
        self.on_message, self.on_closed = on_message, on_closed
        self.track = PacketTrack(on_keyframe_request, max(MAX_PENDING_FRAMES, fps // 4))
        self.estimate_bps: int | None = None
        self.keyframe_requests = 0
        self.connected = True
        self._closed = False
        self._writes: set[asyncio.Task[None]] = set()

    @staticmethod
    def limit_send_buffer(transport: asyncio.BaseTransport | None) -> None:
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)

    async def run(self) -> None:
        """Send video and take input until the socket closes."""
        senders = [asyncio.create_task(self._send_video(), name=f"ws-video-{self.id}")]
        if self.audio is not None:
            sound = self._send_sound(self.audio)
            senders.append(asyncio.create_task(sound, name=f"ws-sound-{self.id}"))
        try:
            async for msg in self.ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    reply = self.on_message(self, msg.data)
                    if reply is not None:
                        reply = with_service_share(reply, self.track)
                        await self.ws.send_str(json.dumps(reply))
                elif msg.type == WSMsgType.ERROR:
                    break
        except (ConnectionError, RuntimeError):  # the socket went away mid-send
            pass
        finally:
            for sender in senders:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sender
            self._stop_tracks()
            self._notify_closed()

    async def _send_video(self) -> None:
        # MediaStreamError: the track stopped (the viewer is closing)
        with contextlib.suppress(ConnectionError, RuntimeError, MediaStreamError):
            while not self.ws.closed:
                packet = await self.track.recv()
                await self.ws.send_bytes(video_message(packet, bool(packet.is_keyframe)))

    async def _send_sound(self, audio: AudioTrack) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError, MediaStreamError):
            while not self.ws.closed:
                packet = await audio.recv()
                await self.ws.send_bytes(sound_message(packet, audio.capture_us(packet.pts)))

    def _stop_tracks(self) -> None:
        self.track.stop()
        if self.audio is not None:
            self.audio.stop()

    def send(self, message: dict[str, Any]) -> None:
        if self.ws.closed:
            return
        task = asyncio.ensure_future(self._send_text(json.dumps(message)))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _send_text(self, text: str) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.send_str(text)

    def _notify_closed(self) -> None:
        self.connected = False
        if not self._closed:
            self._closed = True
            self.on_closed(self)

    async def close(self) -> None:
        self._closed = True
        self.connected = False
        self._stop_tracks()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self.ws.close()

    async def round_trip_s(self) -> float | None:
        """Not measured by the service on this transport (the player shows its ping)."""
        return None

    def to_json(self, controlling: bool) -> dict[str, Any]:
        return {
            "viewer_id": self.id,
            "role": self.role,
            "name": self.name,
            "controlling": controlling,
            "transport": self.transport,
            "state": "closed" if self.ws.closed else "connected",
            "frames_sent": self.track.sent,
            "frames_dropped": self.track.dropped,
            "sound_sent": self.audio.sent if self.audio is not None else 0,
            "sound_dropped": self.audio.dropped if self.audio is not None else 0,
            "catch_ups": self.track.catch_ups,
            "keyframe_requests": self.keyframe_requests,
            "estimate_kbps": 0,
        }
