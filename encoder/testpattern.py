"""The test-pattern source's picture: a moving scene stamped with the frame counter and the
capture time as squares a receiver reads back from the decoded frame (pure numpy)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: one picture or plane of 8-bit samples
Image = npt.NDArray[np.uint8]

#: side of one stamp square, px (survives 4:2:0 subsampling and x264 at low bitrates)
SQUARE_PX = 16
BITS_PER_ROW = 32
#: row 0: frame counter (32 bits); rows 1, 2: capture time in microseconds, bits 0-31, 32-63
STAMP_ROWS = 3
#: top-left corner of the stamp (x, y)
ORIGIN = (0, 0)
#: the least picture that holds the whole stamp
MIN_WIDTH = ORIGIN[0] + SQUARE_PX * BITS_PER_ROW
MIN_HEIGHT = ORIGIN[1] + SQUARE_PX * STAMP_ROWS

_MASK32 = (1 << 32) - 1


def stamp_words(counter: int, capture_us: int) -> tuple[int, int, int]:
    """The three 32-bit words of the stamp, row by row."""
    return counter & _MASK32, capture_us & _MASK32, (capture_us >> 32) & _MASK32


def _stamp_luma(luma: Image, counter: int, capture_us: int) -> None:
    x0, y0 = ORIGIN
    for row, word in enumerate(stamp_words(counter, capture_us)):
        bits = (word >> np.arange(BITS_PER_ROW, dtype=np.uint64)) & 1
        # one row of squares: each bit repeated SQUARE_PX times across, then down
        line = np.repeat((bits * 255).astype(np.uint8), SQUARE_PX)
        y = y0 + row * SQUARE_PX
        luma[y : y + SQUARE_PX, x0 : x0 + line.size] = line


def read_stamp(luma: Image) -> tuple[int, int]:
    """(counter, capture_us) read from a decoded frame's luma plane (h, w) uint8."""
    x0, y0 = ORIGIN
    half = SQUARE_PX // 2
    words = []
    for row in range(STAMP_ROWS):
        y = y0 + row * SQUARE_PX + half
        xs = x0 + np.arange(BITS_PER_ROW) * SQUARE_PX + half
        bits = (luma[y, xs] >= 128).astype(np.uint64)
        words.append(int((bits << np.arange(BITS_PER_ROW, dtype=np.uint64)).sum()))
    return words[0], words[1] | (words[2] << 32)


def check_size(width: int, height: int) -> bool:
    return width >= MIN_WIDTH and height >= MIN_HEIGHT


class Scene:
    """Draws the test pattern's frames: a gradient with a bar sweeping across, stamped.

    The background is drawn once; each frame copies it and moves the bar, so drawing costs a
    copy, not a render (a 720p frame in well under a millisecond).
    """

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        ys, xs = np.mgrid[0:height, 0:width]
        self._luma = ((xs * 160 // max(1, width) + ys * 60 // max(1, height)) + 32).astype(np.uint8)
        cy, cx = np.mgrid[0 : height // 2, 0 : width // 2]
        self._u = (96 + cx * 64 // max(1, width // 2)).astype(np.uint8)
        self._v = (160 - cy * 64 // max(1, height // 2)).astype(np.uint8)

    def yuv420p(self, counter: int, capture_us: int) -> Image:
        """One frame as a (h * 3 / 2, w) uint8 array, the layout of yuv420p."""
        w, h = self.width, self.height
        out = np.empty((h * 3 // 2, w), dtype=np.uint8)
        luma = out[:h]
        luma[:] = self._luma
        bar_w = max(8, w // 32)
        x = (counter * 8) % max(1, w - bar_w)
        luma[MIN_HEIGHT:, x : x + bar_w] = 235
        _stamp_luma(luma, counter, capture_us)
        chroma = out[h:].reshape(2, h // 2, w // 2)
        chroma[0] = self._u
        chroma[1] = self._v
        # the stamp and the bar are grey: neutral chroma under them
        chroma[:, : MIN_HEIGHT // 2, : MIN_WIDTH // 2] = 128
        chroma[:, MIN_HEIGHT // 2 :, x // 2 : (x + bar_w) // 2] = 128
        return out

    def bgra(self, counter: int, capture_us: int) -> Image:
        """The same frame as (h, w, 4) uint8 bgra, alpha 255 (for encoders that take RGB)."""
        return yuv420p_to_bgra(self.yuv420p(counter, capture_us), self.width, self.height)


def yuv420p_to_bgra(planes: Image, width: int, height: int) -> Image:
    """BT.601 limited-range conversion of a (h * 3 / 2, w) yuv420p array to (h, w, 4) bgra."""
    y = planes[:height].astype(np.float32) - 16
    chroma = planes[height:].reshape(2, height // 2, width // 2).astype(np.float32) - 128
    u = chroma[0].repeat(2, axis=0).repeat(2, axis=1)
    v = chroma[1].repeat(2, axis=0).repeat(2, axis=1)
    out = np.full((height, width, 4), 255, dtype=np.uint8)
    out[..., 2] = np.clip(1.164 * y + 1.596 * v, 0, 255)
    out[..., 1] = np.clip(1.164 * y - 0.392 * u - 0.813 * v, 0, 255)
    out[..., 0] = np.clip(1.164 * y + 2.017 * u, 0, 255)
    return out


def draw(counter: int, capture_us: int, width: int, height: int) -> Image:
    """One test-pattern frame as (h, w, 4) uint8 bgra (``av.VideoFrame.from_ndarray(arr,
    format="bgra")``), the picture the service sends."""
    return Scene(width, height).bgra(counter, capture_us)
