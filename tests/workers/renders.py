"""Real renders for the worker tests: frame 1 of a scene, whole or tile by tile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from farm.tiling import TileGrid, TilePlan, plan_tiles
from workers.child import BlenderChild

#: seconds one render of a tiny test scene may take
TIMEOUT_S = 60.0


def render_frame(
    child: BlenderChild,
    blend: Path,
    out: Path,
    width: int,
    height: int,
    *,
    samples: int | None = None,
    options: dict[str, Any] | None = None,
) -> Path:
    """Render the whole of frame 1 of ``blend`` to the EXR ``out``; return ``out``."""
    child.render(blend, frame=1, width=width, height=height, rect=None, samples=samples,
                 out_path=out, timeout_s=TIMEOUT_S, options=options)  # fmt: skip
    return out


def render_tiles(
    child: BlenderChild,
    blend: Path,
    tmp: Path,
    width: int,
    height: int,
    grid: TileGrid,
    *,
    prefix: str,
    overlap_px: int = 0,
    options: dict[str, Any] | None = None,
) -> list[tuple[TilePlan, Path]]:
    """Render frame 1 of ``blend`` tile by tile to ``tmp/<prefix><index>.exr``: (plan, EXR)."""
    tiles = []
    for plan in plan_tiles(width, height, grid, overlap_px):
        out = tmp / f"{prefix}{plan.index}.exr"
        child.render(blend, frame=1, width=width, height=height, rect=plan.render, samples=None,
                     out_path=out, timeout_s=TIMEOUT_S, options=options)  # fmt: skip
        tiles.append((plan, out))
    return tiles
