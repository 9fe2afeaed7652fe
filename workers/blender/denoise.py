"""Denoising a stitched (or merged) frame once with Cycles' standalone denoiser (OIDN)."""

from __future__ import annotations

import importlib
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bpy

from workers.blender.errors import ChildError, blender_message

if TYPE_CHECKING:
    from workers.blender.session import Session


def denoise(session: Session, req: dict[str, Any]) -> dict[str, Any]:
    """Denoise a single-part multilayer EXR with Cycles' standalone denoiser (OIDN).

    The input holds each view layer's noisy Combined, Denoising Normal, Denoising Albedo and
    Vector passes and ``cycles.<layer>.samples``; the output is the same file with every
    layer's Combined RGB denoised. One call for the whole frame, never per tile.
    """
    # Cycles' own Python module, present once bpy is imported (no stubs: typed as a module)
    _cycles = importlib.import_module("_cycles")

    session.open(req["path"], req.get("root"))
    scene = bpy.context.scene
    if not getattr(_cycles, "with_openimagedenoise", False):
        raise ChildError("render_failed", "this Blender build has no OpenImageDenoise")
    scene.cycles.denoiser = "OPENIMAGEDENOISE"
    src = Path(req["in_path"]).absolute()
    out_path = Path(req["out_path"]).absolute()
    tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex}.tmp.exr")
    t0 = time.perf_counter()
    try:
        _cycles.denoise(
            bpy.context.preferences.as_pointer(),
            scene.as_pointer(),
            scene.view_layers[0].as_pointer(),
            input=[str(src)],
            output=[str(tmp)],
        )
        if not tmp.is_file():
            raise ChildError("render_failed", f"the denoiser wrote no image for {src.name}")
        os.replace(tmp, out_path)
    except RuntimeError as exc:
        raise ChildError(
            "render_failed", f"denoising {src.name} failed: {blender_message(exc)}"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    return {"out_path": str(out_path), "denoise_s": round(time.perf_counter() - t0, 4)}
