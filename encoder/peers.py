"""WebRTC viewers (aiortc): one peer connection per viewer, fed the session's encoded packets
(aiortc only packetizes them); its keyframe requests and bitrate estimates go to the encoder."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RTCP_PSFB_APP, RTCP_PSFB_FIR, RTCP_PSFB_PLI, RtcpPsfbPacket, unpack_remb_fci

from encoder import playoutdelay
from encoder.audio import AudioTrack
from encoder.pacer import Pacer, pace
from encoder.videoencoder import Packet
from farm.errors import BadParameter

log = logging.getLogger("tessera.stream")

#: a viewer whose sender has more encoded frames than this waiting (and more than a quarter
#: second of them) is behind: it drops them and starts again from a fresh keyframe (latest
#: frame wins). Not less: a keyframe takes a few frame times to send on a busy host, and
#: catching up costs another keyframe.
MAX_PENDING_FRAMES = 3
INPUT_CHANNEL = "input"
#: retransmissions (RTX) sent for each packet a viewer reports lost (NACK)
RETRANSMIT_COPIES = 2
#: after a viewer reports a loss, the last packet of every frame is followed by a copy (as a
#: retransmission) for this long: a receiver finds a lost last packet missing only when the
#: next frame comes, a frame interval later, while a lost packet inside a frame is asked for
#: (NACK) as soon as the packet after it arrives
TAIL_COPY_S = 10.0


class PacketTrack(MediaStreamTrack):
    """A video track whose ``recv`` returns encoded H.264 packets, for one viewer.

    It starts (and restarts after falling behind) only on a keyframe, asking for one through
    ``want_keyframe``: a viewer never gets a P-frame it cannot decode.
    """

    kind = "video"

    def __init__(
        self, want_keyframe: Callable[[], None], max_pending: int = MAX_PENDING_FRAMES
    ) -> None:
        super().__init__()
        self.want_keyframe = want_keyframe
        self.max_pending = max_pending
        self._pending: deque[Packet] = deque()
        self._ready = asyncio.Event()
        self.waiting_keyframe = True
        self._asked = False
        self.sent = 0
        self.dropped = 0
        self.catch_ups = 0
        #: capture to hand-over to aiortc of the frames sent, ms (moving average): the
        #: service's share of the latency, which the player's latency overlay shows
        self.send_delay_ms: float | None = None

    def push(self, packet: Packet, keyframe: bool) -> None:
        if self.readyState != "live":
            return
        if self.waiting_keyframe and not keyframe:
            self.dropped += 1
            return
        if len(self._pending) >= self.max_pending and not keyframe:
            # behind: what waits is stale; drop it and resume from the next keyframe
            self.dropped += len(self._pending) + 1
            self._pending.clear()
            self.catch_ups += 1
            self.waiting_keyframe = True
            self.want_keyframe()
            return
        if keyframe:
            # a keyframe makes everything before it useless
            self.dropped += len(self._pending)
            self._pending.clear()
            self.waiting_keyframe = False
        self._pending.append(packet)
        self._ready.set()

    async def recv(self) -> Packet:
        if not self._asked:
            # the sender starts pulling once DTLS is up: the first keyframe is made now
            self._asked = True
            self.want_keyframe()
        while not self._pending:
            if self.readyState != "live":
                raise MediaStreamError
            self._ready.clear()
            await self._ready.wait()
        self.sent += 1
        packet = self._pending.popleft()
        if packet.pts is not None:
            # pts is the capture time on the 90 kHz clock (encoder/capture.py)
            delay_ms = time.time_ns() / 1e6 - packet.pts / 90
            last = self.send_delay_ms
            self.send_delay_ms = delay_ms if last is None else 0.9 * last + 0.1 * delay_ms
        return packet

    def stop(self) -> None:
        super().stop()
        self._ready.set()


def with_service_share(
    reply: dict[str, Any], track: PacketTrack, sound: AudioTrack | None = None
) -> dict[str, Any]:
    """A reply to a viewer; a ``pong`` also carries the service's share of the latency, which
    the player adds to the network's and its own (its latency overlay), and, with sound, how
    long the sound waited in the session's sound server (the player's lip sync adds it)."""
    if reply.get("t") != "pong":
        return reply
    if track.send_delay_ms is not None:
        reply["service_ms"] = round(track.send_delay_ms, 2)
    if sound is not None:
        reply["sound_lead_ms"] = round(sound.lead_us() / 1000, 1)
    return reply


def peer_connection(ice_servers: list[dict[str, Any]]) -> RTCPeerConnection:
    """A peer connection for one viewer, with the farm's STUN/TURN servers."""
    return RTCPeerConnection(
        RTCConfiguration(iceServers=[RTCIceServer(**server) for server in ice_servers])
    )


class PeerEndsOnce:
    """A viewer's peer whose owner hears of its end once (``on_closed``), whether its
    connection failed, closed, or the peer was told to go."""

    pc: RTCPeerConnection
    on_closed: Callable[[Any], None]
    _closed = False

    async def _on_state(self) -> None:
        if self.pc.connectionState in ("failed", "closed"):
            self._notify_closed()

    def _notify_closed(self) -> None:
        if not self._closed:
            self._closed = True
            self.on_closed(self)


class Viewer(PeerEndsOnce):
    """One viewer's peer connection: the video sender, and the ``input`` data channel."""

    def __init__(
        self,
        viewer_id: str,
        role: str,
        name: str,
        ice_servers: list[dict[str, Any]],
        on_keyframe_request: Callable[[], None],
        on_bitrate_estimate: Callable[[Viewer, int], None],
        on_message: Callable[[Viewer, object], dict[str, Any] | None],
        on_closed: Callable[[Viewer], None],
        fps: int = 30,
        audio: AudioTrack | None = None,
        bitrate: Callable[[], int] | None = None,
    ) -> None:
        self.id, self.role, self.name = viewer_id, role, name
        #: the encoder's bitrate now: the pace of a keyframe's burst (encoder/pacer.py)
        self.bitrate, self.fps = bitrate, fps
        self.pacer: Pacer | None = None
        self.repair: LossRepair | None = None
        #: the session's sound (encoder/audio.py), sent where the offer has an audio section
        self.audio = audio
        self.on_keyframe_request = on_keyframe_request
        self.on_bitrate_estimate = on_bitrate_estimate
        self.on_message, self.on_closed = on_message, on_closed
        self.track = PacketTrack(on_keyframe_request, max(MAX_PENDING_FRAMES, fps // 4))
        self.pc = peer_connection(ice_servers)
        self.channel: RTCDataChannel | None = None
        self.estimate_bps: int | None = None
        self.keyframe_requests = 0
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    async def answer(self, offer_sdp: str) -> str:
        """The complete answer (ICE gathered) to a viewer's complete offer."""
        # the browser shows each frame at once (when its offer has the extension)
        playoutdelay.enable()
        transceiver = self.pc.addTransceiver(self.track, direction="sendonly")
        h264 = [
            codec
            for codec in RTCRtpSender.getCapabilities("video").codecs
            if codec.mimeType.lower() in ("video/h264", "video/rtx")
        ]
        transceiver.setCodecPreferences(h264)
        if self.audio is not None and "m=audio" in offer_sdp:
            sound = self.pc.addTransceiver(self.audio, direction="sendonly")
            sound.setCodecPreferences(
                [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.name == "opus"]
            )
        await take_offer(self.pc, transceiver, offer_sdp)
        _route_rtcp(transceiver.sender, self)
        if self.bitrate is not None:
            self.pacer = pace(transceiver.sender.transport, self.bitrate, self.fps)
        self.repair = LossRepair(transceiver.sender)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return str(self.pc.localDescription.sdp)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != INPUT_CHANNEL:
            return
        self.channel = channel
        channel.on("message", self._on_raw_message)

    def _on_raw_message(self, raw: object) -> None:
        # the session parses it (encoder/messages.py: limits, drops counted, never a disconnect)
        reply = self.on_message(self, raw)
        if reply is not None:
            self.send(with_service_share(reply, self.track, self.audio))

    def send(self, message: dict[str, Any]) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(message))

    def keyframe_requested(self) -> None:
        self.keyframe_requests += 1
        self.on_keyframe_request()

    def estimated(self, bps: int) -> None:
        self.estimate_bps = bps
        self.on_bitrate_estimate(self, bps)

    async def round_trip_s(self) -> float | None:
        """The round trip to this viewer from RTCP receiver reports (None before the first)."""
        report = await self.pc.getStats()
        trips = [
            float(stat.roundTripTime)
            for stat in report.values()
            if getattr(stat, "type", "") == "remote-inbound-rtp"
            and getattr(stat, "roundTripTime", None) is not None
        ]
        return trips[0] if trips else None

    async def close(self) -> None:
        self._closed = True
        self.track.stop()
        if self.audio is not None:
            self.audio.stop()
        await self.pc.close()

    def to_json(self, controlling: bool) -> dict[str, Any]:
        return {
            "viewer_id": self.id,
            "role": self.role,
            "name": self.name,
            "controlling": controlling,
            "state": self.pc.connectionState,
            "frames_sent": self.track.sent,
            "frames_dropped": self.track.dropped,
            "catch_ups": self.track.catch_ups,
            "keyframe_requests": self.keyframe_requests,
            "estimate_kbps": (self.estimate_bps or 0) // 1000,
            # packets the pacer held back (a keyframe's burst), and for how long in all
            "paced_packets": self.pacer.held if self.pacer is not None else 0,
            "paced_ms": round(self.pacer.held_s * 1000) if self.pacer is not None else 0,
            # packets the viewer reported lost (NACK), and frames whose last packet was copied
            "nacked_packets": self.repair.nacked if self.repair is not None else 0,
            "tail_copies": self.repair.tail_copies if self.repair is not None else 0,
        }


def _route_rtcp(sender: RTCRtpSender, viewer: Viewer) -> None:
    """Hand PLI/FIR and REMB for ``sender`` to the session's encoder, then to aiortc.

    On the packet path aiortc's own handler only sets a flag its built-in encoder reads (PLI,
    FIR) and passes REMB to that encoder: both would be lost.
    """
    handle = sender._handle_rtcp_packet

    async def routed(packet: Any) -> None:
        if isinstance(packet, RtcpPsfbPacket):
            if packet.fmt in (RTCP_PSFB_PLI, RTCP_PSFB_FIR):
                viewer.keyframe_requested()
            elif packet.fmt == RTCP_PSFB_APP:
                try:
                    bitrate, ssrcs = unpack_remb_fci(packet.fci)
                except ValueError:
                    bitrate, ssrcs = 0, []
                if sender._ssrc in ssrcs and bitrate > 0:
                    viewer.estimated(bitrate)
        await handle(packet)

    setattr(sender, "_handle_rtcp_packet", routed)  # noqa: B010


class LossRepair:
    """How a viewer's video sender answers loss, in front of aiortc's sender and transport.

    - Each NACK is answered with ``RETRANSMIT_COPIES`` retransmissions (RTX). A receiver asks
      again for a lost retransmission only after its round-trip estimate, which a receive-only
      browser cannot measure (Chromium then assumes 100 ms), so each lost retransmission would
      hold the picture that long; two copies make that a loss-squared event (0.25 % at 5 %).
    - For ``TAIL_COPY_S`` after a NACK, the last packet of each frame (RTP marker) is followed
      by one retransmission of it: the receiver drops the copy when it has the packet, and
      otherwise has it a frame interval sooner than a NACK would bring it.
    Lost packets and last packets are a small share of the stream, so their copies cost little.
    """

    def __init__(self, sender: RTCRtpSender, clock: Callable[[], float] = time.monotonic) -> None:
        self._retransmit = sender._retransmit
        self._ssrc = sender._ssrc
        self._clock = clock
        self._last_nack: float | None = None
        self.nacked = 0
        self.tail_copies = 0
        setattr(sender, "_retransmit", self.retransmit)  # noqa: B010
        transport = sender.transport
        self._send = transport._send_rtp
        setattr(transport, "_send_rtp", self.send)  # noqa: B010

    async def retransmit(self, sequence_number: int) -> None:
        """A NACK's packet (aiortc calls this once per packet reported lost)."""
        self.nacked += 1
        self._last_nack = self._clock()
        for _ in range(RETRANSMIT_COPIES):
            await self._retransmit(sequence_number)

    async def send(self, data: bytes) -> None:
        """Every RTP packet of the viewer's transport (video, retransmissions, sound)."""
        await self._send(data)
        if (
            self._last_nack is not None
            and len(data) >= 12
            and data[1] & 0x80  # the marker: the frame's last packet
            and int.from_bytes(data[8:12], "big") == self._ssrc  # video, not RTX or sound
            and self._clock() - self._last_nack < TAIL_COPY_S
        ):
            self.tail_copies += 1
            await self._retransmit(int.from_bytes(data[2:4], "big"))


async def take_offer(pc: RTCPeerConnection, video: Any, offer_sdp: str) -> None:
    """Set a viewer's offer as ``pc``'s remote description; BadParameter (400) for an offer
    that is not SDP, that aiortc cannot take, or that left the ``video`` transceiver unused."""
    try:
        await pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
    except (ValueError, KeyError, IndexError) as exc:
        raise BadParameter(f"the offer is not a usable SDP offer: {exc}") from exc
    except Exception as exc:
        # aiortc raises its own OperationError/InvalidStateError for offers it cannot take
        raise BadParameter(f"the offer could not be accepted: {exc}") from exc
    if video.mid is None:
        raise BadParameter("the offer has no video (add a recvonly video transceiver)")
