"""A .blend reaching outside its own files: reported missing as written, never looked at, and
rendered as though those files did not exist."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from tests.blendscenes import make_scene
from tests.security.blender_scenes import make_source, reach_out
from workers.child import BlenderChild
from workers.exr import read_rgba

W, H = 48, 32
TIMEOUT_S = 120.0
#: the other project's paint: pure green, so any trace of it shows in the render
GREEN = (0.0, 1.0, 0.0, 1.0)
#: more ``../`` than any test folder is deep: from the .blend's folder up to /
CLIMB = "../" * 16


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """uploads/other (another project's upload: a green PNG and a library) beside
    uploads/mine, whose scenes reach for them by absolute and ``//../`` paths."""
    root = tmp_path_factory.mktemp("uploads")
    png, library = make_source(root / "other", GREEN)
    base = make_scene(root / "base" / "base.blend", width=W, height=H, samples=4)
    mine = root / "mine"
    reach_out(base, mine / "absolute.blend", image=str(png), library=str(library))
    reach_out(base, mine / "climbing.blend", image="//../other/paint.png",
              library="//" + CLIMB + str(library).lstrip("/"))  # fmt: skip
    reach_out(base, mine / "host.blend", image="/etc/passwd", library="//../other/paint.blend")
    return root


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlenderChild]:
    with BlenderChild(python=sys.executable, work_dir=tmp_path_factory.mktemp("c")) as c:
        yield c


def _render(child: BlenderChild, blend: Path, root: Path, out: Path) -> npt.NDArray[np.float32]:
    child.use("mine", root)
    child.render(blend, frame=1, width=W, height=H, rect=None, samples=4, out_path=out,
                 timeout_s=TIMEOUT_S)  # fmt: skip
    return read_rgba(out)


@pytest.mark.parametrize(
    ("name", "image", "library"),
    [
        ("absolute", "{other}/paint.png", "{other}/paint.blend"),
        # written //../../..(16 times)/<other>/paint.blend; Blender tidies it when it loads
        ("climbing", "//../other/paint.png", "//../other/paint.blend"),
        ("host", "/etc/passwd", "//../other/paint.blend"),
    ],
)
def test_paths_outside_the_file_set_are_missing_as_written_whether_or_not_they_exist(
    child: BlenderChild, farm: Path, tmp_path: Path, name: str, image: str, library: str
) -> None:
    other = farm / "other"
    written = {path.format(other=other) for path in (image, library)}
    blend = farm / "mine" / f"{name}.blend"
    child.use("mine", farm / "mine")
    present = child.inspect(blend, TIMEOUT_S)
    assert sorted(present["missing_files"]) == sorted(written)
    assert written & set(present["libraries"])
    # no oracle: the report is the same when the files are not there
    hidden = tmp_path / "other-away"
    shutil.move(other, hidden)
    try:
        child.use("mine-again", farm / "mine")  # a fresh child: nothing kept from the first load
        absent = child.inspect(blend, TIMEOUT_S)
    finally:
        shutil.move(hidden, other)
    assert absent["missing_files"] == present["missing_files"]


def test_forced_render_shows_no_trace_of_files_outside(
    child: BlenderChild, farm: Path, tmp_path: Path
) -> None:
    blend = farm / "mine" / "absolute.blend"
    contained = _render(child, blend, farm / "mine", tmp_path / "contained.exr")
    # the other project's green would show on the floor and the cube
    assert _greenish(contained) == 0
    hidden = tmp_path / "other-away"
    shutil.move(farm / "other", hidden)
    try:
        child.use("nobody", farm)  # a fresh child for the next load
        gone = _render(child, blend, farm / "mine", tmp_path / "gone.exr")
    finally:
        shutil.move(hidden, farm / "other")
    np.testing.assert_array_equal(contained, gone)
    # the control: with the other upload inside the file set, the green is there to see
    child.use("control", farm)
    reached = _render(child, blend, farm, tmp_path / "reached.exr")
    assert _greenish(reached) > _greenish(contained) + 50


def _greenish(image: npt.NDArray[np.float32]) -> int:
    """Pixels where green clearly dominates red and blue: the other project's paint."""
    r, g, b = image[..., 0], image[..., 1], image[..., 2]
    return int(((g > 2 * r + 0.05) & (g > 2 * b + 0.05)).sum())
