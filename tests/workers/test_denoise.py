"""Denoising after stitching: tiled frames denoise to the full frame's image, with no seam."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from farm.errors import RenderError
from farm.tiling import TileGrid, plan_tiles
from tests.blendscenes import make_scene
from tests.workers import renders
from workers import exr
from workers.child import BlenderChild
from workers.denoise import denoise_frame, prepare
from workers.exr import LayeredImage
from workers.stitching import stitch_layers

WIDTH, HEIGHT = 64, 48
#: the issue's bound for "the same image" after denoising
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("dn") / "dn.blend", width=WIDTH, height=HEIGHT, samples=8
    )


DENOISE = {"layers": True, "denoise_data": True}


def render_tiles(
    child: BlenderChild, blend: Path, tmp: Path, grid: str, overlap_px: int = 0
) -> LayeredImage:
    tiles = renders.render_tiles(
        child, blend, tmp, WIDTH, HEIGHT, TileGrid.parse(grid), prefix=f"{grid}-",
        overlap_px=overlap_px, options=DENOISE,
    )  # fmt: skip
    return stitch_layers(WIDTH, HEIGHT, [(plan, exr.read_layers(out)) for plan, out in tiles])


def render_full(child: BlenderChild, blend: Path, tmp: Path) -> LayeredImage:
    out = renders.render_frame(child, blend, tmp / "full.exr", WIDTH, HEIGHT, options=DENOISE)
    return exr.read_layers(out)


def gradients(rgba: npt.NDArray[np.float32]) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    return np.diff(rgba, axis=1), np.diff(rgba, axis=0)


@pytest.fixture(scope="module")
def full(
    child: BlenderChild, scene: Path, tmp_path_factory: pytest.TempPathFactory
) -> LayeredImage:
    tmp = tmp_path_factory.mktemp("dn-full")
    return denoise_frame(child, scene, render_full(child, scene, tmp), tmp, 60)


@pytest.mark.parametrize("grid", ["2x2", "3x3"])
def test_denoised_tiles_equal_the_denoised_full_frame_without_a_seam(
    child: BlenderChild, scene: Path, full: LayeredImage, tmp_path: Path, grid: str
) -> None:
    noisy = render_tiles(child, scene, tmp_path, grid)
    denoised = denoise_frame(child, scene, noisy, tmp_path, 60)
    got, want = denoised.rgba("ViewLayer.Combined"), full.rgba("ViewLayer.Combined")
    assert got.shape == (HEIGHT, WIDTH, 4)
    # the denoiser did change the noisy image (8 samples are visibly noisy)
    assert np.abs(got - noisy.rgba("ViewLayer.Combined")).max() > 0.05
    assert np.abs(got - want).max() <= TOLERANCE
    # no seam: across every tile border the step between neighbouring pixels is the full
    # frame's step (a seam is a step the full frame does not have)
    plans = plan_tiles(WIDTH, HEIGHT, TileGrid.parse(grid))
    (gx, gy), (wx, wy) = gradients(got), gradients(want)
    for x in sorted({p.core.x0 for p in plans} - {0}):
        assert np.abs(gx[:, x - 1] - wx[:, x - 1]).max() <= 2 * TOLERANCE
    for y in sorted({p.core.y0 for p in plans} - {0}):
        row = HEIGHT - y  # top-down rows
        assert np.abs(gy[row - 1] - wy[row - 1]).max() <= 2 * TOLERANCE


def test_denoising_each_tile_alone_shows_seams_the_stitched_denoise_does_not(
    child: BlenderChild, scene: Path, full: LayeredImage, tmp_path: Path
) -> None:
    """Why the farm denoises once: per-tile denoising differs from the full frame's result."""
    tiles = [
        (plan, denoise_frame(child, scene, exr.read_layers(out), tmp_path, 60))
        for plan, out in renders.render_tiles(child, scene, tmp_path, WIDTH, HEIGHT,
                                              TileGrid.of(2, 2), prefix="t", options=DENOISE)
    ]  # fmt: skip
    per_tile = stitch_layers(WIDTH, HEIGHT, tiles).rgba("ViewLayer.Combined")
    assert np.abs(per_tile - full.rgba("ViewLayer.Combined")).max() > 100 * TOLERANCE


def test_a_frame_without_denoising_passes_is_refused_by_name() -> None:
    image = LayeredImage({f"ViewLayer.Combined.{c}": np.zeros((2, 2), np.float32) for c in "RGBA"})
    with pytest.raises(RenderError, match="Denoising Normal, Denoising Albedo"):
        prepare(image)
