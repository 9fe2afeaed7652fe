"""The estimate model: a job's render time per frame on each device class, from the probe's
measured renders, and the wall time, device-hours, cost, energy and CO2e that follow.

The time of one render task (a tile, or a part of a sample split) is a fixed cost plus a cost
per sample per pixel, and each worker pays the scene's sync (BVH build, object updates) once
per frame it renders tasks of [measured on this machine with bpy 5.0.1: time = 0.02 s +
2.1 us x samples x pixels on the example scene, linear from 1 to 64 samples and from 64x36 to
256x144 pixels; README "Estimates"]. The probe (workers.blender.probe) measures the three on
the scene at a low resolution, for up to a few frames; a job's frame is priced from the nearest
probed frames (linear in between). Adaptive sampling scales the sample cost by the share of
samples it took on patches of the frame at the scene's own count (adaptive_share); denoising
adds a cost per pixel (DENOISE_S_PER_MPX). Times on one class become times on another through
speed ratios: measured by the farm from its jobs (farm.estimaterecords) where it has them, else
the settings' or DEFAULT_SPEEDS. Everything here is pure; the caller brings the devices, rates
and ratios.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from farm.alloc.usage import Rates
from farm.errors import BadParameter
from farm.models import SAMPLE_SPLIT, InspectionReport, JobSpec
from farm.tiling import TileGrid, plan_tiles

#: relative render speed of each device class, a host's CPUs = 1, until the farm has measured
#: a ratio from real jobs (FARM_DEVICE_SPEEDS overrides). Rough placeholders, not measured by
#: this project (it has had no GPU to time): the farm replaces them pair by pair as jobs finish.
DEFAULT_SPEEDS: dict[str, float] = {
    "cpu": 1.0,
    "t4": 4.0,
    "a10": 9.0,
    "a10g": 8.0,
    "a16": 2.0,
    "a40": 14.0,
    "l4": 8.0,
    "l40": 20.0,
    "l40s": 22.0,
    "rtx3090": 14.0,
    "rtx4090": 28.0,
    "a100": 14.0,
    "h100": 22.0,
    "h200": 24.0,
    "*": 8.0,
}
ANY = "*"
#: seconds to denoise a megapixel once on a host's CPUs (OIDN on the stitched frame, with its
#: EXR round trip): 29 to 43 s/MPx at 384x216, 768x432 and 1152x648 on this project's 2 shared
#: cores (load 5-6); other classes through their speed ratio to the CPU
DENOISE_S_PER_MPX = 30.0
#: a task's fixed cost is never taken below this (timer noise can make the fit negative)
MIN_FIXED_S = 0.001
#: the least share of samples adaptive sampling is taken to keep
MIN_ADAPTIVE_SHARE = 0.02


@dataclass(frozen=True)
class ProbedFrame:
    """The probe's renders of one frame, as the Blender child timed them (seconds)."""

    frame: int
    first_s: float
    """One sample right after the frame change: sync + fixed + one sample on every pixel."""
    fixed_s: float
    """A tile of a few pixels at one sample: the fixed cost of a render task."""
    samples: int
    sampled_s: float
    """``samples`` samples, adaptive sampling off: fixed + ``samples`` on every pixel."""
    adaptive: tuple[tuple[int, int, float], ...] = ()
    """Adaptive renders of patches of the full-size frame at the scene's samples (when the
    scene samples adaptively): (pixels, samples, seconds) each."""


@dataclass(frozen=True)
class Probe:
    """What the probe measured, on which device (the inspection report carries it)."""

    device_class: str
    device: str
    width: int
    height: int
    scene_samples: int
    adaptive: bool
    frames: tuple[ProbedFrame, ...]
    took_s: float

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Probe:
        frames = tuple(
            ProbedFrame(
                frame=int(f["frame"]),
                first_s=float(f["first_s"]),
                fixed_s=float(f["fixed_s"]),
                samples=int(f["samples"]),
                sampled_s=float(f["sampled_s"]),
                adaptive=tuple(
                    (int(p["pixels"]), int(p["samples"]), float(p["render_s"]))
                    for p in f.get("adaptive") or ()
                ),
            )
            for f in data["frames"]
        )
        if not frames:
            raise BadParameter("the probe rendered no frame")
        return cls(
            device_class=str(data["device_class"]),
            device=str(data.get("device", "")),
            width=int(data["width"]),
            height=int(data["height"]),
            scene_samples=int(data["scene_samples"]),
            adaptive=bool(data["adaptive"]),
            frames=frames,
            took_s=float(data.get("took_s", 0.0)),
        )


@dataclass(frozen=True)
class FrameCost:
    """The fitted costs of one probed frame on the probe's class."""

    frame: int
    sync_s: float
    task_s: float
    """Fixed cost of one render task."""
    sample_pixel_s: float
    """Cost of one sample on one pixel."""
    adaptive_share: float
    """Share of the samples adaptive sampling takes (1 without it)."""


def fit(probe: Probe) -> list[FrameCost]:
    """Each probed frame's costs, from its renders (sorted by frame)."""
    pixels = probe.width * probe.height
    out = []
    for f in sorted(probe.frames, key=lambda f: f.frame):
        task = max(MIN_FIXED_S, f.fixed_s)
        per_sample = max(0.0, f.sampled_s - task) / max(1, f.samples) / pixels
        sync = max(0.0, f.first_s - task - per_sample * pixels)
        share = 1.0
        if probe.adaptive and f.adaptive and per_sample > 0:
            # what the patches took beyond their fixed cost, against all their samples
            spent = sum(max(0.0, seconds - task) for _px, _n, seconds in f.adaptive)
            nominal = per_sample * sum(px * n for px, n, _s in f.adaptive)
            share = min(1.0, max(MIN_ADAPTIVE_SHARE, spent / nominal))
        out.append(FrameCost(f.frame, sync, task, per_sample, share))
    return out


def cost_at(costs: Sequence[FrameCost], frame: int) -> FrameCost:
    """The costs of ``frame``: a probed frame's, else linear between its probed neighbours."""
    if frame <= costs[0].frame:
        return costs[0]
    if frame >= costs[-1].frame:
        return costs[-1]
    for lo, hi in itertools.pairwise(costs):
        if lo.frame <= frame <= hi.frame:
            t = (frame - lo.frame) / (hi.frame - lo.frame)
            return FrameCost(
                frame,
                lo.sync_s + t * (hi.sync_s - lo.sync_s),
                lo.task_s + t * (hi.task_s - lo.task_s),
                lo.sample_pixel_s + t * (hi.sample_pixel_s - lo.sample_pixel_s),
                lo.adaptive_share + t * (hi.adaptive_share - lo.adaptive_share),
            )
    return costs[-1]  # pragma: no cover - the frames are sorted


@dataclass(frozen=True)
class Workload:
    """What a job renders, in the model's terms."""

    frames: tuple[int, ...]
    tasks_per_frame: int
    #: samples per pixel of the frame (all parts of a sample split together)
    samples: int
    #: samples times pixels of one frame's tasks together (tile overlaps included)
    sample_pixels: float
    #: adaptive sampling is on for the job's tasks
    adaptive: bool
    #: pixels of the frame, denoised once when ``denoise``
    frame_pixels: int
    denoise: bool

    @classmethod
    def of(cls, spec: JobSpec, report: InspectionReport) -> Workload:
        samples = spec.samples or report.samples
        if spec.mode == SAMPLE_SPLIT:
            # each part renders the whole frame with its share of the samples
            sample_pixels = float(samples * spec.width * spec.height)
            adaptive = False
        else:
            rects = plan_tiles(spec.width, spec.height, TileGrid.parse(spec.tiles), spec.overlap_px)
            sample_pixels = float(samples * sum(p.render.width * p.render.height for p in rects))
            adaptive = report.adaptive_sampling
        return cls(
            frames=spec.frames,
            tasks_per_frame=spec.tasks_per_frame,
            samples=samples,
            sample_pixels=sample_pixels,
            adaptive=adaptive,
            frame_pixels=spec.width * spec.height,
            denoise=spec.denoise,
        )


def adaptive_share(share: float, scene_samples: int, samples: int) -> float:
    """The share of ``samples`` adaptive sampling takes, from the ``share`` of the scene's own
    count the probe measured: a pixel stops where its noise is low enough, after about the
    same number of samples whatever the cap, so a job that asks for fewer samples than that
    takes all of them, and one that asks for more takes the same count."""
    if samples <= 0:
        return 1.0
    return min(1.0, max(MIN_ADAPTIVE_SHARE, share * scene_samples / samples))


def frame_seconds(
    costs: Sequence[FrameCost], work: Workload, frame: int, workers: int, scene_samples: int = 0
) -> float:
    """Render device-seconds of ``frame`` on the probe's class, ``workers`` sharing its tasks
    (``scene_samples``: the count the probe's adaptive share is of; 0: the job's)."""
    c = cost_at(costs, frame)
    share = 1.0
    if work.adaptive:
        share = adaptive_share(c.adaptive_share, scene_samples or work.samples, work.samples)
    syncs = max(1, min(workers, work.tasks_per_frame))
    return (
        c.sync_s * syncs
        + c.task_s * work.tasks_per_frame
        + c.sample_pixel_s * work.sample_pixels * share
    )


@dataclass(frozen=True)
class Ratio:
    """How much longer a render takes on ``to`` than on ``from_``, and where it comes from."""

    factor: float
    source: str  # probe | measured | settings | default
    jobs: int = 0


def speed_ratio(
    from_class: str,
    to_class: str,
    measured: Mapping[str, tuple[float, int]],
    speeds: Mapping[str, float],
) -> Ratio:
    """Time on ``to_class`` / time on ``from_class``: the farm's measured mean (its log, and
    the number of jobs behind it, by ``"from>to"``) where it has one, else the speed table."""
    if from_class == to_class:
        return Ratio(1.0, "probe")
    if f"{from_class}>{to_class}" in measured:
        log_ratio, jobs = measured[f"{from_class}>{to_class}"]
        return Ratio(math.exp(log_ratio), "measured", jobs)
    if f"{to_class}>{from_class}" in measured:
        log_ratio, jobs = measured[f"{to_class}>{from_class}"]
        return Ratio(math.exp(-log_ratio), "measured", jobs)
    table = {**DEFAULT_SPEEDS, **speeds}
    source = "settings" if from_class in speeds or to_class in speeds else "default"
    return Ratio(_speed(table, from_class) / _speed(table, to_class), source)


def _speed(table: Mapping[str, float], device_class: str) -> float:
    return table.get(device_class, table[ANY]) or table[ANY]


@dataclass(frozen=True)
class Pool:
    """Devices of one class online now: how many, and how many have a render slot free."""

    devices: int
    free: int


@dataclass(frozen=True)
class ClassEstimate:
    """The estimate of a job on one device class."""

    device_class: str
    frame_s: float
    """Mean device-seconds per frame: rendering, plus denoising when asked."""
    render_s: float
    """Render device-seconds of the whole job (what the farm's task records measure)."""
    device_s: float
    """Device-seconds of the whole job (rendering and denoising)."""
    devices: int
    devices_free: int
    wall_s: float | None
    """With the devices now free (all of the class when none is): None with no device."""
    device_hours: float
    cost: float
    energy_kwh: float
    co2e_kg: float
    ratio: float
    ratio_source: str


@dataclass(frozen=True)
class Estimate:
    """A job's estimate on every class shown; stored with the job to be checked after."""

    probe_class: str
    probe_s: float
    frames: int
    currency: str
    classes: list[ClassEstimate] = field(default_factory=list)
    v: int = 1

    def on(self, device_class: str) -> ClassEstimate | None:
        return next((c for c in self.classes if c.device_class == device_class), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Estimate:
        classes = [ClassEstimate(**c) for c in data.get("classes", [])]
        rest = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "classes"}
        return cls(**rest, classes=classes)


def estimate(
    probe: Probe,
    work: Workload,
    classes: Iterable[str],
    pools: Mapping[str, Pool],
    rates: Rates,
    measured: Mapping[str, tuple[float, int]],
    speeds: Mapping[str, float],
) -> Estimate:
    """The job's estimate on each of ``classes`` (the probe's class is always among them)."""
    costs = fit(probe)
    shown = [probe.device_class, *(c for c in classes if c != probe.device_class)]
    out = []
    for name in shown:
        pool = pools.get(name, Pool(0, 0))
        workers = pool.free or pool.devices or 1
        ratio = speed_ratio(probe.device_class, name, measured, speeds)
        render_s = ratio.factor * sum(
            frame_seconds(costs, work, f, workers, probe.scene_samples) for f in work.frames
        )
        denoise_s = 0.0
        if work.denoise:
            cpu_ratio = speed_ratio("cpu", name, measured, speeds).factor
            denoise_s = DENOISE_S_PER_MPX * work.frame_pixels / 1e6 * cpu_ratio * len(work.frames)
        device_s = render_s + denoise_s
        tasks = work.tasks_per_frame * len(work.frames)
        parallel = min(workers, max(1, tasks))
        wall = device_s / parallel if pool.devices else None
        kwh = device_s * rates.watt(name) / 3.6e6
        out.append(
            ClassEstimate(
                device_class=name,
                frame_s=round(device_s / max(1, len(work.frames)), 4),
                render_s=round(render_s, 4),
                device_s=round(device_s, 4),
                devices=pool.devices,
                devices_free=pool.free,
                wall_s=None if wall is None else round(wall, 3),
                device_hours=round(device_s / 3600, 6),
                cost=round(device_s / 3600 * rates.price(name), 4),
                energy_kwh=round(kwh, 9),
                co2e_kg=round(kwh * rates.carbon_g_per_kwh / 1000, 9),
                ratio=round(ratio.factor, 4),
                ratio_source=ratio.source,
            )
        )
    return Estimate(probe.device_class, probe.took_s, len(work.frames), rates.currency, out)


def probe_frames(first: int, last: int, step: int, count: int) -> list[int]:
    """The frames a probe renders: the first, the last and evenly between, ``count`` at most."""
    frames = list(range(first, last + 1, max(1, step)))
    if count <= 1 or len(frames) <= 1:
        return frames[:1]
    if len(frames) <= count:
        return frames
    picks = {frames[round(i * (len(frames) - 1) / (count - 1))] for i in range(count)}
    return sorted(picks)


def render_text(est: Estimate) -> str:
    """The estimate as `farm submit --estimate` prints it."""
    cur = est.currency
    lines = [
        f"estimate for {est.frames} frame(s), probed on {est.probe_class} in {est.probe_s:.1f} s",
        f"{'CLASS':<10} {'s/FRAME':>9} {'DEVICES':>9} {'WALL':>10} {'DEV-HOURS':>10} "
        f"{'COST ' + cur:>11} {'kWh':>9} {'CO2e kg':>9}  RATIO",
    ]
    for c in est.classes:
        wall = "-" if c.wall_s is None else duration(c.wall_s)
        lines.append(
            f"{c.device_class:<10} {c.frame_s:>9.2f} {c.devices_free:>4}/{c.devices:<4} "
            f"{wall:>10} {c.device_hours:>10.4f} {c.cost:>11.4f} {c.energy_kwh:>9.5f} "
            f"{c.co2e_kg:>9.5f}  x{c.ratio:.3g} ({c.ratio_source})"
        )
    return "\n".join(lines)


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
