"""Renders frames of a .blend the plain Blender way, outside the farm: the reference the stack
test compares the farm's delivered frames with.

The scene as saved (its resolution, samples, seed), on the CPU, each whole frame in one render,
written by Blender itself as a 32-bit float RGBA EXR (the raw render result, as the farm's EXR
frames are). Usage: python plainrender.py FILE.blend OUT_DIR FRAME... -> OUT_DIR/plain_NNNN.exr
"""

from __future__ import annotations

import sys
from pathlib import Path

import bpy


def main(blend: Path, out_dir: Path, frames: list[int]) -> None:
    bpy.ops.wm.open_mainfile(filepath=str(blend))
    scene = bpy.context.scene
    scene.render.engine = "CYCLES"
    scene.cycles.device = "CPU"
    settings = scene.render.image_settings
    settings.media_type = "IMAGE"  # Blender 5: files saved with video output refuse file_format
    settings.file_format = "OPEN_EXR"
    settings.color_mode = "RGBA"
    settings.color_depth = "32"
    scene.render.use_file_extension = False
    for frame in frames:
        scene.frame_set(frame)
        scene.render.filepath = str(out_dir / f"plain_{frame:04d}.exr")
        bpy.ops.render.render(write_still=True, scene=scene.name)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), [int(f) for f in sys.argv[3:]])
