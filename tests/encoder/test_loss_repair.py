"""How a viewer's sender answers loss (encoder/peers.py, LossRepair), in front of what aiortc's
sender and transport do: each NACK gets two retransmissions, and for a while after one the
last packet of every video frame is followed by a copy, so that a lost last packet does not
wait a frame interval for the next frame to reveal it."""

from __future__ import annotations

import asyncio

from aiortc.rtp import RtpPacket

from encoder import peers

VIDEO, SOUND = 1111, 2222


class Transport:
    """A viewer's DTLS transport's RTP send, here recording."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, int, bool]] = []  # (ssrc, sequence number, marker)

    async def _send_rtp(self, data: bytes) -> None:
        packet = RtpPacket.parse(data)
        self.sent.append((packet.ssrc, packet.sequence_number, bool(packet.marker)))


class Sender:
    """The part of aiortc's RTCRtpSender LossRepair uses: its SSRC, transport and RTX."""

    _ssrc = VIDEO

    def __init__(self) -> None:
        self.transport = Transport()
        self.retransmitted: list[int] = []

    async def _retransmit(self, sequence_number: int) -> None:
        self.retransmitted.append(sequence_number)


def rtp(ssrc: int, seq: int, marker: bool) -> bytes:
    packet = RtpPacket(payload_type=102, sequence_number=seq, timestamp=seq // 3, ssrc=ssrc)
    packet.marker = int(marker)
    packet.payload = b"x" * 100
    return packet.serialize()


def test_nacks_are_answered_twice_and_then_each_frames_last_packet_is_copied() -> None:
    now = [100.0]
    sender = Sender()

    async def main() -> peers.LossRepair:
        repair = peers.LossRepair(sender, clock=lambda: now[0])  # type: ignore[arg-type]
        send = sender.transport._send_rtp  # the transport's send, wrapped
        # a clean path: nothing is copied
        await send(rtp(VIDEO, 1, False))
        await send(rtp(VIDEO, 2, True))
        assert sender.retransmitted == []
        # the viewer reports packet 1 lost (aiortc calls the sender's _retransmit)
        await sender._retransmit(1)
        assert sender.retransmitted == [1, 1]
        # from now on a frame's last packet is followed by its copy; nothing else is
        await send(rtp(VIDEO, 3, False))
        await send(rtp(VIDEO, 4, True))
        await send(rtp(SOUND, 9, True))
        assert sender.retransmitted == [1, 1, 4]
        # until the path has been clean for TAIL_COPY_S
        now[0] += peers.TAIL_COPY_S + 0.1
        await send(rtp(VIDEO, 5, True))
        assert sender.retransmitted == [1, 1, 4]
        return repair

    repair = asyncio.run(main())
    assert [seq for _, seq, _ in sender.transport.sent] == [1, 2, 3, 4, 9, 5]
    assert (repair.nacked, repair.tail_copies) == (1, 1)
