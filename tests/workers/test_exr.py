"""EXR reading and writing: exact float round trips, RGB-only files, atomic writes, bad files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import OpenEXR
import pytest

from farm.errors import BadParameter, RenderError
from workers.exr import COMPRESSIONS, read_rgba, write_rgba


def _pixels(height: int = 7, width: int = 5) -> npt.NDArray[np.float32]:
    rng = np.random.default_rng(7)
    pixels = rng.normal(0.5, 2.0, (height, width, 4)).astype(np.float32)
    # values a render produces that a lossy path would damage
    pixels[0, 0] = [np.inf, -np.inf, 1e-38, 65504.0 * 4]
    pixels[-1, -1, 3] = 0.0
    return pixels


@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
def test_round_trip_is_bit_exact(tmp_path: Path, compression: str) -> None:
    pixels = _pixels()
    write_rgba(tmp_path / "a.exr", pixels, compression=compression)
    back = read_rgba(tmp_path / "a.exr")
    assert back.dtype == np.float32
    assert back.shape == (7, 5, 4)
    assert np.array_equal(back, pixels)


def test_row_zero_is_the_top_row_as_stored(tmp_path: Path) -> None:
    pixels = np.zeros((3, 2, 4), np.float32)
    pixels[0, :, 0] = 1.0
    write_rgba(tmp_path / "top.exr", pixels)
    with OpenEXR.File(str(tmp_path / "top.exr"), separate_channels=True) as exr:
        red = exr.channels()["R"].pixels
    assert red[0].tolist() == [1.0, 1.0] and red[1:].sum() == 0.0
    assert np.array_equal(read_rgba(tmp_path / "top.exr"), pixels)


def test_rgb_only_file_reads_with_opaque_alpha(tmp_path: Path) -> None:
    rgb = _pixels()[..., :3].astype(np.float16)
    header = {"compression": OpenEXR.ZIP_COMPRESSION, "type": OpenEXR.scanlineimage}
    with OpenEXR.File(header, {"RGB": rgb}) as exr:
        exr.write(str(tmp_path / "rgb.exr"))
    back = read_rgba(tmp_path / "rgb.exr")
    assert back.dtype == np.float32
    assert np.array_equal(back[..., :3], rgb.astype(np.float32))
    assert np.all(back[..., 3] == 1.0)


def test_write_replaces_atomically_and_leaves_no_temp_files(tmp_path: Path) -> None:
    target = tmp_path / "frame.exr"
    write_rgba(target, _pixels())
    write_rgba(target, np.ones((2, 3, 4), np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["frame.exr"]
    assert read_rgba(target).shape == (2, 3, 4)


def test_refuses_lossy_codecs_and_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(BadParameter, match="compression"):
        write_rgba(tmp_path / "a.exr", _pixels(), compression="dwaa")
    with pytest.raises(BadParameter, match="shape"):
        write_rgba(tmp_path / "a.exr", np.zeros((4, 4, 3), np.float32))
    assert list(tmp_path.iterdir()) == []


def test_unreadable_files_raise_render_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.exr"
    bad.write_bytes(b"not an exr at all")
    with pytest.raises(RenderError, match="cannot read EXR"):
        read_rgba(bad)
    truncated = tmp_path / "truncated.exr"
    write_rgba(truncated, _pixels(64, 64), compression="none")
    truncated.write_bytes(truncated.read_bytes()[:2000])
    with pytest.raises(RenderError):
        read_rgba(truncated)
    with pytest.raises(RenderError):
        read_rgba(tmp_path / "absent.exr")
