"""Blender's own denoised frame: a plain bpy render with Cycles' in-render denoiser on."""

from __future__ import annotations

from pathlib import Path

from tests.blendscenes import run_bpy

#: seconds one plain render (of the example scene at 128 samples, reduced) may take
TIMEOUT_S = 600.0

_SCRIPT = """
import json, sys, bpy
a = json.loads(sys.argv[1])
bpy.ops.wm.open_mainfile(filepath=a["blend"], load_ui=False, use_scripts=False)
scene = bpy.context.scene
render = scene.render
render.engine = "CYCLES"
scene.cycles.device = "CPU"
if a["width"]:
    render.resolution_x, render.resolution_y = a["width"], a["height"]
    render.resolution_percentage = 100
if a["samples"]:
    scene.cycles.samples = a["samples"]
# the file's own denoiser settings (prefilter, quality, input passes), switched on
scene.cycles.use_denoising = True
render.use_compositing = False
render.use_sequencer = False
settings = render.image_settings
settings.media_type = "IMAGE"
settings.file_format = "OPEN_EXR"
settings.color_mode = "RGBA"
settings.color_depth = "32"
render.filepath = a["out_path"]
render.use_file_extension = False
bpy.ops.render.render(write_still=True)
"""


def render_denoised(
    blend: Path, out_path: Path, *, width: int = 0, height: int = 0, samples: int = 0
) -> Path:
    """Render ``blend``'s frame the plain Blender way with denoising on, to the RGBA EXR
    ``out_path`` (the file's resolution and samples where given 0); return ``out_path``."""
    args = {"blend": str(Path(blend).absolute()), "out_path": str(Path(out_path).absolute()),
            "width": width, "height": height, "samples": samples}  # fmt: skip
    run_bpy(["-c", _SCRIPT], args, TIMEOUT_S, f"denoised plain render of {blend}", Path(out_path))
    return Path(out_path)
