"""Job control against Redis, with the job scripts driven as a worker drives them: suspend holds
tiles back and resume queues them; requeue sends done, rendering and canceled tiles back under
new attempts and fences off the old ones (tiles and assemblies); archive; delete."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis

from farm import cli, keys, queue
from farm.errors import BadParameter, Conflict, NotFound
from farm.jobcontrol import JobControl
from farm.jobstore import JobStore
from farm.models import BlendSource, Event, JobSpec, TileTask
from farm.settings import Settings
from farm.states import JobState
from farm.storage.local import LocalStorage


@pytest.fixture
def store(redis_url: str) -> JobStore:
    return JobStore(redis.Redis.from_url(redis_url, decode_responses=True))


@pytest.fixture
def ctl(store: JobStore, redis_url: str, tmp_path: Path) -> JobControl:
    settings = Settings().with_(redis_url=redis_url, storage_dir=tmp_path / "storage")
    return JobControl(store, settings, LocalStorage(tmp_path / "storage"),
                      queue.connect(redis_url))  # fmt: skip


def _create(store: JobStore, out: Path, frames: int = 2) -> str:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    spec = JobSpec(source, tuple(range(1, frames + 1)), "2x1", 64, 32, str(out), max_attempts=1,
                   project="film", name="shot")  # fmt: skip
    job_id = store.new_job_id()
    pipe = store.conn.pipeline(transaction=True)
    store.stage_job(pipe, job_id, spec, [], scripts_blocked=False)
    pipe.execute()
    return job_id


def _render(store: JobStore, job_id: str, frame: int, attempt: int = 1) -> None:
    """Both tiles of a frame rendered and committed, the frame assembled and delivered (the
    delivery's record written as farm.delivery writes it)."""
    for index in (0, 1):
        task = TileTask(job_id, frame, index, attempt)
        assert store.start_tile(task) == "ok"
        store.finish_tile(task, tiles_per_frame=2)
    assembly = store.assembly_attempt(job_id, frame)
    assert store.claim_frame(job_id, frame, assembly)
    files = [{"name": f"frame_{frame:04d}.png", "size": 10, "sha256": "0" * 64, "url": ""}]
    store.conn.hset(keys.delivered(job_id), str(frame), json.dumps(files))
    assert store.finish_frame(job_id, frame, assembly) == "ok"


def _feed(store: JobStore) -> list[dict[str, str]]:
    """The entries of project film's live feed, oldest first."""
    entries: Any = store.conn.xrange(keys.project_events("film"))
    return [fields for _id, fields in entries]


def _actions(store: JobStore, job_id: str) -> list[Event]:
    return [e for e in store.events(job_id) if e.type == "job_action"]


def test_suspend_holds_what_a_worker_draws_lets_rendering_finish_and_resume_requeues_it(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    job_id = _create(store, tmp_path / "out", frames=1)
    rendering = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(rendering) == "ok"
    assert ctl.suspend(job_id, "alice").state == JobState.SUSPENDED
    with pytest.raises(Conflict, match="suspended"):
        ctl.suspend(job_id, "alice")
    # a worker draws the other tile: not started, held under its next attempt, no failure
    assert store.start_tile(TileTask(job_id, 1, 1, 1)) == "job_suspended"
    assert store.tile_states(job_id)["1:1"] == "queued"
    assert store.status(job_id).tile_failures == 0
    # the rendering one commits
    assert store.finish_tile(rendering, tiles_per_frame=2) == "ok"
    status, pushed = ctl.resume(job_id, "bob")
    assert (status.state, pushed) == (JobState.RUNNING, 1)
    assert [(e.state, e.message) for e in _actions(store, job_id)] == [
        ("suspended", "suspended by alice"), ("resumed", "resumed by bob")]  # fmt: skip
    # pushed to rq under attempt 2; attempt 1 (rq's old task) is stale
    held = TileTask(job_id, 1, 1, 2)
    assert ctl.rq_conn.exists(f"rq:job:{held.rq_id}")
    assert store.start_tile(TileTask(job_id, 1, 1, 1)) == "stale"
    assert store.start_tile(held) == "ok"
    assert store.finish_tile(held, tiles_per_frame=2) == "frame_ready"
    with pytest.raises(Conflict, match="only a suspended job can be resumed"):
        ctl.resume(job_id, "bob")
    # the project's feed saw the moves and the actions
    said = [(f["type"], f.get("state")) for f in _feed(store) if f["job_id"] == job_id]
    assert ("job_action", "suspended") in said and ("job_state", "assembling") in said


def test_a_job_suspended_before_any_tile_started_resumes_as_queued(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    job_id = _create(store, tmp_path / "out", frames=1)
    ctl.suspend(job_id, "alice")
    assert store.start_tile(TileTask(job_id, 1, 0, 1)) == "job_suspended"
    status, pushed = ctl.resume(job_id, "alice")
    assert (status.state, pushed) == (JobState.QUEUED, 1)


def test_requeue_of_a_done_frame_renders_and_delivers_it_again_under_fenced_attempts(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    job_id = _create(store, tmp_path / "out")
    _render(store, job_id, 1)
    _render(store, job_id, 2)
    assert store.state(job_id) == JobState.DONE
    done = ctl.requeue(job_id, "alice", frames=[2])
    assert done.redelivered == [2]
    assert sorted((t.frame, t.index, t.attempt) for t in done.tiles) == [(2, 0, 2), (2, 1, 2)]
    status = done.status
    assert (status.state, status.tiles_done, status.frames_done) == ("running", 2, 1)
    assert status.finished_s is None
    assert store.conn.hkeys(keys.delivered(job_id)) == ["1"], "frame 1's delivery is kept"
    # the old attempts can neither start nor commit
    old = TileTask(job_id, 2, 0, 1)
    assert store.start_tile(old) == "stale"
    assert store.finish_tile(old, tiles_per_frame=2) == "stale"
    _render(store, job_id, 2, attempt=2)
    # the new assembly went above the first one, whose late claim is refused
    assert store.conn.hget(keys.assembling(job_id), "2:last") == "2"
    assert not store.claim_frame(job_id, 2, 1)
    status = store.status(job_id)
    assert (status.state, status.frames_done, status.tiles_done) == ("done", 2, 4)
    assert [e.message for e in _actions(store, job_id)] == ["frame 2 requeued by alice"]


def test_requeue_of_a_rendering_tile_fences_its_worker_and_of_an_assembling_frame_its_assembler(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    job_id = _create(store, tmp_path / "out", frames=1)
    first = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(first) == "ok"
    ctl.requeue(job_id, "alice", tasks=[(1, 0)])
    assert not store.touch_tile(first), "the worker sees its tile taken over"
    assert store.finish_tile(first, tiles_per_frame=2) == "stale"
    for task in (TileTask(job_id, 1, 0, 2), TileTask(job_id, 1, 1, 1)):
        assert store.start_tile(task) == "ok"
        store.finish_tile(task, tiles_per_frame=2)
    assert store.state(job_id) == JobState.ASSEMBLING
    assert store.claim_frame(job_id, 1, 1)
    # requeued while assembling: the assembler's lease is gone, and the next goes above it
    ctl.storage.put_bytes(f"jobs/{job_id}/tiles/1/0-a2.exr", b"tile")
    ctl.storage.put_bytes(f"jobs/{job_id}/tiles/1/1-a1.exr", b"tile")
    requeued = ctl.requeue(job_id, "alice", tasks=[(1, 1)])
    assert [(t.index, t.attempt) for t in requeued.tiles] == [(1, 2)], "the sibling's tile is kept"
    assert requeued.status.state == JobState.RUNNING
    assert store.frame_fenced(job_id, 1, 1)
    assert store.finish_frame(job_id, 1, 1) == "stale"
    last = TileTask(job_id, 1, 1, 2)
    assert store.start_tile(last) == "ok"
    assert store.finish_tile(last, tiles_per_frame=2) == "frame_ready"
    assert store.assembly_attempt(job_id, 1) == 2


def test_a_task_whose_siblings_tiles_are_gone_requeues_its_whole_frame(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    job_id = _create(store, tmp_path / "out", frames=1)
    _render(store, job_id, 1)  # no tile files stored: as after FARM_TILE_RETENTION=delete
    requeued = ctl.requeue(job_id, "alice", tasks=[(1, 1)])
    assert sorted(t.index for t in requeued.tiles) == [0, 1]


def test_requeue_of_a_canceled_job_runs_its_unfinished_tiles_and_bad_choices_are_refused(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    job_id = _create(store, tmp_path / "out")
    _render(store, job_id, 1)
    assert store.end_job(job_id, JobState.CANCELED, "canceled by alice") == "ok"
    with pytest.raises(BadParameter, match="frame 9 is not a frame"):
        ctl.requeue(job_id, "alice", frames=[9])
    with pytest.raises(BadParameter, match="task 1:2 is not a task"):
        ctl.requeue(job_id, "alice", tasks=[(1, 2)])
    requeued = ctl.requeue(job_id, "alice")
    assert sorted((t.frame, t.index) for t in requeued.tiles) == [(2, 0), (2, 1)]
    assert (requeued.status.state, requeued.status.reason) == ("running", "")
    assert store.conn.zscore(keys.JOBS_ENDED, job_id) is None
    _render(store, job_id, 2, attempt=2)
    assert store.state(job_id) == JobState.DONE


def test_archive_hides_an_ended_job_and_delete_removes_its_records_and_files(
    store: JobStore, ctl: JobControl, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job_id = _create(store, out)
    with pytest.raises(Conflict, match="only an ended job can be archived"):
        ctl.archive(job_id, "alice")
    _render(store, job_id, 1)
    _render(store, job_id, 2)
    assert ctl.archive(job_id, "alice").archived_s is not None
    assert ctl.archive(job_id, "alice", archived=False).archived_s is None
    for name in ("frame_0001.png", "frame_0002.png", "mine.txt"):
        (out / name).write_bytes(b"x")
    ctl.storage.put_bytes(f"jobs/{job_id}/tiles/1/0-a1.exr", b"tile")
    other = _create(store, out)
    with pytest.raises(BadParameter, match="confirm"):
        ctl.delete(job_id, "alice", confirm=False)
    gone = ctl.delete(job_id, "alice", confirm=True)
    assert gone.objects == 3 and not gone.canceled
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"], "only what it delivered"
    assert not list(store.conn.scan_iter(match=f"{keys.PREFIX}:*{job_id}*"))
    assert store.conn.zscore(keys.project_jobs("film"), job_id) is None
    assert store.conn.zscore(keys.JOBS, job_id) is None
    assert not (tmp_path / "storage" / "jobs" / job_id).exists()
    with pytest.raises(NotFound):
        ctl.delete(job_id, "alice", confirm=True)
    # a queued job is canceled, then deleted
    assert ctl.delete(other, "alice", confirm=True).canceled
    deleted = [f["message"] for f in _feed(store) if f.get("state") == "deleted"]
    assert deleted == ["deleted by alice"] * 2


def test_the_cli_suspends_resumes_requeues_archives_and_deletes_only_with_yes(
    store: JobStore, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    monkeypatch.setenv("FARM_STORAGE_DIR", str(tmp_path / "storage"))
    job_id = _create(store, tmp_path / "out")
    assert cli.main(["suspend", job_id]) == 0
    assert store.state(job_id) == JobState.SUSPENDED
    assert cli.main(["resume", job_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[job_id]["state"] == "queued"
    _render(store, job_id, 1)
    _render(store, job_id, 2)
    assert cli.main(["requeue", job_id, "--frames", "2", "--tasks", "1:0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[job_id]["requeued_tiles"] == 4
    assert cli.main(["requeue", job_id, "--tasks", "1"]) == 2, "not frame:index"
    assert cli.main(["delete", job_id]) == 2, "not without --yes"
    assert "confirm" in capsys.readouterr().err
    assert cli.main(["delete", job_id, "--yes"]) == 0
    assert cli.main(["archive", job_id]) == 3, "no such job any more"


def test_into_an_object_store_a_requeued_frame_is_removed_to_be_committed_again_and_delete_too(
    store: JobStore, redis_url: str, tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    from farm import delivery

    settings = Settings().with_(
        redis_url=redis_url,
        storage_dir=tmp_path / "storage",
        s3_endpoint_url=s3_endpoint,
        s3_addressing_style="path",
    )
    ctl = JobControl(store, settings, LocalStorage(tmp_path / "storage"), queue.connect(redis_url))
    out = f"s3://{bucket}/renders/shot"
    job_id = _create(store, tmp_path / "unused")
    spec = store.spec(job_id)
    store.conn.hset(keys.job(job_id), "spec", replace(spec, output=out).to_json())
    _render(store, job_id, 1)
    _render(store, job_id, 2)
    target = delivery.open_output(out, settings)
    for name in ("frame_0001.png", "frame_0002.png", "other.txt"):
        src = tmp_path / name
        src.write_bytes(name.encode())
        target.put(name, src, once=True)
    ctl.requeue(job_id, "alice", frames=[2])
    assert [o.key for o in target.list("")] == ["frame_0001.png", "other.txt"]
    ctl.delete(job_id, "alice", confirm=True)
    assert [o.key for o in target.list("")] == ["other.txt"]
