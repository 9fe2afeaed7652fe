"""The estimate's probe: a few small renders of the open file whose times the farm's estimate
model (farm.estimate) extrapolates to the job's samples, resolution and device classes.

Each probed frame renders three times: the whole frame scaled down to about ``pixels`` at one
sample right after the frame change (the scene's sync, and the BVH build on the first frame),
an 8x8 tile of the full-size frame at one sample (the fixed cost of a tile), then the scaled
frame with as many samples as the time budget allows (the cost of a sample on a pixel). With
adaptive sampling on, the scaled frame renders once more adaptively at the scene's own samples:
the share of the samples adaptive sampling takes shows only at the real count and threshold (a
probe at a low count with the threshold scaled stopped far later: +93 % on the benchmark's
adaptive scene). Every render goes through the same path as a tile
(workers.blender.render), and the file's own sample count is put back after.
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


#: the side of the fixed-cost render, px
MIN_PATCH_PX = 8
#: the fewest pixels of the adaptive render (about 48x27)
MIN_ADAPTIVE_PX = 1296


def _patch(fx: float, fy: float, width: int, height: int, side: int) -> list[int]:
    """The square of ``side`` px centred at (fx, fy) of the frame, inside it."""
    side = max(1, min(side, width, height))
    x0 = min(max(0, int(fx * width) - side // 2), width - side)
    y0 = min(max(0, int(fy * height) - side // 2), height - side)
    return [x0, y0, x0 + side, y0 + side]


def _adaptive_render(
    timed_rect: Any, frame: int, width: int, height: int, samples: int, pixels: float
) -> dict[str, float]:
    """An adaptive render of the whole frame scaled down to about ``pixels`` (at least
    MIN_ADAPTIVE_PX) at the scene's own samples and threshold: the share of its samples
    adaptive sampling takes is only seen at the real count, and it is the same at a lower
    resolution (measured: 0.147, 0.147 and 0.13 of 512 samples at 240x135, 120x68 and 60x34),
    where small tiles of the full frame stop later (their edges converge differently)."""
    scale = min(1.0, math.sqrt(max(pixels, MIN_ADAPTIVE_PX) / (width * height)))
    w, h = max(8, round(width * scale)), max(8, round(height * scale))
    render_s = timed_rect(frame, (w, h), None, samples, True)
    return {"pixels": w * h, "samples": samples, "render_s": render_s}


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
    samples = int(cycles.samples)
    adaptive = bool(session.saved.get("adaptive", False))
    out_dir = Path(req["out_dir"])
    probed: list[dict[str, Any]] = []
    # the renders' own wall and CPU seconds (their ratio: how busy the host was meanwhile)
    spent = [0.0, 0.0]
    t0 = time.perf_counter()

    def timed_rect(
        frame: int, size: tuple[int, int], rect: list[int] | None, count: int, adaptive_on: bool
    ) -> float:
        result = render.render(
            session,
            {
                "path": req["path"],
                "root": req.get("root"),
                "frame": frame,
                "width": size[0],
                "height": size[1],
                "rect": rect,
                "samples": count,
                "adaptive": adaptive_on,
                "out_path": str(out_dir / "probe.exr"),
            },
        )
        spent[0] += float(result["render_s"])
        spent[1] += float(result["cpu_s"])
        return float(result["render_s"])

    def timed(frame: int, count: int, adaptive_on: bool) -> float:
        return timed_rect(frame, (w, h), None, count, adaptive_on)

    try:
        for frame in frames:
            first_s = timed(frame, 1, False)
            # a render of a few pixels is all fixed cost: a tile's border, crop and file
            tiny = _patch(0.5, 0.5, width, height, MIN_PATCH_PX)
            fixed_s = timed_rect(frame, (width, height), tiny, 1, False)
            # a sample on every pixel costs at most what the one-sample render did: the count
            # the budget allows is then a floor, never a render that runs past it
            per_sample_s = max(first_s - fixed_s, 1e-4)
            count = int(budget_s / per_sample_s)
            count = max(MIN_PROBE_SAMPLES, min(count, samples, MAX_PROBE_SAMPLES))
            sampled_s = timed(frame, count, False)
            entry: dict[str, Any] = {
                "frame": frame,
                "first_s": first_s,
                "fixed_s": fixed_s,
                "samples": count,
                "sampled_s": sampled_s,
            }
            if adaptive:
                per_sp = max(sampled_s - fixed_s, 1e-6) / count / (w * h)
                entry["adaptive"] = [
                    _adaptive_render(timed_rect, frame, w, h, samples, budget_s / per_sp / samples)
                ]
            probed.append(entry)
    finally:
        cycles.samples = samples
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
        "render_s": round(spent[0], 4),
        "cpu_s": round(spent[1], 4),
    }
