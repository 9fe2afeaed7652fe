"""One project's file that crashes Blender costs no other project anything, and the failures a
user reads name no server path, upload hash or other job (real worker, real Redis, real bpy)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from farm import jobstore, queue, submission
from farm.errors import BadBlendFile, BlenderCrashed
from farm.storage.layout import tile_log_key
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, wait_for
from tests.security.blender_scenes import make_poison, make_segfault

TIMEOUT_S = 180.0
#: what must never reach a user: an absolute path, a sha256, a job id (made by farm.jobstore)
ABSOLUTE_PATH = re.compile(r"(?<![\w/.:])/(?!/)[\w.-]+/")
SHA256 = re.compile(r"\b[0-9a-f]{64}\b")
JOB_ID = re.compile(r"\b\d{8}-\d{6}-[0-9a-f]{8}\b")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("scenes")
    plain = make_scene(folder / "b" / "plain.blend", width=32, height=24, samples=2)
    return {
        "plain": plain,
        "poison": make_poison(folder / "a" / "smoke.blend"),
        "segfault": make_segfault(plain, folder / "a" / "broken.blend"),
    }


def _farm(w: WorkerProcess) -> tuple[jobstore.JobStore, queue.RenderQueue, LocalStorage]:
    store = jobstore.JobStore(jobstore.connect(w.settings.redis_url))
    rq = queue.RenderQueue(queue.connect(w.settings.redis_url), "cpu")
    return store, rq, LocalStorage(w.settings.storage_dir)


def test_a_file_that_aborts_blender_on_the_next_load_costs_another_project_no_attempt(
    redis_url: str, tmp_path: Path, scenes: dict[str, Path]
) -> None:
    w = WorkerProcess(redis_url, tmp_path, "w1", FARM_CPU_THREADS="1")
    try:
        store, rq, storage = _farm(w)
        plain = storage.put_upload(scenes["plain"])
        report = submission.inspect(store.conn, rq, plain, TIMEOUT_S, project="B")
        # project A's smoke scene loads fine; Blender aborts when the next file replaces it
        poison = storage.put_upload(scenes["poison"])
        assert submission.inspect(store.conn, rq, poison, TIMEOUT_S, project="A").scene == "Scene"
        req = submission.RenderRequest(output=tmp_path / "o", formats="exr", tiles="1x1",
                                       project="B")  # fmt: skip
        spec, warnings = submission.plan_job(req, report, plain)
        job_id = submission.submit(rq.conn, store, rq, spec, warnings, False)
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", TIMEOUT_S)
        assert store.status(job_id).tile_failures == 0, w.log_text()
        assert store.tile_attempt(job_id, 1, 0) == 1
        assert "event=child_switch" in w.log_text()
    finally:
        w.stop()


def test_a_crashing_job_fails_with_reasons_that_name_no_server_detail(
    redis_url: str, tmp_path: Path, scenes: dict[str, Path]
) -> None:
    w = WorkerProcess(redis_url, tmp_path, "w1", FARM_CPU_THREADS="1")
    try:
        store, rq, storage = _farm(w)
        plain = storage.put_upload(scenes["plain"])
        report = submission.inspect(store.conn, rq, plain, TIMEOUT_S, project="B")
        # another job on the farm, whose id must not show in this one's failures
        other = submission.submit(rq.conn, store, rq, *submission.plan_job(
            submission.RenderRequest(output=tmp_path / "p", formats="exr", tiles="1x1",
                                     project="B"), report, plain), False)  # fmt: skip
        broken = storage.put_upload(scenes["segfault"])
        # Blender reads past the file's blocks: it dies of SIGSEGV, or finds the sizes wrong
        # ("unexpected data size") where what lies past them is mapped. The heap decides (the
        # paths of the checkout and venv, a file opened before): one checkout crashes every time,
        # another never. Either way the user reads a reason that names nothing of the server.
        with pytest.raises((BlenderCrashed, BadBlendFile)) as inspected:
            submission.inspect(store.conn, rq, broken, TIMEOUT_S, project="A")
        _assert_public(inspected.value.message, other)
        assert "log_tail" not in inspected.value.fields and "path" not in inspected.value.fields
        # forced past inspection: every attempt fails while Blender opens the file
        req = submission.RenderRequest(output=tmp_path / "o", formats="exr", tiles="1x1",
                                       project="A", max_attempts=2)  # fmt: skip
        spec, warnings = submission.plan_job(req, report, broken)
        job_id = submission.submit(rq.conn, store, rq, spec, warnings, False)
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "failed", TIMEOUT_S)
        status = store.status(job_id)
        crashed = "Blender crashed (SIGSEGV" in status.reason
        assert crashed or "corrupt or unreadable file" in status.reason, status.reason
        assert "broken.blend" in status.reason
        messages = [e.message for e in store.events(job_id, "0") if e.message]
        for text in [status.reason, *messages, *status.warnings]:
            _assert_public(text, other)
        # the whole story is in the tile's own log, stored with the job
        log = storage.read_bytes(tile_log_key(job_id, 1, 0, 1)).decode()
        assert "cause: " in log and "reason: " in log and "error: " in log
        # attempt 1's own outcome: the heap decides it anew for each attempt, so the job's
        # reason (its last attempt's) may say the other (seen in a full run)
        if "Blender crashed (SIGSEGV" in log:
            assert "Blender's log" in log and str(w.settings.work_dir) in log, log
    finally:
        w.stop()


def _assert_public(text: str, other_job: str) -> None:
    assert not ABSOLUTE_PATH.search(text), text
    assert not SHA256.search(text), text
    assert other_job not in text and not JOB_ID.search(text), text
