"""Still modes end to end on the embedded farm: denoised tiles with every pass, sample split."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from farm import embedded, submission
from farm.errors import BadParameter
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.workers import renders
from workers import exr
from workers.child import BlenderChild
from workers.denoise import denoise_frame
from workers.exr import LayeredImage

WIDTH, HEIGHT, SAMPLES = 64, 48, 12
#: the issue's bound for "the same image" after denoising (tiles: the noisy passes are bit-exact,
#: so the denoised frames are too)
TOLERANCE = 1e-4
#: A sample split's merge differs from one render by float rounding (a few ULPs, see
#: test_samplesplit); the denoiser carries that through, a little amplified. Measured with bpy
#: 5.0.1: this scene 2e-5; farm/examples/example.blend at 384x216, 64 samples: largest 2.3e-4
#: (on highlights above 1.0), RMS 1.9e-6. The bound leaves room for other scenes' highlights.
SPLIT_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("farm-dn") / "still.blend",
        width=WIDTH,
        height=HEIGHT,
        samples=SAMPLES,
        passes=True,
    )


@pytest.fixture(scope="module")
def reference(scene: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayeredImage]:
    """The full frame in one render, denoised by the same call the farm makes."""
    tmp = tmp_path_factory.mktemp("farm-dn-ref")
    with BlenderChild(python=sys.executable, work_dir=tmp, name="ref") as child:
        full = renders.render_frame(child, scene, tmp / "full.exr", WIDTH, HEIGHT,
                                    options={"layers": True, "denoise_data": True})  # fmt: skip
        yield denoise_frame(child, scene, exr.read_layers(full), tmp, 60)


def farm(tmp: Path, blend: Path, workers: int, **options: object) -> Path:
    out = tmp / "o"
    req = submission.RenderRequest(output=out, frames="1", **options)  # type: ignore[arg-type]
    settings = Settings().with_(storage_dir=tmp / "storage", work_dir=tmp / "work")
    outcome = embedded.render(settings, blend, req, workers, io.StringIO())
    assert outcome.job.state == "done"
    return out


def test_denoised_2x2_tiles_deliver_every_pass_and_the_full_frame_image(
    scene: Path, reference: LayeredImage, tmp_path: Path
) -> None:
    out = farm(tmp_path, scene, 2, tiles="2x2", denoise=True, passes=True, formats="exr,png")
    layered = exr.read_layers(out / "frame_0001.exr")
    assert set(reference.channels) <= set(layered.channels)
    for name, want in reference.channels.items():
        got = layered.channels[name]
        if name.startswith("ViewLayer.Combined."):
            assert np.abs(got - want).max() <= TOLERANCE, name
        else:
            assert np.array_equal(got, want), f"pass channel {name} differs"
    assert (out / "frame_0001.png").stat().st_size > 0


@pytest.mark.parametrize("parts", [2, 3])
def test_sample_split_merges_and_denoises_to_the_full_frame(
    scene: Path, reference: LayeredImage, tmp_path: Path, parts: int
) -> None:
    out = farm(tmp_path, scene, 2, mode="sample_split", split_parts=parts, denoise=True,
               formats="exr")  # fmt: skip
    image = exr.read_rgba(out / "frame_0001.exr")
    diff = np.abs(image - reference.rgba("ViewLayer.Combined"))
    assert diff.max() <= SPLIT_TOLERANCE
    assert np.sqrt((diff**2).mean()) <= 1e-5  # invisible: far below one 8-bit step (4e-3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "halves"}, "mode 'halves' is not one of"),
        ({"mode": "sample_split", "split_parts": 0}, "1 to 64 parts"),
        ({"mode": "sample_split", "frames": "1-3"}, "one frame"),
        ({"mode": "sample_split", "split_parts": 4, "samples": 3}, "cannot split 3 sample"),
        ({"passes": True, "formats": "png"}, "add exr"),
        ({"backend": "VULKAN", "device": "gpu"}, "not one of OPTIX"),
        ({"backend": "OPTIX"}, "needs device gpu"),
    ],
)
def test_absurd_still_options_are_refused_before_anything_runs(
    tmp_path: Path, options: dict[str, object], message: str
) -> None:
    req = submission.RenderRequest(output=tmp_path / "o", **options)  # type: ignore[arg-type]
    with pytest.raises(BadParameter, match=message):
        submission.check_request(req)


def test_job_specs_carry_the_still_options_and_older_specs_still_load() -> None:
    from farm.models import BlendSource, JobSpec

    source = BlendSource("path", "/x.blend", "0" * 64, "x.blend")
    spec = JobSpec(source, (1,), "1x1", 64, 48, "/o", samples=12, denoise=True,
                   mode="sample_split", split_parts=3, passes=True, backend="OPTIX",
                   allow_cpu_fallback=True, fps=25.0)  # fmt: skip
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec.tasks_per_frame == 3 and spec.layered
    old = json.loads(spec.to_json())
    for name in ("denoise", "mode", "split_parts", "passes", "backend", "allow_cpu_fallback",
                 "fps", "preview"):  # fmt: skip
        del old[name]
    loaded = JobSpec.from_json(json.dumps(old))
    assert (loaded.mode, loaded.tasks_per_frame, loaded.denoise, loaded.layered) == (
        "tiles", 1, False, False)  # fmt: skip
