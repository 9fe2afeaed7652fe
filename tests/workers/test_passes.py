"""Passes stitched exactly: multilayer tiles, Cryptomatte; adaptive sampling's overlap."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from farm.tiling import TileGrid, plan_tiles
from tests.blendscenes import make_scene
from tests.workers import renders
from workers import exr
from workers.child import BlenderChild
from workers.exr import LayeredImage
from workers.stitching import stitch, stitch_layers

WIDTH, HEIGHT = 64, 48


def test_multilayer_tiles_hold_every_pass_of_the_full_frame_each_equal(
    child: BlenderChild, tmp_path: Path
) -> None:
    blend = make_scene(tmp_path / "passes.blend", width=WIDTH, height=HEIGHT, passes=True)
    layered = {"layers": True}
    full = exr.read_layers(
        renders.render_frame(child, blend, tmp_path / "full.exr", WIDTH, HEIGHT, options=layered)
    )
    # what an artist enabled is there (Blender 5 writes a part per pass; all are read)
    for name in ("Combined", "Depth", "Normal", "Diffuse Color", "Diffuse Direct", "Emission",
                 "Ambient Occlusion", "Object Index", "Mist", "CryptoObject00",
                 "CryptoMaterial00"):  # fmt: skip
        assert f"ViewLayer.{name}" in full.passes(), f"{name} missing from {full.passes()}"
    tiles = renders.render_tiles(
        child, blend, tmp_path, WIDTH, HEIGHT, TileGrid.of(2, 2), prefix="t", options=layered
    )
    stitched = stitch_layers(WIDTH, HEIGHT, [(plan, exr.read_layers(out)) for plan, out in tiles])
    exr.write_layers(tmp_path / "stitched.exr", stitched)
    back = exr.read_layers(tmp_path / "stitched.exr")
    assert set(back.channels) == set(full.channels)
    for name, want in full.channels.items():
        assert np.array_equal(back.channels[name], want), f"{name} differs"
    manifest = [k for k in full.attrs if k.startswith("cryptomatte/") and k.endswith("/manifest")]
    assert manifest and all(back.attrs[k] == full.attrs[k] for k in manifest)


# --- adaptive sampling -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def adaptive_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("adaptive") / "adaptive.blend",
        width=WIDTH,
        height=HEIGHT,
        # enough samples for adaptive sampling to stop some pixels early (64 is too few)
        samples=128,
        adaptive=True,
    )


def _tiled(child: BlenderChild, blend: Path, tmp: Path, overlap_px: int) -> npt.NDArray[np.float32]:
    tiles = renders.render_tiles(
        child, blend, tmp, WIDTH, HEIGHT, TileGrid.of(2, 2), prefix=f"a{overlap_px}-",
        overlap_px=overlap_px,
    )  # fmt: skip
    return stitch(WIDTH, HEIGHT, [(plan, exr.read_rgba(out)) for plan, out in tiles])


def test_adaptive_sampling_tiles_with_overlap_are_bit_exact_and_without_are_not(
    child: BlenderChild, adaptive_scene: Path, tmp_path: Path
) -> None:
    full = exr.read_rgba(
        renders.render_frame(child, adaptive_scene, tmp_path / "full.exr", WIDTH, HEIGHT)
    )
    assert np.array_equal(_tiled(child, adaptive_scene, tmp_path, 16), full)
    # the overlap is needed: without it, pixels near tile edges converge differently
    bare = _tiled(child, adaptive_scene, tmp_path, 0)
    differ = np.argwhere((bare != full).any(axis=2))
    assert len(differ) > 0
    # ... and only near the tile borders (x = 32, y = 24 in this 2x2 grid)
    near = np.minimum(np.abs(differ[:, 1] - 32), np.abs(differ[:, 0] - 24))
    assert near.max() <= 16


def test_tiles_with_different_passes_are_refused() -> None:
    plans = plan_tiles(4, 2, TileGrid.of(2, 1))
    a = LayeredImage({"L.Combined.R": np.zeros((2, 2), np.float32)})
    b = LayeredImage({"L.Normal.X": np.zeros((2, 2), np.float32)})
    with pytest.raises(Exception, match="different passes"):
        stitch_layers(4, 2, [(plans[0], a), (plans[1], b)])
