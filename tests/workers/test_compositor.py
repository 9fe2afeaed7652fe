"""PNG/JPEG take the composited result: the scene's compositor runs on the stitched passes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image

from farm import submission
from farm.errors import BadParameter
from farm.models import BlendSource, InspectionReport, JobSpec
from tests.blendscenes import make_scene, render_reference
from workers import stillmodes
from workers.child import BlenderChild

WIDTH, HEIGHT = 64, 48
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("compositor") / "composited.blend",
        width=WIDTH,
        height=HEIGHT,
        compositor=True,
    )


def _pixels(path: Path) -> npt.NDArray[np.int32]:
    with Image.open(path) as img:
        return np.asarray(img, dtype=np.int32)


def _job(child: BlenderChild, blend: Path, out: str) -> JobSpec:
    """The job the farm plans for ``blend`` (2x2 tiles, PNG, JPEG, EXR), from its inspection."""
    report = InspectionReport.from_dict(child.inspect(blend, TIMEOUT_S))
    source = BlendSource(kind="path", location=str(blend), sha256="0" * 64, name=blend.name)
    req = submission.RenderRequest(output=out, tiles="2x2", formats="png,jpeg,exr", preview=False)
    spec, warnings = submission.plan_job(req, report, source)
    assert any("the scene composites" in w for w in warnings) == spec.compositor
    return spec


def _render_job(child: BlenderChild, spec: JobSpec, blend: Path, work: Path) -> list[Path]:
    """Render frame 1's tasks as workers do, then build the frame's files."""
    work.mkdir()
    outputs = []
    for index in range(spec.tasks_per_frame):
        out = work / f"task-{index}.exr"
        child.render(blend, frame=1, width=spec.width, height=spec.height,
                     rect=stillmodes.task_rect(spec, index), samples=spec.samples, out_path=out,
                     timeout_s=TIMEOUT_S, options=stillmodes.task_options(spec, index))  # fmt: skip
        outputs.append(out)
    files, _ = stillmodes.frame_files(spec, 1, outputs, child, blend, work, TIMEOUT_S)
    return files


def test_tiled_png_is_blenders_composited_png(
    child: BlenderChild, scene: Path, tmp_path: Path
) -> None:
    spec = _job(child, scene, str(tmp_path / "out"))
    # the inspection found the compositor, so every tile renders the passes it reads
    assert spec.compositor and spec.layered
    files = _render_job(child, spec, scene, tmp_path / "work")
    png = next(f for f in files if f.suffix == ".png")
    jpeg = next(f for f in files if f.suffix == ".jpg")

    ours = _pixels(png)
    composited = _pixels(render_reference(scene, tmp_path / "blender.png", compositing=True))
    plain = _pixels(render_reference(scene, tmp_path / "plain.png", compositing=False))
    assert ours.shape == composited.shape == (HEIGHT, WIDTH, 4)
    # exactly Blender's pixels: the stitched passes are the full render's, bit for bit
    assert np.array_equal(ours, composited)
    blender_jpeg = render_reference(
        scene, tmp_path / "blender.jpg", "JPEG", quality=90, compositing=True
    )
    assert np.array_equal(_pixels(jpeg), _pixels(blender_jpeg))
    # the compositor really ran: its multiply by AO and saturation change the picture
    assert float(np.abs(ours[..., :3] - plain[..., :3]).mean()) > 5.0


def test_a_scene_without_a_compositor_converts_its_combined_pass(
    child: BlenderChild, tmp_path: Path
) -> None:
    blend = make_scene(tmp_path / "plain.blend", width=WIDTH, height=HEIGHT)
    spec = _job(child, blend, str(tmp_path / "out"))
    assert not spec.compositor and not spec.layered


def test_compositing_without_the_passes_is_refused_clearly(
    child: BlenderChild, scene: Path, tmp_path: Path
) -> None:
    frame = tmp_path / "frame.exr"
    child.render(scene, frame=1, width=WIDTH, height=HEIGHT, rect=None, samples=None,
                 out_path=frame, timeout_s=TIMEOUT_S)  # fmt: skip
    outputs = [{"path": tmp_path / "frame.png", "format": "PNG", "color_depth": "8"}]
    with pytest.raises(BadParameter, match=r"composites its render .* need the frame's passes"):
        child.convert(scene, frame, outputs, TIMEOUT_S, frame=1)
    assert not (tmp_path / "frame.png").exists()
