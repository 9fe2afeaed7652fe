"""The render pipeline end to end: embedded farm, real workers, real Blender renders."""

from __future__ import annotations

import io
import itertools
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from farm import embedded, jobstore, queue, submission
from farm.accept import accept
from farm.errors import JobFailed, MissingFiles
from farm.settings import Settings
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.conftest import TESTDATA
from tests.farmprocs import WorkerProcess, submit, until, wait_for
from workers import exr
from workers.child import BlenderChild


@pytest.fixture(scope="session")
def anim_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("scenes") / "anim.blend", frame_end=3)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BlenderChild]:
    """A Blender child outside the farm that renders full frames to compare against."""
    work = tmp_path_factory.mktemp("reference")
    with BlenderChild(python=sys.executable, work_dir=work, name="reference") as child:
        yield child


def full_frame(child: BlenderChild, blend: Path, frame: int, out: Path) -> npt.NDArray[np.float32]:
    child.render(
        blend,
        frame=frame,
        width=67,
        height=41,
        rect=None,
        samples=None,
        out_path=out,
        timeout_s=120,
    )
    return exr.read_rgba(out)


def settings_for(tmp: Path) -> Settings:
    return Settings().with_(storage_dir=tmp / "storage", work_dir=tmp / "work")


def test_two_workers_2x2_tiles_match_full_frames_bit_for_bit(
    anim_scene: Path, reference: BlenderChild, tmp_path: Path
) -> None:
    out = tmp_path / "frames"
    req = submission.RenderRequest(output=out, tiles="2x2", formats="exr,png,jpeg")
    outcome = embedded.render(settings_for(tmp_path), anim_scene, req, 2, io.StringIO())
    assert outcome.job.state == "done"
    assert (outcome.job.tiles_done, outcome.job.frames_done) == (12, 3)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        *(f"frame_000{f}.{ext}" for f in (1, 2, 3) for ext in ("exr", "jpg", "png")),
        "manifest.json",
        "preview.mp4",  # an animation's video preview (workers.preview)
    ]
    frames = []
    for f in (1, 2, 3):
        stitched = exr.read_rgba(out / f"frame_000{f}.exr")
        expected = full_frame(reference, anim_scene, f, tmp_path / f"ref{f}.exr")
        assert stitched.shape == (41, 67, 4)
        assert np.array_equal(stitched, expected), f"frame {f} differs from its full-frame render"
        frames.append(stitched)
    assert not np.array_equal(frames[0], frames[2]), "the animation should change the frames"


def test_3x3_uneven_tiles_on_one_worker_match_the_full_frame(
    anim_scene: Path, reference: BlenderChild, tmp_path: Path
) -> None:
    req = submission.RenderRequest(output=tmp_path / "o", tiles="3x3", frames="2", formats="exr")
    embedded.render(settings_for(tmp_path), anim_scene, req, 1, io.StringIO())
    stitched = exr.read_rgba(tmp_path / "o" / "frame_0002.exr")
    assert np.array_equal(stitched, full_frame(reference, anim_scene, 2, tmp_path / "r.exr"))


def test_scripts_in_the_file_never_run_and_the_job_says_so(tmp_path: Path) -> None:
    canary_text, canary_driver = tmp_path / "text-ran", tmp_path / "driver-ran"
    blend = make_scene(
        tmp_path / "hostile.blend", autorun_canary=canary_text, driver_canary=canary_driver
    )
    req = submission.RenderRequest(output=tmp_path / "o", tiles="2x1", formats="png")
    outcome = embedded.render(settings_for(tmp_path), blend, req, 1, io.StringIO())
    assert outcome.job.state == "done"
    assert not canary_text.exists() and not canary_driver.exists()
    assert outcome.job.scripts_blocked
    assert any("wanted to run Python" in w for w in outcome.warnings)
    assert (tmp_path / "o" / "frame_0001.png").stat().st_size > 0


def test_textured_testdata_file_renders_with_its_pngs_beside_it(tmp_path: Path) -> None:
    req = submission.RenderRequest(
        output=tmp_path / "o", tiles="2x2", resolution="64x48", samples=4, frames="1", formats="exr"
    )
    outcome = embedded.render(
        settings_for(tmp_path), TESTDATA / "01_principled_material.blend", req, 1, io.StringIO()
    )
    assert outcome.report.missing_files == []
    image = exr.read_rgba(tmp_path / "o" / "frame_0001.exr")
    assert image.shape == (48, 64, 4)
    # magenta (1, 0, 1) is what Cycles paints for a texture it could not load
    magenta = (image[..., 0] > 0.9) & (image[..., 1] < 0.1) & (image[..., 2] > 0.9)
    assert magenta.sum() == 0
    assert image[..., :3].std() > 0.01


def test_testdata_animation_renders_frames_1_to_10_with_cycles(tmp_path: Path) -> None:
    req = submission.RenderRequest(
        output=tmp_path / "o", tiles="2x1", resolution="48x32", samples=2, formats="exr"
    )
    outcome = embedded.render(
        settings_for(tmp_path), TESTDATA / "12_anim_range_driver.blend", req, 2, io.StringIO()
    )
    assert outcome.job.spec.frames == tuple(range(1, 11))
    assert any("renders it with Cycles" in w for w in outcome.warnings)
    frames = [exr.read_rgba(tmp_path / "o" / f"frame_{f:04d}.exr") for f in range(1, 11)]
    assert all(not np.array_equal(a, b) for a, b in itertools.pairwise(frames))


def test_missing_texture_is_refused_naming_the_path(tmp_path: Path) -> None:
    req = submission.RenderRequest(output=tmp_path / "o")
    with pytest.raises(MissingFiles) as err:
        embedded.render(
            settings_for(tmp_path), TESTDATA / "01_missing_textures.blend", req, 1, io.StringIO()
        )
    assert "MissingTexture.png" in err.value.message
    assert not (tmp_path / "o").exists()


# --- failures inside workers -------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("slow") / "slow.blend", width=160, height=90, samples=2000
    )


def test_a_blender_child_killed_mid_tile_fails_that_tile_and_the_worker_goes_on(
    redis_url: str, slow_scene: Path, tmp_path: Path
) -> None:
    w = WorkerProcess(redis_url, tmp_path)
    try:
        store, job_id = submit(w.settings, slow_scene, tmp_path, tiles="2x1", samples=150)
        # the child's own word that it renders: the tile's "rendering" state comes before the
        # request reaches it, and a child killed between them is only started again (on a
        # loaded machine the kill once landed there and the tile rendered on, unfailed)
        until(lambda: w.child_logged("tessera-child event=render "), 120, "the tile rendering")
        os.kill(w.blender_pid(), signal.SIGABRT)
        retried = wait_for(
            store, job_id, lambda e: e.type == "tile_state" and e.state == "queued" and e.message
        )
        assert "SIGABRT" in retried.message
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 240)
        status = store.status(job_id)
        assert (status.tile_failures, status.tiles_done) == (1, 2)
        assert w.proc.poll() is None, "the worker must survive its Blender child"
    finally:
        w.stop()


def test_a_tile_past_its_time_limit_is_killed_and_exhausted_retries_fail_the_job(
    redis_url: str, slow_scene: Path, tmp_path: Path
) -> None:
    w = WorkerProcess(redis_url, tmp_path, FARM_TILE_TIMEOUT_S="1", FARM_MAX_ATTEMPTS="2")
    try:
        store, job_id = submit(
            w.settings,
            slow_scene,
            tmp_path,
            tiles="1x1",
            samples=20000,
            max_attempts=2,
            tile_timeout_s=1.0,
        )
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "failed", 120)
        status = store.status(job_id)
        assert status.tile_failures == 2
        assert "failed after 2 attempt(s)" in status.reason and "1 s" in status.reason
        assert w.proc.poll() is None
    finally:
        w.stop()


def test_a_failed_job_raises_with_the_reason_from_the_embedded_farm(
    slow_scene: Path, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path).with_(tile_timeout_s=1.0)
    req = submission.RenderRequest(
        output=tmp_path / "o",
        tiles="1x1",
        samples=20000,
        max_attempts=1,
        tile_timeout_s=1.0,
        formats="exr",
    )
    with pytest.raises(JobFailed) as err:
        embedded.render(settings, slow_scene, req, 1, io.StringIO())
    assert "failed after 1 attempt(s)" in err.value.message
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_a_blender_child_killed_while_converting_a_frame_costs_a_conversion_not_the_job(
    redis_url: str, tmp_path: Path
) -> None:
    """The frame's tiles are all there: its files are made again by a fresh child (the short
    chaos run once saw such a kill fail the job). A large frame keeps the child converting long
    enough for the test to kill it there, found by the child's log."""
    scene = make_scene(tmp_path / "large.blend", width=2000, height=2000, samples=1)
    w = WorkerProcess(redis_url, tmp_path)
    try:
        store = jobstore.JobStore(jobstore.connect(w.settings.redis_url), w.settings.lease_ttl_s)
        q = queue.RenderQueue(queue.connect(w.settings.redis_url), "cpu")
        source = LocalStorage(w.settings.storage_dir).put_upload(scene)
        req = submission.RenderRequest(output=tmp_path / "o", formats="png", tiles="1x1")
        job_id = accept(w.settings, store, q, req, source, inspect_timeout_s=120).job_id
        until(lambda: w.child_logged("event=convert"), 120, "the child converting the frame")
        os.kill(w.blender_pid(), signal.SIGKILL)
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state in ("done", "failed"))
        status = store.status(job_id)
        assert status.state == "done", status.reason
        assert "event=assembly_child_crashed" in w.log_text()
        assert status.tile_failures == 0
        assert (tmp_path / "o" / "frame_0001.png").stat().st_size > 0
    finally:
        w.stop()
