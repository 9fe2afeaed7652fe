"""Rendering a tile (or the whole frame) of the open file to a 32-bit float EXR: the scene
set for the request, the file's own settings restored where the request asks nothing."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bpy

from farm.tiling import Rect, border_floats
from workers.blender.errors import ChildError
from workers.blender.process import log
from workers.exr import read_facts, read_layers, write_layers

if TYPE_CHECKING:
    from workers.blender.session import Session


def render(session: Session, req: dict[str, Any]) -> dict[str, Any]:
    """Render ``rect`` of ``frame`` (the whole frame when None) to ``out_path``: RGBA, or with
    ``layers`` a multilayer EXR of every pass; ``samples``, ``sample_subset``, ``adaptive``,
    ``denoise_data``, ``backend`` and ``allow_cpu_fallback`` as the request asks."""
    cycles_device, fallback = session.pick_device(req)
    opened = session.open(req["path"], req.get("root"))
    scene = bpy.context.scene
    width, height = int(req["width"]), int(req["height"])
    out_path = Path(req["out_path"]).absolute()
    # a kept-open file keeps what the last request set: without a count, the file's own
    samples = req.get("samples")
    _prepare_scene(scene, width, height, session.saved["samples"] if samples is None else samples,
                   req.get("rect"))  # fmt: skip
    layers = _prepare_passes(scene, session.saved, req)
    _assign(scene.cycles, device=cycles_device)
    if session.threads > 0:
        _assign(scene.render, threads_mode="FIXED", threads=session.threads)
    else:
        _assign(scene.render, threads_mode="AUTO")
    scene.frame_set(int(req["frame"]))
    # after frame_set: timeline markers may switch the camera per frame
    if scene.camera is None:
        raise ChildError(
            "no_camera", f"scene {scene.name!r} of {Path(req['path']).name} has no camera"
        )

    settings = scene.render.image_settings
    if req.get("layers"):
        # Every pass of every view layer. Blender 5 writes one EXR part per pass unless told
        # to interleave; readers that see one part (OpenImageIO in Cycles' denoiser, most
        # tools) then find only Combined, which is why "only Combined was written" was seen.
        _assign(settings, media_type="MULTI_LAYER_IMAGE", file_format="OPEN_EXR_MULTILAYER",
                use_exr_interleave=True)  # fmt: skip
    else:
        # Blender 5: video-output files refuse file_format (media_type first)
        _assign(settings, media_type="IMAGE", file_format="OPEN_EXR", color_mode="RGBA")
    _assign(settings, color_depth="32", exr_codec="ZIP")
    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex}.tmp.exr")
    _assign(scene.render, filepath=str(tmp), use_file_extension=False)
    log("render", frame=req["frame"], rect=req.get("rect"), out=str(out_path))
    # With persistent data Cycles re-reads its settings only when the scene is tagged, and
    # setting add-on properties (scene.cycles.samples, device) alone does not tag it:
    # measured with bpy 5.0.1, a samples change was otherwise silently ignored.
    scene.update_tag()
    t0, cpu0 = time.perf_counter(), time.process_time()
    try:
        bpy.ops.render.render(write_still=True, scene=scene.name)
        render_s = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu0
        if not tmp.is_file():
            raise ChildError("render_failed", f"Blender wrote no image for {out_path.name}")
        # The size, and Blender's own figure of its peak memory from the stamp _prepare_scene
        # asks for, from the header (read before the multilayer rewrite below, which keeps
        # only the farm's attributes). The Render Result image reports 0x0 until its pixels
        # are read: the file says.
        width_px, height_px, peak_mib = read_facts(tmp)
        if req.get("layers") and len(layers) > 1:
            # The file lists passes by name only; say which view layer is the image.
            image = read_layers(tmp)
            image.attrs["tessera/layers"] = "\n".join(layers)
            write_layers(tmp, image)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return {
        "out_path": str(out_path),
        "width": width_px,
        "height": height_px,
        "render_s": round(render_s, 4),
        # every thread of this process: the render's CPU time, however busy the host was
        "cpu_s": round(cpu_s, 4),
        "peak_memory_mib": peak_mib,
        "autoexec_fail": opened["autoexec_fail"],
        "device": session.device_name if cycles_device == "GPU" else "CPU",
        "fallback": fallback,
        "layers": layers,
        "samples": int(scene.cycles.samples),
    }


def file_settings(scene: Any) -> dict[str, Any]:
    """The settings a render request may change, as the file has them."""
    return {
        # tiles render with compositing off; converting asks whether the file composites
        "compositing": bool(scene.render.use_compositing),
        "adaptive": bool(scene.cycles.use_adaptive_sampling),
        "samples": int(scene.cycles.samples),
        "denoising_passes": {
            vl.name: bool(vl.cycles.denoising_store_passes) for vl in scene.view_layers
        },
    }


def _assign(target: Any, **values: Any) -> None:
    """Set each property that differs, in order: every setting a request makes goes through
    here. Setting a property runs its update callbacks even when the value is the same: about
    0.7 ms a tile for the scene's settings, which a kept file mostly has already from the tile
    before."""
    for name, value in values.items():
        if getattr(target, name) != value:
            setattr(target, name, value)


def _prepare_scene(
    scene: Any, width: int, height: int, samples: int, rect: list[int] | None
) -> None:
    render = scene.render
    # OSL shaders can read any image file by name (texture("/any/path")): SVM only.
    # Denoising per tile makes every pixel differ and seams show; the frame is denoised once.
    _assign(scene.cycles, shading_system=False, use_denoising=False, samples=int(samples))
    _assign(
        render,
        engine="CYCLES",
        use_persistent_data=True,
        resolution_x=width,
        resolution_y=height,
        resolution_percentage=100,
        # The raw render result: compositing, sequencer and burnt-in stamps would act per tile.
        use_compositing=False,
        use_sequencer=False,
        use_stamp=False,
        # the render's peak memory as Blender reports it, stamped into the EXR's header
        # (metadata only: nothing is burnt into the pixels while use_stamp is off)
        use_stamp_memory=True,
    )
    if rect is None:
        _assign(render, use_border=False, use_crop_to_border=False)
    else:
        x0, y0, x1, y1 = (int(v) for v in rect)
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ChildError(
                "bad_parameter", f"tile {rect} is not inside the {width}x{height} frame"
            )
        min_x, max_x, min_y, max_y = border_floats(Rect(x0, y0, x1, y1), width, height)
        _assign(render, use_border=True, use_crop_to_border=True, border_min_x=min_x,
                border_max_x=max_x, border_min_y=min_y, border_max_y=max_y)  # fmt: skip


def _prepare_passes(scene: Any, saved: dict[str, Any], req: dict[str, Any]) -> list[str]:
    """Set the sample subset, adaptive sampling and denoising passes a request asks for (the
    file's own values otherwise); returns the view layers that render, in order."""
    cycles = scene.cycles
    subset = req.get("sample_subset")
    if subset is None:
        _assign(cycles, use_sample_subset=False)
    else:
        offset, count = (int(v) for v in subset)
        if not (offset >= 0 and count >= 1 and offset + count <= cycles.samples):
            raise ChildError(
                "bad_parameter",
                f"sample subset {offset}+{count} is outside the {cycles.samples} samples",
            )
        _assign(cycles, use_sample_subset=True, sample_offset=offset,
                sample_subset_length=count)  # fmt: skip
    adaptive = req.get("adaptive")
    if adaptive is None:
        adaptive = saved.get("adaptive", False)
    _assign(cycles, use_adaptive_sampling=bool(adaptive))
    originals = saved.get("denoising_passes", {})
    for vl in scene.view_layers:
        store = bool(req.get("denoise_data")) or bool(originals.get(vl.name, False))
        _assign(vl.cycles, denoising_store_passes=store)
    return [vl.name for vl in scene.view_layers if vl.use]
