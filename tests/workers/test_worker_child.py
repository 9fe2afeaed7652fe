"""A real worker's hold on its Blender child: started on the embedded farm's own files and kept,
replaced when it dies while starting, kept when a lease is found lost after its render."""

from __future__ import annotations

import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from farm import embedded, submission
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, until, wait_for
from workers.child import START_ATTEMPTS


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("scene") / "scene.blend")


def _python_failing_while(folder: Path) -> tuple[Path, Path]:
    """A Blender python that exits at once (before bpy answers) while the returned flag file
    exists, and is the farm's own python once it is gone. The sandbox binds its folder."""
    folder.mkdir(mode=0o755)
    (folder / "bin").mkdir(mode=0o755)
    flag = folder / "fail"
    flag.touch()
    python = folder / "bin" / "python"
    python.write_text(
        f'#!/bin/sh\nif [ -e "{flag}" ]; then echo "failing on purpose" >&2; exit 7; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    return python, flag


def test_farm_render_keeps_the_blender_child_it_started_on_the_files(
    scene: Path, tmp_path: Path
) -> None:
    settings = Settings().with_(storage_dir=tmp_path / "storage", work_dir=tmp_path / "work")
    req = submission.RenderRequest(output=tmp_path / "out", tiles="2x1", formats="exr")
    embedded.render(settings, scene, req, 1, io.StringIO(), keep_dir=tmp_path / "logs")
    text = (tmp_path / "logs" / "local-cpu-0.log").read_text()
    assert "commit=frame_ready" in text
    # one child for the inspection and both tiles: the one started with the worker
    assert "event=child_switch" not in text
    assert text.count("event=sandbox_started sandbox=blender-") == 1
    # and no trial sandbox before it: the child's own start is the trial
    assert "sandbox=check" not in text


def test_a_blender_child_that_dies_while_starting_is_replaced_and_the_worker_renders(
    redis_url: str, scene: Path, tmp_path: Path
) -> None:
    python, flag = _python_failing_while(tmp_path / "python")
    w = WorkerProcess(redis_url, tmp_path, FARM_BLENDER_PYTHON=str(python))
    try:
        until(lambda: w.log_text().count("event=child_start_failed") >= 2, 60,
              "two children dying while starting")  # fmt: skip
        assert w.proc.poll() is None, "the worker exited when its Blender child died starting"
        flag.unlink()
        until(lambda: "event=worker_ready" in w.log_text(), 60, "the worker ready")
        store, job_id = submit(w.settings, scene, tmp_path, tiles="1x1")
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done")
        assert store.status(job_id).tile_failures == 0
        assert w.proc.poll() is None
    finally:
        w.stop()


def test_a_worker_whose_blender_never_starts_says_it_is_unhealthy_after_bounded_attempts(
    redis_url: str, tmp_path: Path
) -> None:
    python, _flag = _python_failing_while(tmp_path / "python")
    w = WorkerProcess(redis_url, tmp_path, FARM_BLENDER_PYTHON=str(python))
    try:
        code = w.proc.wait(120)
    finally:
        w.stop()
    text = w.log_text()
    assert code != 0
    assert text.count("event=child_start_failed") == START_ATTEMPTS
    assert "event=worker_unhealthy" in text
    assert f"Blender could not start: {START_ATTEMPTS} children in a row failed" in text
    assert "exited with status 7 while starting" in text


def _waiting_for_a_request(pid: int) -> bool:
    """Whether the Blender child's main thread is blocked reading its command pipe."""
    try:
        return "pipe" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def test_a_lease_found_lost_after_the_render_finished_commits_nothing_and_keeps_the_child(
    redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    slow = make_scene(tmp_path / "slow" / "slow.blend", width=96, height=54)
    w = WorkerProcess(redis_url, tmp_path, "w1", FARM_LEASE_TTL_S="2")
    redis_pid = redis_server.pid
    assert redis_pid is not None
    paused = False
    try:
        store, job_id = submit(w.settings, slow, tmp_path, tiles="1x1", samples=200)
        blender = w.blender_pid()
        child_logs = tmp_path / "work" / "w1-logs"
        until(lambda: any("event=render " in p.read_text() for p in child_logs.glob("*.log")),
              120, "the child rendering the tile")  # fmt: skip
        children = sorted(child_logs.glob("*.log"))  # the worker's first child, then the job's
        switches = w.log_text().count("event=child_switch")
        # Redis stalls (a failover, a slow disk) while the child renders on: the lease's next
        # renewal waits for its answer, and the render ends before it comes
        os.kill(redis_pid, signal.SIGSTOP)
        paused, paused_at = True, time.monotonic()
        scratch = tmp_path / "work" / "w1" / f"{job_id}-1-0-1.exr"
        until(lambda: scratch.exists() and _waiting_for_a_request(blender), 60,
              "the child finishing the render")  # fmt: skip
        # the lease, last renewed before the stall, runs out on Redis's clock meanwhile
        expiry = paused_at + w.settings.lease_ttl_s + 0.5
        until(lambda: time.monotonic() > expiry, 10, "the lease's expiry")
        os.kill(redis_pid, signal.SIGCONT)
        paused = False
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 180)
        text = w.log_text()
        first = [line for line in text.splitlines() if "attempt=1 " in line]
        assert [line for line in first if "event=tile_failed" in line and "lease lost" in line]
        assert not [line for line in first if "commit=ok" in line or "commit=frame_ready" in line]
        assert store.tile_attempt(job_id, 1, 0) == 2, "the late result of attempt 1 committed"
        # the child that finished attempt 1 rendered attempt 2: not killed, not restarted
        assert w.blender_pid() == blender
        assert sorted(child_logs.glob("*.log")) == children
        assert text.count("event=child_switch") == switches
    finally:
        if paused:
            os.kill(redis_pid, signal.SIGCONT)
        w.stop()
