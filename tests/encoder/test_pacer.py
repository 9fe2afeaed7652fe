"""A viewer's RTP pacer lets ordinary frames through at once and spreads a keyframe's burst at
2.5x the encoder's bitrate, so a slow path's queue is never handed more than it holds
(encoder/pacer.py; bench/stream_loss.py's 3 Mbit/s bottleneck froze for 2.7 s without it)."""

from __future__ import annotations

import asyncio
import time

from encoder.pacer import BURST_FRAMES, MAX_HOLD_S, PACE_FACTOR, Pacer, pace

PACKET = 1200
BITRATE = 1_000_000  # bit/s
FPS = 30


class _Transport:
    """What the pacer sits in front of: the DTLS transport's RTP send, here recording."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, bytes]] = []

    async def _send_rtp(self, data: bytes) -> None:
        self.sent.append((time.monotonic(), data))


def _packets(n: int, tag: int) -> list[bytes]:
    return [bytes([tag]) + i.to_bytes(2, "big") + b"\0" * (PACKET - 3) for i in range(n)]


def test_an_ordinary_frame_leaves_at_once_and_a_keyframe_is_spread() -> None:
    async def run() -> None:
        transport = _Transport()
        pacer = pace(transport, lambda: BITRATE, FPS)
        assert isinstance(pacer, Pacer)
        # a frame at the bitrate's average size: never held
        frame = _packets(BITRATE // 8 // FPS // PACKET, 1)
        t0 = time.monotonic()
        for p in frame:
            await transport._send_rtp(p)  # now the pacer's
        assert pacer.held == 0
        assert time.monotonic() - t0 < 0.05
        # a keyframe of 60 KB right after: what the bucket does not hold leaves at 2.5x
        await asyncio.sleep(0.2)  # the bucket refills
        keyframe = _packets(50, 2)
        t1 = time.monotonic()
        for p in keyframe:
            await transport._send_rtp(p)
        took = time.monotonic() - t1
        bucket = max(8 * PACKET, BURST_FRAMES * BITRATE / 8 / FPS)
        expected = (len(keyframe) * PACKET - bucket) / (PACE_FACTOR * BITRATE / 8)
        assert pacer.held > 0
        assert expected * 0.8 <= took <= expected + 0.5, (took, expected)
        # nothing lost, nothing reordered
        assert [d for _, d in transport.sent] == frame + keyframe

    asyncio.run(run())


def test_concurrent_senders_keep_their_order_behind_a_paced_burst() -> None:
    """Sound and retransmissions share the transport: a packet that comes while a keyframe is
    paced leaves after it, never through it."""

    async def run() -> None:
        transport = _Transport()
        pacer = pace(transport, lambda: BITRATE, FPS)
        packets = _packets(40, 3)
        t0 = time.monotonic()
        burst = asyncio.gather(*(transport._send_rtp(p) for p in packets))
        await asyncio.sleep(0.01)
        await transport._send_rtp(b"sound")
        await burst
        assert [d for _, d in transport.sent] == [*packets, b"sound"]
        # senders that come at once are paced as one queue, not each against a full bucket
        bucket = max(8 * PACKET, BURST_FRAMES * BITRATE / 8 / FPS)
        expected = (len(packets) * PACKET - bucket) / (PACE_FACTOR * BITRATE / 8)
        assert pacer.held > 0
        assert transport.sent[-1][0] - t0 >= expected * 0.8, (transport.sent[-1][0] - t0, expected)

    asyncio.run(run())


def test_no_burst_is_held_longer_than_the_hold_limit() -> None:
    """At a low bitrate a keyframe paced to the end would hold the sender past the quarter
    second after which it drops its frames and asks for another keyframe: a keyframe every
    quarter second. The pacer holds a burst MAX_HOLD_S at most; the rest leaves at once."""

    async def run() -> None:
        transport = _Transport()
        pacer = pace(transport, lambda: 500_000, FPS)
        burst = _packets(170, 4)  # 204 KB: 1.3 s at 2.5x 500 kbit/s
        t0 = time.monotonic()
        for p in burst:
            await transport._send_rtp(p)
        took = time.monotonic() - t0
        assert pacer.held > 0
        assert MAX_HOLD_S * 0.8 <= took <= MAX_HOLD_S + 0.1, took
        assert [d for _, d in transport.sent] == burst

    asyncio.run(run())
