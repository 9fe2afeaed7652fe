"""The farm's denoised frame is Blender's: tiles stitched and denoised once equal a plain render
of the same file with Cycles' in-render denoiser on (the file's own denoise settings)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from farm.tiling import TileGrid
from tests.blendscenes import make_scene
from tests.workers import renders
from tests.workers.inrender import render_denoised
from workers import exr
from workers.child import BlenderChild
from workers.denoise import denoise_frame
from workers.stitching import stitch_layers

WIDTH, HEIGHT = 64, 48
#: the issue's bound for "the same image" after denoising. Measured with bpy 5.0.1 on CPU: this
#: scene up to 4.3e-6 (float rounding: Cycles hands OIDN the sum of the samples, the file holds
#: their mean); denoised top-down, as before, it differed by up to 0.20 (4 spp) and 0.95 (16 spp).
TOLERANCE = 1e-4


@pytest.mark.parametrize("samples", [4, 16])
def test_stitched_denoised_tiles_equal_blenders_in_render_denoised_frame(
    child: BlenderChild, tmp_path: Path, samples: int
) -> None:
    blend = make_scene(tmp_path / "dn.blend", width=WIDTH, height=HEIGHT, samples=samples)
    want = exr.read_rgba(render_denoised(blend, tmp_path / "blender.exr"))
    tiles = renders.render_tiles(
        child, blend, tmp_path, WIDTH, HEIGHT, TileGrid.of(2, 2), prefix="t",
        options={"layers": True, "denoise_data": True},
    )  # fmt: skip
    noisy = stitch_layers(WIDTH, HEIGHT, [(plan, exr.read_layers(out)) for plan, out in tiles])
    got = denoise_frame(child, blend, noisy, tmp_path, 60).rgba("ViewLayer.Combined")
    assert got.shape == want.shape == (HEIGHT, WIDTH, 4)
    # Blender did denoise (a few samples are visibly noisy), and so did the farm, the same way
    assert np.abs(want - noisy.rgba("ViewLayer.Combined")).max() > 0.05
    assert np.abs(got - want).max() <= TOLERANCE
