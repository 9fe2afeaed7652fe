"""The animation preview: frames become an H.264 MP4 at the scene's rate, next to the frames."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from farm import embedded, submission
from farm.errors import RenderError
from farm.settings import Settings
from tests.blendscenes import make_scene
from workers.preview import encode_mp4, frame_rate


def probe(path: Path) -> tuple[int, int, int, Fraction, str]:
    """(decoded frames, width, height, frame rate, codec) of a video file, as PyAV decodes it."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        rate = stream.average_rate or stream.base_rate
        assert rate is not None
        return frames, stream.width, stream.height, Fraction(rate), stream.codec_context.name


def _stills(tmp: Path, count: int, width: int, height: int) -> list[Path]:
    paths = []
    for i in range(count):
        pixels = np.zeros((height, width, 3), np.uint8)
        pixels[:, : (i + 1) * width // count] = (200, 40, 40)  # a bar that grows per frame
        paths.append(tmp / f"f{i}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


@pytest.mark.parametrize(
    ("fps", "rate"), [(24.0, Fraction(24)), (30000 / 1001, Fraction(30000, 1001))]
)
def test_mp4_decodes_to_the_frames_at_the_scene_rate(
    tmp_path: Path, fps: float, rate: Fraction
) -> None:
    out = encode_mp4(_stills(tmp_path, 7, 64, 48), fps, tmp_path / "p.mp4")
    assert probe(out) == (7, 64, 48, rate, "h264")


def test_odd_sized_frames_are_padded_to_even_sides(tmp_path: Path) -> None:
    out = encode_mp4(_stills(tmp_path, 3, 67, 41), 24, tmp_path / "odd.mp4")
    assert probe(out)[:3] == (3, 68, 42)


def test_frames_of_different_sizes_are_refused_and_nothing_is_left(tmp_path: Path) -> None:
    stills = _stills(tmp_path, 2, 64, 48) + _stills(tmp_path / "..", 1, 32, 32)
    with pytest.raises(RenderError, match="not 64x48"):
        encode_mp4(stills, 24, tmp_path / "bad.mp4")
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".mp4"]
    with pytest.raises(RenderError, match="frames per second"):
        frame_rate(0)


def test_an_animation_render_delivers_an_mp4_of_its_frames(tmp_path: Path) -> None:
    blend = make_scene(tmp_path / "anim.blend", width=64, height=48, samples=2, frame_end=4)
    req = submission.RenderRequest(output=tmp_path / "o", tiles="2x1", formats="exr")
    settings = Settings().with_(storage_dir=tmp_path / "storage", work_dir=tmp_path / "work")
    outcome = embedded.render(settings, blend, req, 1, io.StringIO())
    assert outcome.job.state == "done"
    names = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert "preview.mp4" in names
    assert probe(tmp_path / "o" / "preview.mp4") == (4, 64, 48, Fraction(24), "h264")
