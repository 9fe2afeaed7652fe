"""The frame a live-preview WebRTC viewer sees: passes decoded into place, frames in turn."""

from __future__ import annotations

import io

import numpy as np
import numpy.typing as npt
from PIL import Image

from farm.livepreview import TilePass, encode_jpeg
from web.livecomposite import BACKGROUND, Composite

W, H = 32, 16


def _pass(frame: int, tile: int, index: int, colour: tuple[int, int, int]) -> TilePass:
    """Tile 0 is the left half of the frame, tile 1 the right; two passes a tile."""
    out = io.BytesIO()
    Image.new("RGB", (W // 2, H), colour).save(out, "JPEG", quality=95)
    return TilePass(frame=frame, tile=tile, attempt=1, x=tile * W // 2, y=0, w=W // 2, h=H,
                    frame_w=W, frame_h=H, index=index, passes=2, samples=4 ** (index - 1),
                    total_samples=4, jpeg=encode_jpeg(out.getvalue()))  # fmt: skip


def _near(pixels: npt.NDArray[np.uint8], colour: tuple[int, int, int]) -> bool:
    return bool(np.abs(pixels.astype(int) - np.array(colour)).max() <= 3)


def test_each_pass_lands_in_its_tile_and_the_next_frame_waits_for_this_one() -> None:
    comp = Composite(W, H, tile_count=2)
    assert comp.image.shape == (H, W, 3) and _near(comp.image, BACKGROUND)
    assert comp.add(_pass(1, 0, 1, (200, 0, 0)))
    assert _near(comp.image[:, : W // 2], (200, 0, 0))
    assert _near(comp.image[:, W // 2 :], BACKGROUND)
    # a pass of frame 2 (another worker) waits: frame 1 is not done
    version = comp.version
    assert not comp.add(_pass(2, 0, 1, (0, 0, 200)))
    assert comp.version == version and comp.frame == 1
    comp.add(_pass(1, 0, 2, (0, 200, 0)))
    comp.add(_pass(1, 1, 1, (0, 200, 0)))
    assert _near(comp.image, (0, 200, 0))
    # frame 1's last pass: frame 2 is shown from what it held, on a clean canvas
    assert comp.add(_pass(1, 1, 2, (0, 200, 0)))
    assert comp.frame == 2
    assert _near(comp.image[:, : W // 2], (0, 0, 200))
    assert _near(comp.image[:, W // 2 :], BACKGROUND)


def test_a_pass_that_does_not_decode_changes_nothing_it_covers() -> None:
    comp = Composite(W, H, tile_count=2)
    comp.add(_pass(1, 0, 1, (200, 0, 0)))
    damaged = _pass(1, 0, 2, (0, 200, 0))
    comp.add(TilePass(**{**damaged.__dict__, "jpeg": "bm90IGEganBlZw=="}))
    assert _near(comp.image[:, : W // 2], (200, 0, 0))
