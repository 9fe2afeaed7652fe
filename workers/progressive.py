"""Live-preview tiles: a tile rendered in sample passes, merged as they land, each merged state
published as a display-referred JPEG for the job page; the last merge is the tile.

Each pass is a disjoint run of the samples (farm.passschedule), so the merge of the passes so
far is an honest image of that many samples and the last one is the full render up to the
sample split's float rounding (workers.samplesplit). The preview is tone-mapped by the Blender
child (``convert``, compositor skipped): the scene's view transform, look, exposure and display
exactly as the delivered PNG/JPEG get them, whatever OCIO config the scene uses; applying the
view transform in numpy would match only the Standard transform, not AgX or Filmic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from farm import livepreview
from farm.errors import RenderError
from farm.models import JobSpec, TileTask
from farm.passschedule import pass_schedule, trim
from farm.redisclient import Redis
from farm.tiling import TileGrid, crop_box, frame_box, plan_tiles
from workers import exr, stillmodes
from workers.child import BlenderChild
from workers.denoise import combined_layers
from workers.exr import LayeredImage
from workers.samplesplit import merge_parts

log = logging.getLogger("tessera.worker")

#: the preview JPEG's quality: small enough to publish every pass, sharp enough to judge noise
JPEG_QUALITY = 85
#: the longest the Blender child may take to tone-map one pass (a tile-sized image)
TONE_MAP_TIMEOUT_S = 60.0
_RGBA = ("R", "G", "B", "A")


def render_in_passes(
    child: BlenderChild,
    conn: Redis,
    blend: Path,
    spec: JobSpec,
    task: TileTask,
    out_path: Path,
    ttl_s: float,
    check: Callable[[], None],
    budget: float,
) -> dict[str, Any]:
    """Render task ``task`` into ``out_path`` in passes, publishing each merged state.

    ``check`` runs between passes and raises to stop (the tile's lease lost). ``budget``: the
    passes' extra cost over one plain render, as a fraction of it (farm.passschedule.trim).
    Returns the child's render result with the passes' render time summed, the peak memory's
    maximum and each pass's ``(samples, seconds)``.
    """
    if spec.samples is None:
        raise RenderError("a live-preview job must fix its sample count")
    schedule = pass_schedule(spec.samples)
    plan = plan_tiles(spec.width, spec.height, TileGrid.parse(spec.tiles), spec.overlap_px)[
        task.index
    ]
    options = stillmodes.task_options(spec, task.index)
    # every pass must render every sample of its run for the merge to be the full render
    options["adaptive"] = False
    deadline = time.monotonic() + spec.tile_timeout_s
    parts: list[tuple[LayeredImage, int]] = []
    result: dict[str, Any] = {}
    render_s, peak = 0.0, 0.0
    stem = out_path.name.removesuffix(".exr")
    timings: list[tuple[int, float]] = []
    done: list[tuple[int, int]] = []
    rest = schedule
    try:
        while rest:
            (offset, count), rest = rest[0], rest[1:]
            number = len(timings) + 1
            started = time.monotonic()
            check()
            part = out_path.with_name(f"{stem}.pass{number}.exr")
            result = stillmodes.render_task(
                child, blend, spec, task, part, max(1.0, deadline - time.monotonic()),
                {**options, "sample_subset": [offset, count]},
            )  # fmt: skip
            render_s += float(result.get("render_s") or 0.0)
            peak = max(peak, float(result.get("peak_memory_mib") or 0.0))
            parts.append((_read(part, spec.layered), count))
            part.unlink(missing_ok=True)
            merged = merge_parts(parts)
            if not rest:
                _write(out_path, merged, spec.layered)
            shown = _core_rgba(merged, spec.layered, plan)
            jpeg = _tone_map(child, blend, shown, out_path.with_name(f"{stem}-live"), task.frame)
            x0, x1 = plan.core.x0, plan.core.x1
            top, _, _, _ = frame_box(plan.core, spec.height)
            sent = livepreview.publish(
                conn,
                task.job_id,
                livepreview.TilePass(
                    frame=task.frame, tile=task.index, attempt=task.attempt, x=x0, y=top,
                    w=x1 - x0, h=plan.core.height, frame_w=spec.width, frame_h=spec.height,
                    index=number, passes=number + len(rest), samples=offset + count,
                    total_samples=spec.samples, jpeg=livepreview.encode_jpeg(jpeg),
                ),
                ttl_s,
            )  # fmt: skip
            # the pass's whole cost (render, merge, tone-map, publish) decides the passes left
            timings.append((count, time.monotonic() - started))
            log.info("event=live_pass job=%s frame=%d tile=%d pass=%d/%d samples=%d id=%s "
                     "pass_s=%.3f", task.job_id, task.frame, task.index, number,
                     number + len(rest), offset + count, sent, timings[-1][1])  # fmt: skip
            done.append((offset, count))
            rest = trim(done + rest, timings, budget)
    finally:
        for leftover in out_path.parent.glob(f"{stem}.pass*.exr"):
            leftover.unlink(missing_ok=True)
    return {**result, "render_s": round(render_s, 4), "peak_memory_mib": peak or None,
            "samples": spec.samples, "passes": len(timings),
            "pass_samples_s": timings}  # fmt: skip


def _read(path: Path, layered: bool) -> LayeredImage:
    if layered:
        return exr.read_layers(path)
    rgba = exr.read_rgba(path)
    return LayeredImage({c: rgba[..., i] for i, c in enumerate(_RGBA)})


def _write(path: Path, image: LayeredImage, layered: bool) -> None:
    if layered:
        exr.write_layers(path, image)
    else:
        exr.write_rgba(path, np.stack([image.channels[c] for c in _RGBA], axis=-1))


def _core_rgba(image: LayeredImage, layered: bool, plan: Any) -> npt.NDArray[np.float32]:
    """The linear RGBA of the pixels the tile owns (stitching drops the overlap)."""
    if layered:
        rgba = image.rgba(f"{combined_layers(image)[0]}.Combined")
    else:
        rgba = np.stack([image.channels[c] for c in _RGBA], axis=-1)
    row0, row1, col0, col1 = crop_box(plan)
    return np.ascontiguousarray(rgba[row0:row1, col0:col1])


def _tone_map(
    child: BlenderChild, blend: Path, rgba: npt.NDArray[np.float32], stem: Path, frame: int
) -> bytes:
    """``rgba`` as a display-referred JPEG, Blender applying the scene's colour management."""
    linear, jpeg = stem.with_name(stem.name + ".exr"), stem.with_name(stem.name + ".jpg")
    try:
        exr.write_rgba(linear, rgba)
        child.convert(
            blend,
            linear,
            [{"path": jpeg, "format": "JPEG", "quality": JPEG_QUALITY}],
            TONE_MAP_TIMEOUT_S,
            frame=frame,
            composite=False,
        )
        return jpeg.read_bytes()
    finally:
        linear.unlink(missing_ok=True)
        jpeg.unlink(missing_ok=True)
