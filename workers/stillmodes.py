"""Still modes: what each render task of a frame renders (a tile, or a run of the samples) and
how the frame's files are built from the tasks' outputs (stitch or merge, denoise, formats)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from farm.errors import RenderError
from farm.models import OUTPUT_FORMATS, SAMPLE_SPLIT, JobSpec, TileTask
from farm.storage import layout
from farm.storage.base import Storage
from farm.storage.layout import frame_file_name
from farm.tiling import Rect, TileGrid, plan_tiles
from workers import exr, preview
from workers.child import BlenderChild
from workers.denoise import combined_layers, denoise_frame
from workers.exr import LayeredImage
from workers.samplesplit import merge_parts, split_samples
from workers.stitching import stitch, stitch_layers

#: the animation preview's file name, delivered next to the frames
PREVIEW_NAME = "preview.mp4"


def task_rect(spec: JobSpec, index: int) -> Rect | None:
    """The pixels task ``index`` renders: its tile with overlap, or None for the whole frame."""
    if spec.mode == SAMPLE_SPLIT:
        return None
    plan = plan_tiles(spec.width, spec.height, TileGrid.parse(spec.tiles), spec.overlap_px)[index]
    r = plan.render
    return None if (r.x0, r.y0, r.x1, r.y1) == (0, 0, spec.width, spec.height) else r


def render_task(
    child: BlenderChild,
    blend: Path,
    spec: JobSpec,
    task: TileTask,
    out_path: Path,
    timeout_s: float,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Render ``task`` of ``spec`` into ``out_path``: its frame at the job's size and samples,
    its pixels (``task_rect``), with ``options`` (``task_options`` when None)."""
    return child.render(
        blend,
        frame=task.frame,
        width=spec.width,
        height=spec.height,
        rect=task_rect(spec, task.index),
        samples=spec.samples,
        out_path=out_path,
        timeout_s=timeout_s,
        options=task_options(spec, task.index) if options is None else options,
    )


def task_options(spec: JobSpec, index: int) -> dict[str, Any]:
    """The Blender child's render options for task ``index`` (see Session.render)."""
    options: dict[str, Any] = {
        "layers": spec.layered,
        "denoise_data": spec.denoise,
        "backend": spec.backend,
        "allow_cpu_fallback": spec.allow_cpu_fallback,
    }
    if spec.mode == SAMPLE_SPLIT:
        if spec.samples is None:
            raise RenderError("a sample-split job must fix its sample count")
        options["sample_subset"] = list(split_samples(spec.samples, spec.split_parts)[index])
        # each part must render every sample of its run for the merge to be the full render
        options["adaptive"] = False
    return options


def _frame_image(spec: JobSpec, outputs: Sequence[Path]) -> LayeredImage:
    images = [exr.read_layers(p) for p in outputs]
    if spec.mode == SAMPLE_SPLIT:
        runs = split_samples(spec.samples or 0, spec.split_parts)
        return merge_parts([(img, count) for img, (_, count) in zip(images, runs, strict=True)])
    plans = plan_tiles(spec.width, spec.height, TileGrid.parse(spec.tiles), spec.overlap_px)
    return stitch_layers(spec.width, spec.height, list(zip(plans, images, strict=True)))


def frame_files(
    spec: JobSpec,
    frame: int,
    outputs: Sequence[Path],
    child: BlenderChild,
    blend: Path,
    work: Path,
    convert_timeout_s: float,
) -> tuple[list[Path], Path | None]:
    """Write the frame's files (the job's formats) into ``work`` from its tasks' ``outputs``.

    Returns the files, and an 8-bit image of the frame for the animation preview (None when the
    job makes none).
    """
    if len(outputs) != spec.tasks_per_frame:
        raise RenderError(f"frame {frame} has {len(outputs)} of {spec.tasks_per_frame} tasks")
    layered: LayeredImage | None = None
    if spec.layered:
        layered = _frame_image(spec, outputs)
        if spec.denoise:
            layered = denoise_frame(child, blend, layered, work, spec.tile_timeout_s)
        rgba = layered.rgba(f"{combined_layers(layered)[0]}.Combined")
    else:
        plans = plan_tiles(spec.width, spec.height, TileGrid.parse(spec.tiles), spec.overlap_px)
        tiles = [(p, exr.read_rgba(path)) for p, path in zip(plans, outputs, strict=True)]
        rgba = stitch(spec.width, spec.height, tiles)
    exr_file = work / frame_file_name(frame, ".exr")
    # the linear RGBA image the display formats are made from (and the exr, without passes)
    image_file = work / "image-rgba.exr" if spec.passes else exr_file
    exr.write_rgba(image_file, rgba)
    if spec.passes and layered is not None:
        exr.write_layers(exr_file, layered)
    # the passes the scene's compositor reads in place of a render
    layers_file: Path | None = None
    if spec.compositor and layered is not None:
        layers_file = exr_file if spec.passes else work / "image-layers.exr"
        if not spec.passes:
            exr.write_layers(layers_file, layered)
    files, conversions = [], []
    for name in spec.formats:
        file_format, depth, ext = OUTPUT_FORMATS[name]
        dest = work / frame_file_name(frame, ext)
        files.append(dest)
        if name != "exr":
            conversions.append(
                {"path": str(dest), "format": file_format, "color_depth": depth, "quality": 90}
            )
    still = None
    if spec.preview and len(spec.frames) > 1:
        shown = [(n, e) for n, e in (("png", ".png"), ("jpeg", ".jpg")) if n in spec.formats]
        eight_bit = [work / frame_file_name(frame, ext) for _, ext in shown]
        if eight_bit:
            still = eight_bit[0]
        else:
            still = work / "preview-frame.png"
            conversions.append({"path": str(still), "format": "PNG", "color_depth": "8"})
    if conversions:
        child.convert(
            blend, image_file, conversions, convert_timeout_s, layers_in=layers_file, frame=frame
        )
    return files, still


def preview_prefix(job_id: str) -> str:
    """Where a job's preview stills wait for the MP4 (kept with the job: farm.storage.layout)."""
    return layout.preview_prefix(job_id)


def preview_key(job_id: str, frame: int) -> str:
    return layout.preview_still_key(job_id, frame)


def animation_preview(
    storage: Storage, spec: JobSpec, job_id: str, frame: int, still: Path | None, work: Path
) -> Path | None:
    """Keep this frame's preview image; once every frame's is kept, encode the MP4 into
    ``work`` and return it (delivered with this, the last, frame), else None."""
    if still is None:
        return None
    storage.put(preview_key(job_id, frame), still)
    if not all(storage.exists(preview_key(job_id, f)) for f in spec.frames):
        return None
    stills = [storage.fetch(preview_key(job_id, f), work / f"preview-{f}.png") for f in spec.frames]
    return preview.encode_mp4(stills, spec.fps, work / PREVIEW_NAME)
