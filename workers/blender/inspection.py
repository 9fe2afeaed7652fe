"""Inspection of the open file: its frames, size, engine, cameras, missing external files and
the scripts it wanted to run, reported before anything is queued."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import bpy

from workers import containment
from workers.blender import compositor, gpu


def report(path: str, libraries: list[str], missing: list[str]) -> dict[str, Any]:
    """The report of the open file; ``libraries`` and ``missing`` as written in Blender."""
    scene = bpy.context.scene
    render = scene.render
    cycles = getattr(scene, "cycles", None)
    scripts = [
        f"text {t.name!r} is registered to run on load" for t in bpy.data.texts if t.use_module
    ]
    for where, driver in _drivers():
        if driver.type == "SCRIPTED" and not driver.is_simple_expression:
            scripts.append(f"driver on {where}: {driver.expression}")
    autoexec_fail = bool(bpy.app.autoexec_fail)
    version = bpy.data.version
    report: dict[str, Any] = {
        "path": path,
        "version": f"{version[0]}.{version[1]}",
        "scene": scene.name,
        "engine": render.engine,
        "frame_start": scene.frame_start,
        "frame_end": scene.frame_end,
        "frame_step": scene.frame_step,
        "fps": render.fps / render.fps_base,
        # Blender's own integer maths for the output size
        "width": render.resolution_x * render.resolution_percentage // 100,
        "height": render.resolution_y * render.resolution_percentage // 100,
        "samples": int(cycles.samples) if cycles is not None else None,
        "adaptive_sampling": bool(cycles.use_adaptive_sampling) if cycles is not None else False,
        "denoising": bool(cycles.use_denoising) if cycles is not None else False,
        "cameras": sorted(o.name for o in scene.objects if o.type == "CAMERA"),
        "camera": scene.camera.name if scene.camera is not None else None,
        "missing_files": missing,
        "libraries": libraries,
        "autoexec_fail": autoexec_fail,
        "autoexec_fail_message": bpy.app.autoexec_fail_message or "",
        "wants_scripts": autoexec_fail or bool(scripts),
        "scripts": scripts,
        "vram_estimate_mib": gpu.vram_estimate_mib(scene),
    }
    if compositor.final_tree(scene, {}) is not None:
        # PNG and JPEG take the compositor's result, made from the stitched passes; absent
        # (InspectionReport.compositor False) for a scene without one, as in older reports
        report["compositor"] = True
    return report


def missing_files(root: str, cut: list[str]) -> list[str]:
    """The open file's missing external files as written in Blender: those outside its file set
    (``cut``, never looked for) and those inside it that are not there."""
    skip = _packed_or_generated_paths()
    missing = set(cut)
    for raw, full in containment.external_paths(bpy):
        path = os.path.normpath(full)
        if containment.outside(root, path):
            missing.add(raw)  # left by contain() (a path it cannot clear): still never looked at
        elif path not in skip and not containment.exists(path):
            missing.add(raw)
    return sorted(missing)


def _ids() -> Iterator[Any]:
    """Every datablock of the open file, with the node trees embedded in them."""
    for attr in dir(bpy.data):
        collection = getattr(bpy.data, attr, None)
        if not isinstance(collection, bpy.types.bpy_prop_collection):
            continue
        for item in collection:
            if not isinstance(item, bpy.types.ID):
                break
            yield item
            tree = getattr(item, "node_tree", None)
            if isinstance(tree, bpy.types.ID):
                yield tree


def _drivers() -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    for item in _ids():
        if item.as_pointer() in seen:
            continue
        seen.add(item.as_pointer())
        anim = getattr(item, "animation_data", None)
        if anim is None:
            continue
        for fcurve in anim.drivers:
            owner = item.name if not item.is_embedded_data else f"{item.name} (embedded)"
            yield f"{owner} {fcurve.data_path}[{fcurve.array_index}]", fcurve.driver


def _packed_or_generated_paths() -> set[str]:
    skip: set[str] = set()
    for collection in (bpy.data.images, bpy.data.sounds, bpy.data.fonts, bpy.data.volumes):
        for item in collection:
            packed = getattr(item, "packed_file", None) is not None or bool(
                getattr(item, "packed_files", None)
            )
            generated = getattr(item, "source", "") in {"GENERATED", "VIEWER"}
            if packed or generated:
                skip.add(os.path.normpath(bpy.path.abspath(item.filepath, library=item.library)))
    return skip
