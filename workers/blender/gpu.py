"""The child's GPU: Cycles' backend and devices, and a scene's device-memory estimate."""

from __future__ import annotations

import os
from typing import Any

import bpy

from farm.settings import GPU_BACKENDS
from workers.backends import choose_backend
from workers.blender.errors import ChildError
from workers.blender.process import log


def setup(backend: str | None) -> str:
    """Select ``backend`` (or the best that has a device) and enable its GPUs, or raise."""
    prefs = bpy.context.preferences.addons["cycles"].preferences
    found: dict[str, int | None] = {}
    for name in [backend.upper()] if backend else GPU_BACKENDS:
        try:
            prefs.compute_device_type = name
        except TypeError:
            found[name] = None
            continue
        prefs.refresh_devices()
        found[name] = sum(1 for d in prefs.get_devices_for_type(name) if d.type == name)
    chosen, reasons = choose_backend(found, backend)
    if chosen is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ChildError(
            "device_unavailable",
            f"no GPU for Cycles ({'; '.join(reasons)})"
            + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""),
            backends=reasons,
        )
    prefs.compute_device_type = chosen
    prefs.refresh_devices()
    devices = prefs.get_devices_for_type(chosen)
    for device in devices:
        # Never mix CPU into GPU tiles: sampling features differ between devices.
        device.use = device.type == chosen
    log("gpu", backend=chosen, devices=[d.name for d in devices if d.type == chosen])
    return chosen


#: what Cycles holds per triangle (geometry plus BVH) and per vertex, in bytes, and what a
#: device context costs before any scene data: coarse figures, so the floor stays the minimum
_BYTES_PER_TRIANGLE = 160
_BYTES_PER_VERTEX = 32
_BYTES_PER_PIXEL_BUFFERS = 64
_CONTEXT_MIB = 300


def vram_estimate_mib(scene: Any) -> int:
    """A coarse device-memory estimate: geometry, textures and render buffers of the scene."""
    import numpy as np

    total = 0
    seen: set[str] = set()
    for obj in scene.objects:
        mesh = obj.data if obj.type == "MESH" else None
        if mesh is None or mesh.name in seen:
            continue
        seen.add(mesh.name)
        loop_totals = np.empty(len(mesh.polygons), dtype=np.int32)
        mesh.polygons.foreach_get("loop_total", loop_totals)
        triangles = int((loop_totals - 2).clip(min=0).sum())
        total += triangles * _BYTES_PER_TRIANGLE + len(mesh.vertices) * _BYTES_PER_VERTEX
    for image in bpy.data.images:
        width, height = image.size[:]
        channels = image.channels or 4
        total += width * height * channels * (4 if image.is_float else 1)
    render = scene.render
    pixels = (render.resolution_x * render.resolution_percentage // 100) * (
        render.resolution_y * render.resolution_percentage // 100
    )
    total += pixels * _BYTES_PER_PIXEL_BUFFERS
    return int(_CONTEXT_MIB + total // (1024 * 1024))
