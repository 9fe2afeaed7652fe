"""How much video a device can encode: its throughput measured at the service's start (or
configured), and whether a session of a given size and rate fits beside the running ones."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from av.video.frame import VideoFrame

from encoder.testpattern import Scene
from encoder.videoencoder import EncoderConfig, open_encoder, start_bitrate
from farm.errors import NeverFits, NoCapacity
from farm.settings import Settings

log = logging.getLogger("tessera.stream")

#: the probe: this many frames of this size, after a few to warm the encoder up
PROBE_SIZE = (640, 360)
PROBE_FRAMES, PROBE_WARMUP = 24, 4
#: a session the device could encode at under 1/NEVER_FACTOR of its asked rate is refused: the
#: probe encodes a test pattern that changes everywhere, most apps' screens do not
NEVER_FACTOR = 2.0
#: sessions together may ask for this many times the measured throughput: captured on damage,
#: a mostly still screen costs the encoder a fraction of a full frame (on a 2-core host the
#: probe measured 80-87 Mpx/s and the game held 29 fps with 10-11 sessions of 720p30: 3.5x)
SHARE_FACTOR = 4.0


def probe_mpx_s(settings: Settings, gpu_index: int | None) -> float:
    """Megapixels a second the device's encoder sustains, measured on the test pattern."""
    width, height = PROBE_SIZE
    fps = 30
    min_bps, max_bps = settings.stream_min_kbps * 1000, settings.stream_max_kbps * 1000
    config = EncoderConfig(
        width=width, height=height, fps=fps,
        bitrate_bps=start_bitrate(width, height, fps, min_bps, max_bps),
        min_bps=min_bps, max_bps=max_bps, gpu_index=gpu_index,
    )  # fmt: skip
    scene = Scene(width, height)
    frames = [
        VideoFrame.from_ndarray(scene.yuv420p(n, n * 33_333), format="yuv420p")
        for n in range(PROBE_FRAMES + PROBE_WARMUP)
    ]
    encoder = open_encoder(settings.nvenc, config)
    try:
        for n, frame in enumerate(frames):
            if n == PROBE_WARMUP:
                started = time.perf_counter()
            frame.pts = n * 3000
            encoder.encode(frame)
        took_s = time.perf_counter() - started
    finally:
        encoder.close()
    return PROBE_FRAMES * width * height / took_s / 1e6


@dataclass(frozen=True)
class Demand:
    width: int
    height: int
    fps: int

    @property
    def mpx_s(self) -> float:
        return self.width * self.height * self.fps / 1e6

    def __str__(self) -> str:
        return f"{self.width}x{self.height}@{self.fps}"


def check(capacity_mpx_s: float, running: list[Demand], asked: Demand, device: str) -> None:
    """NeverFits when ``asked`` alone is more than the device encodes, NoCapacity when it does
    not fit beside the ``running`` sessions; the message says what the device can do."""
    alone = capacity_mpx_s * NEVER_FACTOR
    if asked.mpx_s > alone:
        most_fps = int(alone * 1e6 / (asked.width * asked.height))
        raise NeverFits(
            f"device {device} encodes about {capacity_mpx_s:.0f} Mpx/s (measured): {asked} needs "
            f"{asked.mpx_s:.0f} Mpx/s; ask for a smaller size or at most {most_fps} fps",
            device=device,
        )
    used = sum(d.mpx_s for d in running)
    budget = capacity_mpx_s * SHARE_FACTOR
    if used + asked.mpx_s > budget:
        raise NoCapacity(
            f"device {device} is busy encoding: its sessions take {used:.0f} of about "
            f"{budget:.0f} Mpx/s and {asked} needs {asked.mpx_s:.0f}; try again later, a "
            "smaller size, or another device",
            device=device,
        )
