"""Sample-split stills: parts rendering disjoint sample runs merge into the full-sample image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from farm.errors import BadParameter, RenderError
from tests.blendscenes import make_scene
from tests.workers import renders
from workers import exr
from workers.child import BlenderChild
from workers.exr import LayeredImage
from workers.samplesplit import merge_parts, split_samples

WIDTH, HEIGHT, SAMPLES = 64, 48, 12
#: Merging re-weights each part's average by its share of the samples in float32, where one
#: render divides one float sum once: the results differ by float rounding only, a few ULPs of
#: the pixel value. Measured with bpy 5.0.1: at most 1.5e-6 on values up to about 10.
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-6


def test_split_samples_covers_every_sample_once() -> None:
    assert split_samples(12, 1) == [(0, 12)]
    assert split_samples(12, 3) == [(0, 4), (4, 4), (8, 4)]
    assert split_samples(10, 3) == [(0, 3), (3, 3), (6, 4)]
    with pytest.raises(BadParameter, match="each part needs a sample"):
        split_samples(2, 3)


def test_parts_of_different_sizes_are_refused() -> None:
    a = LayeredImage({"L.Combined.R": np.zeros((2, 2), np.float32)})
    b = LayeredImage({"L.Combined.R": np.zeros((2, 3), np.float32)})
    with pytest.raises(RenderError, match="part 1 does not match"):
        merge_parts([(a, 1), (b, 1)])


def test_merge_weighs_parts_by_their_samples_and_copies_depth() -> None:
    a = LayeredImage(
        {"L.Combined.R": np.full((1, 1), 1.0, np.float32), "L.Depth.Z": np.ones((1, 1), np.float32)}
    )
    b = LayeredImage(
        {
            "L.Combined.R": np.full((1, 1), 4.0, np.float32),
            "L.Depth.Z": np.zeros((1, 1), np.float32),
        }
    )
    merged = merge_parts([(a, 1), (b, 2)])
    assert merged.channels["L.Combined.R"][0, 0] == pytest.approx(3.0)
    assert merged.channels["L.Depth.Z"][0, 0] == 1.0
    assert merged.attrs["cycles.L.samples"] == "3"


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("ss") / "ss.blend", width=WIDTH, height=HEIGHT, samples=SAMPLES
    )


def render(
    child: BlenderChild, blend: Path, out: Path, subset: tuple[int, int] | None
) -> LayeredImage:
    options: dict[str, object] = {"layers": True, "denoise_data": True, "adaptive": False}
    if subset is not None:
        options["sample_subset"] = list(subset)
    return exr.read_layers(
        renders.render_frame(child, blend, out, WIDTH, HEIGHT, samples=SAMPLES, options=options)
    )


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_parts_merge_to_the_full_sample_render(
    child: BlenderChild, scene: Path, tmp_path: Path, parts: int
) -> None:
    full = render(child, scene, tmp_path / "full.exr", None)
    runs = split_samples(SAMPLES, parts)
    images = [render(child, scene, tmp_path / f"p{i}.exr", run) for i, run in enumerate(runs)]
    if parts > 1:
        # each part alone is a different, noisier image
        assert (
            np.abs(images[0].rgba("ViewLayer.Combined") - full.rgba("ViewLayer.Combined")).max()
            > 0.01
        )
    merged = merge_parts([(img, count) for img, (_, count) in zip(images, runs, strict=True)])
    assert set(merged.channels) == set(full.channels)
    for name, want in full.channels.items():
        got = merged.channels[name]
        bound = ABSOLUTE_TOLERANCE + RELATIVE_TOLERANCE * np.abs(want)
        assert (np.abs(got - want) <= bound).all(), f"{name}: {np.abs(got - want).max()}"
    assert merged.attrs["cycles.ViewLayer.samples"] == str(SAMPLES)
