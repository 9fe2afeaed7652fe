"""A live-preview frame's current state as one RGB image: each tile's latest pass decoded into
its place, re-composed as passes land (what the WebRTC video of the live preview shows).

The frame shown follows the passes as the job page's canvas does (web/static/live.js): passes
of another frame (an animation on several workers) wait until the frame shown is complete.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from farm.livepreview import TilePass

#: the canvas before the first pass: the job page's background (#0b0d10)
BACKGROUND = (11, 13, 16)


class Composite:
    """The frame shown: ``image`` (height x width x 3, uint8, top row first) and ``version``,
    which grows with every change of ``image``."""

    def __init__(self, width: int, height: int, tile_count: int) -> None:
        self.tile_count = tile_count
        self.image = _blank(width, height)
        self.version = 0
        self.frame: int | None = None
        #: the tiles of the frame shown: tile -> (pass index, passes)
        self._tiles: dict[int, tuple[int, int]] = {}
        #: frames waiting to be shown: frame -> tile -> its latest pass
        self._held: dict[int, dict[int, TilePass]] = {}

    def add(self, tile_pass: TilePass) -> bool:
        """Take one pass; True when the image changed."""
        if self.frame is None:
            self.frame = tile_pass.frame
        if tile_pass.frame != self.frame:
            self._held.setdefault(tile_pass.frame, {})[tile_pass.tile] = tile_pass
            if not self.complete():
                return False
            return self._show_next()
        self._paint(tile_pass)
        if self.complete() and self._held:
            self._show_next()
        return True

    def complete(self) -> bool:
        """Every tile of the frame shown is at its last pass."""
        return len(self._tiles) >= self.tile_count and all(
            index == passes for index, passes in self._tiles.values()
        )

    def _show_next(self) -> bool:
        frame = min(self._held)
        waiting = self._held.pop(frame)
        self.frame = frame
        self._tiles = {}
        height, width = self.image.shape[:2]
        self.image = _blank(width, height)
        self.version += 1
        for tile_pass in sorted(waiting.values(), key=lambda p: p.tile):
            self._paint(tile_pass)
        return True

    def _paint(self, p: TilePass) -> None:
        if self.image.shape[:2] != (p.frame_h, p.frame_w):
            self.image = _blank(p.frame_w, p.frame_h)
        pixels = decode(p.jpeg)
        if pixels is not None:
            # the tile's core, clipped to the frame (a pass never lies outside it; if it did,
            # the rest of the frame stays right)
            h = max(0, min(p.h, pixels.shape[0], p.frame_h - p.y))
            w = max(0, min(p.w, pixels.shape[1], p.frame_w - p.x))
            self.image[p.y : p.y + h, p.x : p.x + w] = pixels[:h, :w]
        self._tiles[p.tile] = (p.index, p.passes)
        self.version += 1


def decode(jpeg_b64: str) -> npt.NDArray[np.uint8] | None:
    """A pass's JPEG (base64) as RGB pixels; None for one that does not decode (skipped: a
    damaged pass must not end the viewer's video)."""
    try:
        with Image.open(io.BytesIO(base64.b64decode(jpeg_b64))) as img:
            return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except (binascii.Error, UnidentifiedImageError, OSError, ValueError):
        return None


def _blank(width: int, height: int) -> npt.NDArray[np.uint8]:
    image = np.empty((max(1, height), max(1, width), 3), dtype=np.uint8)
    image[:] = BACKGROUND
    return image
