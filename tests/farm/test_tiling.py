"""Tests of tile grids: exact partitions, Blender border floats, crop and placement in frames."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from farm.errors import BadTileGrid
from farm.tiling import (
    MAX_GRID_SIDE,
    Rect,
    TileGrid,
    border_floats,
    crop_box,
    frame_box,
    plan_tiles,
)


@pytest.mark.parametrize(
    ("text", "cols", "rows"),
    [("2x2", 2, 2), ("3X1", 3, 1), ("4", 4, 4), (" 2 x 5 ", 2, 5), ("64x64", 64, 64), ("1", 1, 1)],
)
def test_parse_grid(text: str, cols: int, rows: int) -> None:
    grid = TileGrid.parse(text)
    assert (grid.cols, grid.rows) == (cols, rows)
    assert grid.count == cols * rows
    assert TileGrid.parse(str(grid)) == grid


@pytest.mark.parametrize(
    "text", ["0x2", "2x0", "0", "2x", "x2", "-1x2", "65x1", "1x65", "2*2", "", "a"]
)
def test_parse_grid_rejects(text: str) -> None:
    with pytest.raises(BadTileGrid):
        TileGrid.parse(text)


def test_grid_side_limit_is_named() -> None:
    with pytest.raises(BadTileGrid) as raised:
        TileGrid.of(MAX_GRID_SIDE + 1, 1)
    assert raised.value.fields["limit"] == MAX_GRID_SIDE


def coverage(width: int, height: int, rects: list[Rect]) -> npt.NDArray[np.int64]:
    counts = np.zeros((height, width), dtype=np.int64)
    for r in rects:
        counts[r.y0 : r.y1, r.x0 : r.x1] += 1
    return counts


sizes = st.integers(1, 300)
grids = st.builds(TileGrid.of, st.integers(1, 12), st.integers(1, 12))


@given(sizes, sizes, grids, st.integers(0, 40))
def test_cores_partition_the_image(width: int, height: int, grid: TileGrid, overlap: int) -> None:
    if grid.cols > width or grid.rows > height:
        with pytest.raises(BadTileGrid):
            plan_tiles(width, height, grid, overlap)
        return
    plans = plan_tiles(width, height, grid, overlap)
    assert len(plans) == grid.count
    assert [p.index for p in plans] == list(range(grid.count))
    # every pixel belongs to exactly one tile's core
    assert (coverage(width, height, [p.core for p in plans]) == 1).all()
    widths = {p.core.width for p in plans}
    heights = {p.core.height for p in plans}
    assert max(widths) - min(widths) <= 1 and min(widths) >= 1
    assert max(heights) - min(heights) <= 1 and min(heights) >= 1
    for p in plans:
        c, r = p.core, p.render
        assert r.x0 <= c.x0 and r.y0 <= c.y0 and c.x1 <= r.x1 and c.y1 <= r.y1
        assert r.x0 >= 0 and r.y0 >= 0 and r.x1 <= width and r.y1 <= height
        # the overlap is as asked wherever the image allows it
        assert r.x0 == max(0, c.x0 - overlap) and r.x1 == min(width, c.x1 + overlap)
        assert r.y0 == max(0, c.y0 - overlap) and r.y1 == min(height, c.y1 + overlap)


def test_tile_zero_is_bottom_left() -> None:
    plans = plan_tiles(100, 50, TileGrid(2, 2))
    assert plans[0].core == Rect(0, 0, 50, 25)
    assert (plans[1].col, plans[1].row) == (1, 0)
    assert plans[3].core == Rect(50, 25, 100, 50)


@pytest.mark.parametrize(
    ("width", "height", "grid"),
    [(3, 10, TileGrid(4, 1)), (10, 3, TileGrid(1, 4)), (1, 1, TileGrid(2, 2))],
)
def test_more_tiles_than_pixels(width: int, height: int, grid: TileGrid) -> None:
    with pytest.raises(BadTileGrid) as raised:
        plan_tiles(width, height, grid)
    assert "more tiles than" in raised.value.message


def test_bad_image_size_and_overlap() -> None:
    with pytest.raises(BadTileGrid):
        plan_tiles(0, 10, TileGrid(1, 1))
    with pytest.raises(BadTileGrid):
        plan_tiles(10, 10, TileGrid(1, 1), overlap_px=-1)


def blender_pixels(border: float, size: int) -> tuple[int, int]:
    """How Blender turns a border float into a pixel edge: the float32 RNA value times the
    resolution, truncated to int (``disprect.xmin = border.xmin * winx``); also in float64."""
    as_float32 = int(np.float32(border) * np.float32(size))
    return as_float32, int(border * size)


@pytest.mark.parametrize(
    "size",
    [*range(1, 130), 255, 256, 257, 719, 720, 1000, 1080, 1920, 2048, 3840, 4096, 8192, 65536],
)
def test_border_floats_truncate_back_to_every_pixel_edge(size: int) -> None:
    for p in range(size + 1):
        rect = Rect(p, p, p, p)
        x_min, x_max, y_min, y_max = border_floats(rect, size, size)
        assert 0.0 <= x_min <= 1.0
        assert x_min == x_max == y_min == y_max
        assert blender_pixels(x_min, size) == (p, p), (size, p, x_min)


@given(st.integers(1, 9000), st.integers(1, 9000), st.data())
def test_border_floats_of_planned_tiles(width: int, height: int, data: st.DataObject) -> None:
    grid = TileGrid.of(
        data.draw(st.integers(1, min(width, 16))), data.draw(st.integers(1, min(height, 16)))
    )
    for plan in plan_tiles(width, height, grid, data.draw(st.integers(0, 64))):
        x_min, x_max, y_min, y_max = border_floats(plan.render, width, height)
        r = plan.render
        assert blender_pixels(x_min, width)[0] == r.x0
        assert blender_pixels(x_max, width)[0] == r.x1
        assert blender_pixels(y_min, height)[0] == r.y0
        assert blender_pixels(y_max, height)[0] == r.y1


def synthetic_frame(width: int, height: int) -> npt.NDArray[np.int64]:
    """A frame stored top-down (row 0 is the top) whose every pixel is distinct."""
    return np.arange(width * height * 2, dtype=np.int64).reshape(height, width, 2)


def render_tile(frame: npt.NDArray[np.int64], render: Rect) -> npt.NDArray[np.int64]:
    """What Blender returns for a border render cropped to the border: the render rect, top-down."""
    row0, row1, col0, col1 = frame_box(render, frame.shape[0])
    return frame[row0:row1, col0:col1].copy()


@given(st.integers(1, 80), st.integers(1, 80), st.data())
def test_cropped_tiles_placed_by_frame_box_rebuild_the_frame(
    width: int, height: int, data: st.DataObject
) -> None:
    grid = TileGrid.of(
        data.draw(st.integers(1, min(width, 8))), data.draw(st.integers(1, min(height, 8)))
    )
    frame = synthetic_frame(width, height)
    rebuilt = np.full_like(frame, -1)
    for plan in plan_tiles(width, height, grid, data.draw(st.integers(0, 12))):
        tile = render_tile(frame, plan.render)
        assert tile.shape[:2] == (plan.render.height, plan.render.width)
        row0, row1, col0, col1 = crop_box(plan)
        core = tile[row0:row1, col0:col1]
        assert core.shape[:2] == (plan.core.height, plan.core.width)
        f_row0, f_row1, f_col0, f_col1 = frame_box(plan.core, height)
        assert (rebuilt[f_row0:f_row1, f_col0:f_col1] == -1).all(), "two tiles wrote one pixel"
        rebuilt[f_row0:f_row1, f_col0:f_col1] = core
    np.testing.assert_array_equal(rebuilt, frame)


def test_frame_box_puts_the_bottom_row_last() -> None:
    # y counts up from the bottom in Blender; arrays count rows down from the top.
    assert frame_box(Rect(0, 0, 4, 1), height=3) == (2, 3, 0, 4)
    assert frame_box(Rect(1, 2, 3, 3), height=3) == (0, 1, 1, 3)
