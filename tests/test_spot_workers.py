"""Spot-safe workers: SIGTERM mid-tile loses no work, commits nothing twice, and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from farm import jobstore, queue, submission, workerstate
from farm.models import InspectionReport
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, until, wait_for

#: enough samples that the tile is still rendering when the signal comes (seconds on one
#: thread), few enough that the takeover's re-render costs little
SLOW_SAMPLES = 600


@pytest.fixture(scope="module")
def slow_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("spot") / "slow.blend", width=96, height=54)


def _commits(*workers: WorkerProcess) -> list[str]:
    return [
        line
        for w in workers
        for line in w.log_text().splitlines()
        if "event=tile_done" in line and ("commit=ok" in line or "commit=frame_ready" in line)
    ]


@pytest.mark.parametrize(
    ("grace_s", "signals"),
    [(0.5, 1), (120, 2)],
    ids=["grace-runs-out", "second-sigterm"],
)
def test_sigterm_mid_tile_requeues_it_once_uncounted_and_the_worker_exits_0(
    redis_url: str, tmp_path: Path, slow_scene: Path, grace_s: float, signals: int
) -> None:
    env = {"FARM_STOP_GRACE_S": str(grace_s), "FARM_CPU_THREADS": "1"}
    a = WorkerProcess(redis_url, tmp_path, "spot", **env)
    b: WorkerProcess | None = None
    try:
        store, job_id = submit(a.settings, slow_scene, tmp_path, tiles="1x1",
                               samples=SLOW_SAMPLES)  # fmt: skip
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
        blender = a.blender_pid()
        a.proc.send_signal(signal.SIGTERM)
        if signals == 2:
            # signals of one kind do not queue: send the second once the first was handled
            until(lambda: "event=worker_stopping" in a.log_text(), 10, "the first SIGTERM")
            a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(30) == 0, a.log_text()
        assert not os.path.exists(f"/proc/{blender}"), "the Blender child outlived its worker"
        requeued = wait_for(store, job_id, lambda e: e.state == "queued" and bool(e.message), 10)
        assert "worker stopped" in requeued.message and requeued.attempt == 2
        # the stopping worker released its lease: a new worker gets the device at once
        b = WorkerProcess(redis_url, tmp_path, "takeover", FARM_CPU_THREADS="2")
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 180)
        status = store.status(job_id)
        assert status.tile_failures == 0, "an abandoned tile is not a failed tile"
        assert store.tile_attempt(job_id, 1, 0) == 2
        assert len(_commits(a, b)) == 1 and "attempt=2" in _commits(b)[0]
        assert (tmp_path / "o" / "frame_0001.exr").stat().st_size > 0
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_sigterm_within_the_grace_period_lets_the_tile_finish_and_commit(
    redis_url: str, tmp_path: Path, slow_scene: Path
) -> None:
    a = WorkerProcess(redis_url, tmp_path, "spot", FARM_STOP_GRACE_S="120")
    b: WorkerProcess | None = None
    try:
        store, job_id = submit(a.settings, slow_scene, tmp_path, tiles="1x1", samples=300)
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(120) == 0, a.log_text()
        assert len(_commits(a)) == 1 and "attempt=1" in _commits(a)[0]
        # it took no more work: the frame's assembly waits for another worker
        assert store.status(job_id).frames_done == 0
        b = WorkerProcess(redis_url, tmp_path, "next")
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 120)
        assert store.tile_attempt(job_id, 1, 0) == 1 and store.status(job_id).tile_failures == 0
        assert _commits(b) == []
    finally:
        a.stop()
        if b is not None:
            b.stop()


@pytest.mark.parametrize("during", ["child-start", "probe"])
def test_sigterm_mid_inspection_hands_it_to_another_worker_within_the_grace(
    redis_url: str, tmp_path: Path, during: str
) -> None:
    """An inspection is abandoned when the grace runs out, like a tile: while its child starts
    (a project's first file on this worker: no second start is tried), or while its probe
    renders (made to take half a minute here); the worker exits, and the asker gets its report
    from the next worker."""
    scene = make_scene(tmp_path / "probe.blend", width=96, height=54, samples=4096)
    a = WorkerProcess(redis_url, tmp_path, "spot", FARM_STOP_GRACE_S="0.5",
                      FARM_CPU_THREADS="1", FARM_ESTIMATE_PROBE_S="30")  # fmt: skip
    b: WorkerProcess | None = None
    asked: dict[str, object] = {}
    try:
        conn = jobstore.connect(a.settings.redis_url)
        q = queue.RenderQueue(queue.connect(a.settings.redis_url), "cpu")
        source = LocalStorage(a.settings.storage_dir).put_upload(scene)
        if during == "probe":
            # the project's child is started by a first inspection: the next one keeps it
            submission.inspect(conn, q, source, 120, project="p")

        def ask() -> None:
            try:
                asked["report"] = submission.inspect(conn, q, source, 120, project="p",
                                                     probe=True)  # fmt: skip
            except Exception as exc:  # the assertion below names it
                asked["error"] = exc

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        registry = workerstate.registry_for(conn, a.settings)

        def inspecting() -> bool:
            info = registry.get("spot")
            return info is not None and info.task == "inspection"

        until(inspecting, 60, "worker spot inspecting")
        a.proc.send_signal(signal.SIGTERM)
        try:
            code = a.proc.wait(15)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker sat out its inspection past the grace:\n" + a.log_text())
        log = a.log_text()
        assert code == 0, log
        assert "event=inspection_handed_back" in log
        assert "event=child_start_failed" not in log, "a stopping worker started Blender again"
        b = WorkerProcess(redis_url, tmp_path, "next", FARM_ESTIMATE_PROBE_S="0.5")
        asker.join(120)
        assert "error" not in asked, asked
        report = asked["report"]
        assert isinstance(report, InspectionReport) and report.probe is not None
    finally:
        a.stop()
        if b is not None:
            b.stop()
