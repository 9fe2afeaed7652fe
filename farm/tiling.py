"""Tile grids over a frame: pixel-exact rectangles, Blender border floats, overlap and crop."""

from __future__ import annotations

import re
from dataclasses import dataclass

from farm.errors import BadTileGrid

#: the largest grid side accepted; more tiles than this per frame costs more than it saves
MAX_GRID_SIDE = 64


@dataclass(frozen=True)
class Rect:
    """Half-open pixel rectangle [x0, x1) x [y0, y1); y counts up from the bottom row."""

    x0: int
    y0: int
    x1: int
    y1: int

    @property
    def width(self) -> int:
        return self.x1 - self.x0

    @property
    def height(self) -> int:
        return self.y1 - self.y0


@dataclass(frozen=True)
class TileGrid:
    cols: int
    rows: int

    @classmethod
    def parse(cls, text: str) -> TileGrid:
        """Parse ``"CxR"`` (``"2x2"``, ``"3X1"``) or a single ``"N"`` meaning NxN."""
        m = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+))?\s*", text)
        if not m:
            raise BadTileGrid(f"tile grid {text!r} is not COLSxROWS, for example 2x2", grid=text)
        cols = int(m.group(1))
        rows = int(m.group(2)) if m.group(2) is not None else cols
        return cls.of(cols, rows)

    @classmethod
    def of(cls, cols: int, rows: int) -> TileGrid:
        if cols < 1 or rows < 1:
            raise BadTileGrid(f"tile grid {cols}x{rows} needs at least one column and one row")
        if cols > MAX_GRID_SIDE or rows > MAX_GRID_SIDE:
            raise BadTileGrid(
                f"tile grid {cols}x{rows} is larger than {MAX_GRID_SIDE}x{MAX_GRID_SIDE}",
                limit=MAX_GRID_SIDE,
            )
        return cls(cols, rows)

    @property
    def count(self) -> int:
        return self.cols * self.rows

    def __str__(self) -> str:
        return f"{self.cols}x{self.rows}"


@dataclass(frozen=True)
class TilePlan:
    """One tile of a frame: the pixels it owns (``core``) and the pixels it renders (``render``).

    ``render`` is ``core`` grown by the overlap and clamped to the image; stitching keeps only
    ``core``, so the overlap lets adaptive sampling see the same neighbours as a full frame.
    """

    index: int
    col: int
    row: int
    core: Rect
    render: Rect


def _cuts(size: int, parts: int) -> list[int]:
    # Balanced cuts: sizes differ by at most one pixel, so no tile is ever empty.
    return [(i * size) // parts for i in range(parts + 1)]


def plan_tiles(width: int, height: int, grid: TileGrid, overlap_px: int = 0) -> list[TilePlan]:
    """Split a ``width`` x ``height`` frame into ``grid``; index 0 is the bottom-left tile."""
    if width < 1 or height < 1:
        raise BadTileGrid(f"cannot tile an image of {width}x{height} pixels")
    if grid.cols > width or grid.rows > height:
        raise BadTileGrid(
            f"tile grid {grid} has more tiles than the {width}x{height} image has pixels",
            grid=str(grid),
            width=width,
            height=height,
        )
    if overlap_px < 0:
        raise BadTileGrid(f"tile overlap must be 0 or more pixels, not {overlap_px}")
    xs, ys = _cuts(width, grid.cols), _cuts(height, grid.rows)
    plans = []
    for row in range(grid.rows):
        for col in range(grid.cols):
            core = Rect(xs[col], ys[row], xs[col + 1], ys[row + 1])
            render = Rect(
                max(0, core.x0 - overlap_px),
                max(0, core.y0 - overlap_px),
                min(width, core.x1 + overlap_px),
                min(height, core.y1 + overlap_px),
            )
            plans.append(TilePlan(row * grid.cols + col, col, row, core, render))
    return plans


def border_floats(rect: Rect, width: int, height: int) -> tuple[float, float, float, float]:
    """Blender's ``border_min_x, border_max_x, border_min_y, border_max_y`` for ``rect``.

    Blender turns border floats into pixels by truncation (``int(border * size)``), so each edge
    is given at the pixel's centre, (p + 0.5) / size, which truncates back to p whatever the
    rounding of the division; exact edges such as p / size can come out one pixel short.
    """

    def edge(p: int, size: int) -> float:
        return min(1.0, (p + 0.5) / size)

    return (
        edge(rect.x0, width),
        edge(rect.x1, width),
        edge(rect.y0, height),
        edge(rect.y1, height),
    )


def crop_box(plan: TilePlan) -> tuple[int, int, int, int]:
    """Where ``plan.core`` lies inside the rendered tile image, in top-down array order.

    Returns ``(row0, row1, col0, col1)`` slices for an array of the rendered tile whose row 0 is
    the top row (as EXR stores it).
    """
    r, c = plan.render, plan.core
    col0 = c.x0 - r.x0
    # top-down: the tile's top row is y = r.y1 - 1
    row0 = r.y1 - c.y1
    return row0, row0 + c.height, col0, col0 + c.width


def frame_box(rect: Rect, height: int) -> tuple[int, int, int, int]:
    """Where ``rect`` lies in a whole frame stored top-down: ``(row0, row1, col0, col1)``."""
    return height - rect.y1, height - rect.y0, rect.x0, rect.x1
