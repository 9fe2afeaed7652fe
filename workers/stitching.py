"""Stitching rendered tiles into one frame: each tile's core pixels placed exactly once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from farm.errors import RenderError
from farm.tiling import TilePlan, crop_box, frame_box
from workers.exr import LayeredImage


def stitch(
    width: int, height: int, tiles: Sequence[tuple[TilePlan, npt.NDArray[Any]]]
) -> npt.NDArray[np.float32]:
    """Place each tile's core into a float32 (height, width, C) frame, rows top-down.

    Each array is the tile's rendered region (``plan.render``) top-down, as read from its EXR,
    with C channels (4 for RGBA; every tile the same). Raises RenderError when a tile has the
    wrong size or lies outside the frame, or when the cores do not cover every pixel exactly once.
    """
    depth = tiles[0][1].shape[2] if tiles and tiles[0][1].ndim == 3 else 4
    frame = np.zeros((height, width, depth), np.float32)
    covered = np.zeros((height, width), np.int32)
    for plan, pixels in tiles:
        r = plan.render
        want = (r.height, r.width, depth)
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


def stitch_layers(
    width: int, height: int, tiles: Sequence[tuple[TilePlan, LayeredImage]]
) -> LayeredImage:
    """Stitch multilayer tiles pass by pass: every channel of every view layer, exactly.

    Every tile must hold the same channels (a tile missing a pass is refused, never filled with
    zeros). Metadata comes from the first tile: Cycles' sample counts and the Cryptomatte
    manifests (which list the scene's objects, not a tile's) are the same in every tile.
    """
    if not tiles:
        raise RenderError(f"no tiles to stitch into the {width}x{height} frame")
    names = list(tiles[0][1].channels)
    for plan, image in tiles[1:]:
        if set(image.channels) != set(names):
            extra = sorted(set(image.channels) ^ set(names))
            raise RenderError(
                f"tile {plan.index} has different passes from tile {tiles[0][0].index}: "
                f"{', '.join(extra[:6])}",
                tile=plan.index,
            )
    # One (H, W, C) stack per tile keeps the coverage checks in one place (stitch).
    stacked = stitch(
        width,
        height,
        [(plan, np.stack([image.channels[n] for n in names], axis=-1)) for plan, image in tiles],
    )
    channels = {name: np.ascontiguousarray(stacked[..., i]) for i, name in enumerate(names)}
    return LayeredImage(channels, dict(tiles[0][1].attrs))
