"""Stitching tiles into frames: exact placement, full coverage, and refusal of bad tile sets."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from farm.errors import RenderError
from farm.tiling import Rect, TileGrid, TilePlan, crop_box, frame_box, plan_tiles
from workers.stitching import stitch


def _frame(width: int, height: int) -> npt.NDArray[np.float32]:
    # every pixel distinct, so any misplaced pixel shows
    values = np.arange(width * height * 4, dtype=np.float32)
    return values.reshape(height, width, 4)


def _cut(frame: npt.NDArray[np.float32], plan: TilePlan) -> npt.NDArray[np.float32]:
    """The tile a renderer returns for ``plan.render``: that region of the frame, top-down."""
    row0, row1, col0, col1 = frame_box(plan.render, frame.shape[0])
    return frame[row0:row1, col0:col1].copy()


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 90),
    height=st.integers(1, 90),
    cols=st.integers(1, 6),
    rows=st.integers(1, 6),
    overlap_px=st.sampled_from([0, 1, 3, 16]),
)
def test_stitching_cut_tiles_rebuilds_the_frame(
    width: int, height: int, cols: int, rows: int, overlap_px: int
) -> None:
    if cols > width or rows > height:
        return
    frame = _frame(width, height)
    plans = plan_tiles(width, height, TileGrid.of(cols, rows), overlap_px)
    tiles = [(plan, _cut(frame, plan)) for plan in reversed(plans)]
    stitched = stitch(width, height, tiles)
    assert stitched.dtype == np.float32
    assert np.array_equal(stitched, frame)


def test_overlap_pixels_are_cropped_not_blended() -> None:
    frame = _frame(20, 10)
    plans = plan_tiles(20, 10, TileGrid.of(2, 2), overlap_px=4)
    tiles = []
    for plan in plans:
        tile = _cut(frame, plan)
        tile[...] = -1.0  # garbage everywhere...
        row0, row1, col0, col1 = frame_box(plan.core, 10)
        core = frame[row0:row1, col0:col1]
        c_row0, c_row1, c_col0, c_col1 = crop_box(plan)
        tile[c_row0:c_row1, c_col0:c_col1] = core  # ...except the core
        tiles.append((plan, tile))
    assert np.array_equal(stitch(20, 10, tiles), frame)


def test_missing_tile_is_refused() -> None:
    frame = _frame(10, 6)
    plans = plan_tiles(10, 6, TileGrid.of(2, 2))
    with pytest.raises(RenderError, match="15 pixels missing"):
        stitch(10, 6, [(p, _cut(frame, p)) for p in plans[1:]])


def test_duplicate_tile_is_refused() -> None:
    frame = _frame(10, 6)
    plans = plan_tiles(10, 6, TileGrid.of(2, 1))
    tiles = [(p, _cut(frame, p)) for p in [*plans, plans[0]]]
    with pytest.raises(RenderError, match="30 pixels covered more than once"):
        stitch(10, 6, tiles)


def test_tile_of_the_wrong_size_is_refused() -> None:
    plans = plan_tiles(10, 6, TileGrid.of(2, 2))
    tiles = [(p, np.zeros((p.render.height, p.render.width, 4), np.float32)) for p in plans]
    tiles[2] = (
        plans[2],
        np.zeros((plans[2].render.height - 1, plans[2].render.width, 4), np.float32),
    )
    with pytest.raises(RenderError, match="tile 2"):
        stitch(10, 6, tiles)


def test_tile_outside_the_frame_is_refused() -> None:
    outside = TilePlan(0, 0, 0, Rect(0, 0, 12, 6), Rect(0, 0, 12, 6))
    with pytest.raises(RenderError, match="outside"):
        stitch(10, 6, [(outside, np.zeros((6, 12, 4), np.float32))])
