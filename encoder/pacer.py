"""A viewer's RTP pacer: a burst larger than a couple of frames (a keyframe) leaves spread over
time at a multiple of the encoder's bitrate, instead of at once.

Without it a keyframe asked for by a PLI (up to the encoder's rate buffer, then one frame at
the 20 Mbit/s ceiling: 83 KB at 30 fps; now one frame at the current bitrate) left in one
burst, twice what a 3 Mbit/s path's 100 ms queue holds: its tail was dropped, the
retransmissions were dropped with the next burst, and the picture froze
for seconds (bench/stream_loss.py). A token bucket lets ordinary frames through untouched (the
bucket holds ``BURST_FRAMES`` frames at the current bitrate) and paces the rest at
``PACE_FACTOR`` times the bitrate, as WebRTC's pacer does (its factor is 2.5).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

#: the pace of a burst beyond the bucket, as a multiple of the encoder's bitrate
PACE_FACTOR = 2.5
#: frames at the current bitrate (and fps) that leave at once: ordinary frames are never held
BURST_FRAMES = 2.0
#: the bucket never holds less than this, whatever the bitrate (a few full-size packets)
MIN_BURST_BYTES = 8 * 1200
#: the longest a burst is held back in all: beyond it the rest leaves at once. A sender held
#: for a quarter second drops its waiting frames and asks for a keyframe (peers.PacketTrack),
#: which a pace slower than this would turn into a keyframe every quarter second.
MAX_HOLD_S = 0.15


class Pacer:
    """Token bucket in front of ``send``: ``bitrate()`` is the encoder's bitrate now (bit/s)."""

    def __init__(
        self,
        send: Callable[[bytes], Awaitable[None]],
        bitrate: Callable[[], int],
        fps: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send, self._bitrate, self._fps, self._clock = send, bitrate, max(1, fps), clock
        self._lock = asyncio.Lock()  # packets leave in the order they came
        self._tokens: float | None = None
        self._last = 0.0
        #: when the burst being paced was first held (None: nothing held)
        self._holding_since: float | None = None
        #: packets that waited, and the seconds they waited in all (the viewer's JSON shows them)
        self.held = 0
        self.held_s = 0.0

    def _refill(self) -> tuple[float, float]:
        """(bytes per second, bucket size) now; the bucket refilled up to ``now``."""
        bitrate = self._bitrate() or 0  # None once the session is gone
        rate = max(1.0, PACE_FACTOR * bitrate / 8)
        size = max(MIN_BURST_BYTES, BURST_FRAMES * bitrate / 8 / self._fps)
        now = self._clock()
        if self._tokens is None:
            self._tokens = size
        else:
            self._tokens = min(size, self._tokens + (now - self._last) * rate)
        self._last = now
        return rate, size

    async def send(self, data: bytes) -> None:
        async with self._lock:
            rate, size = self._refill()
            assert self._tokens is not None
            wait = (len(data) - self._tokens) / rate
            if wait <= 0:
                self._holding_since = None
            else:
                now = self._last  # the refill's clock reading
                if self._holding_since is None:
                    self._holding_since = now
                wait = min(wait, self._holding_since + MAX_HOLD_S - now)
                if wait > 0:
                    self.held += 1
                    self.held_s += wait
                    await asyncio.sleep(wait)
                    _, size = self._refill()
            # past MAX_HOLD_S the packet goes anyway; the debt is at most one bucket
            self._tokens = max(-size, self._tokens - len(data))
            await self._send(data)


def pace(transport: Any, bitrate: Callable[[], int], fps: int) -> Pacer:
    """Put a pacer in front of every RTP packet ``transport`` (a viewer's bundled DTLS
    transport: video, its retransmissions, sound) sends."""
    pacer = Pacer(transport._send_rtp, bitrate, fps)
    setattr(transport, "_send_rtp", pacer.send)  # noqa: B010
    return pacer
