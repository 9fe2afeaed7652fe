"""The estimate's probe: a few small renders of the open file whose times the farm's estimate
model (farm.estimate) extrapolates to the job's samples, resolution and device classes.

Each probed frame renders three times at a low resolution (the whole frame, scaled down to
about ``pixels``): one sample right after the frame change (the scene's sync, and the BVH build
on the first frame), one sample again (the fixed cost of a render), then as many samples as
the time budget allows (the cost of a sample on a pixel). With adaptive sampling on, a fourth
render runs adaptively with the threshold scaled to the probe's sample count, so its share of
the samples it takes is the share the full render would take. Every render goes through the
same path as a tile (workers.blender.render), and the file's own settings are put back after.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bpy

from workers.blender import render
from workers.blender.process import log

if TYPE_CHECKING:
    from workers.blender.session import Session

#: the fewest and most samples the probe's main render takes
MIN_PROBE_SAMPLES = 2
MAX_PROBE_SAMPLES = 4096


def auto_min_samples(threshold: float) -> int:
    """Cycles' adaptive minimum where the file leaves it at 0 (automatic)."""
    return math.ceil(16.0 / math.pow(max(threshold, 1e-6), 0.3))


def probe(session: Session, req: dict[str, Any]) -> dict[str, Any]:
    """Render the probe of ``frames`` of ``path`` into ``out_dir``; the measured times."""
    session.open(req["path"], req.get("root"))
    assert session.report is not None
    scene = bpy.context.scene
    cycles = scene.cycles
    width, height = int(session.report["width"]), int(session.report["height"])
    scale = min(1.0, math.sqrt(float(req["pixels"]) / max(1, width * height)))
    w, h = max(8, round(width * scale)), max(8, round(height * scale))
    frames = [int(f) for f in req["frames"]]
    budget_s = float(req["budget_s"]) / max(1, len(frames))
    saved = (
        int(cycles.samples),
        float(cycles.adaptive_threshold),
        int(cycles.adaptive_min_samples),
    )
    samples, threshold, min_samples = saved
    adaptive = bool(session.saved.get("adaptive", False))
    out_dir = Path(req["out_dir"])
    probed: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def timed(frame: int, count: int, adaptive_on: bool) -> float:
        result = render.render(
            session,
            {
                "path": req["path"],
                "root": req.get("root"),
                "frame": frame,
                "width": w,
                "height": h,
                "rect": None,
                "samples": count,
                "adaptive": adaptive_on,
                "out_path": str(out_dir / "probe.exr"),
            },
        )
        return float(result["render_s"])

    try:
        for frame in frames:
            first_s = timed(frame, 1, False)
            repeat_s = timed(frame, 1, False)
            # a sample on a pixel costs at most what the one-sample render did: the count the
            # budget allows is then a floor, never a render that runs past it
            per_sample_s = max(repeat_s, 1e-4)
            count = int(budget_s / per_sample_s)
            count = max(MIN_PROBE_SAMPLES, min(count, samples, MAX_PROBE_SAMPLES))
            sampled_s = timed(frame, count, False)
            entry: dict[str, Any] = {
                "frame": frame,
                "first_s": first_s,
                "repeat_s": repeat_s,
                "samples": count,
                "sampled_s": sampled_s,
            }
            if adaptive and count < samples:
                # error falls as 1/sqrt(samples): a threshold sqrt(S/n) times larger stops a
                # pixel after n/S of the samples it takes at S (and the minimum scales alike)
                ratio = samples / count
                cycles.adaptive_threshold = (threshold or 0.01) * math.sqrt(ratio)
                least = min_samples or auto_min_samples(threshold or 0.01)
                cycles.adaptive_min_samples = max(1, round(least / ratio))
                entry["adaptive_s"] = timed(frame, count, True)
            elif adaptive:
                entry["adaptive_s"] = timed(frame, count, True)
            probed.append(entry)
    finally:
        cycles.samples, cycles.adaptive_threshold, cycles.adaptive_min_samples = saved
        (out_dir / "probe.exr").unlink(missing_ok=True)
    took_s = time.perf_counter() - t0
    log("probed", frames=frames, width=w, height=h, took_s=round(took_s, 3))
    return {
        "width": w,
        "height": h,
        "scene_width": width,
        "scene_height": height,
        "scene_samples": samples,
        "adaptive": adaptive,
        "device": session.device_name or "CPU",
        "frames": probed,
        "took_s": round(took_s, 4),
    }
