"""Stitching rendered tiles into one frame: each tile's core pixels placed exactly once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from farm.errors import RenderError
from farm.tiling import TilePlan, crop_box, frame_box


def stitch(
    width: int, height: int, tiles: Sequence[tuple[TilePlan, npt.NDArray[Any]]]
) -> npt.NDArray[np.float32]:
    """Place each tile's core into a float32 (height, width, 4) frame, rows top-down.

    Each array is the tile's rendered region (``plan.render``) top-down, as read from its EXR.
    Raises RenderError when a tile has the wrong size or lies outside the frame, or when the
    cores do not cover every pixel exactly once.
    """
    frame = np.zeros((height, width, 4), np.float32)
    covered = np.zeros((height, width), np.int32)
    for plan, pixels in tiles:
        r = plan.render
        want = (r.height, r.width, 4)
        if pixels.shape != want:
            raise RenderError(
                f"tile {plan.index} is {pixels.shape}, expected {want} for its render area",
                tile=plan.index,
            )
        if r.x0 < 0 or r.y0 < 0 or r.x1 > width or r.y1 > height:
            raise RenderError(
                f"tile {plan.index} lies outside the {width}x{height} frame", tile=plan.index
            )
        row0, row1, col0, col1 = crop_box(plan)
        f_row0, f_row1, f_col0, f_col1 = frame_box(plan.core, height)
        frame[f_row0:f_row1, f_col0:f_col1] = pixels[row0:row1, col0:col1]
        covered[f_row0:f_row1, f_col0:f_col1] += 1
    missing = int(np.count_nonzero(covered == 0))
    doubled = int(np.count_nonzero(covered > 1))
    if missing or doubled:
        raise RenderError(
            f"tiles do not cover the {width}x{height} frame exactly once: "
            f"{missing} pixels missing, {doubled} pixels covered more than once",
            missing_px=missing,
            doubled_px=doubled,
        )
    return frame
