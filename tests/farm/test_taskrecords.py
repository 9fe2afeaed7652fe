"""Per-task records beside the tiles' states, and the ETA and frame times taken from them."""

from __future__ import annotations

import pytest
import redis

from farm.jobstore import JobStore
from farm.models import BlendSource, JobSpec, TileTask
from farm.queue import RenderQueue
from farm.submission import submit
from farm.taskrecords import Attempt, TaskRecords, TaskRow, progress


def _spec() -> JobSpec:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    return JobSpec(source, (1, 2), "2x1", 64, 32, "/tmp/out", max_attempts=2)


@pytest.fixture
def store(redis_url: str) -> JobStore:
    return JobStore(redis.Redis.from_url(redis_url, decode_responses=True))


@pytest.fixture
def job_id(store: JobStore, redis_url: str) -> str:
    """A submitted job of two frames of 2x1 tiles."""
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    return submit(queue.conn, store, queue, _spec(), [], scripts_blocked=False)


def test_records_live_beside_the_tiles_without_disturbing_the_state_machine(
    store: JobStore, job_id: str
) -> None:
    records = TaskRecords(store.conn)
    first = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(first) == "ok"
    records.started(first, "w1", "the CPU", 100.0)
    records.ended(first, 102.0, "failed", cause="timed out after 1 s in frame 1", logged=True)
    assert store.fail_tile(first, "timed out", 2) == ("retry", 2)
    second = TileTask(job_id, 1, 0, 2)
    assert store.start_tile(second) == "ok"
    records.started(second, "w2", "the CPU", 103.0)
    assert store.finish_tile(second, 2) == "ok"
    records.ended(second, 104.5, "done", render_s=1.25, peak_memory_mib=31.5)
    # the state machine's readers see tiles only
    assert set(store.tile_states(job_id)) == {"1:0", "1:1", "2:0", "2:1"}
    assert {(t.frame, t.index) for t in store.queued_tasks(job_id)} == {(1, 1), (2, 0), (2, 1)}
    (row, *others) = records.rows(job_id)
    assert (row.frame, row.index, row.state, row.attempt) == (1, 0, "done", 2)
    assert [a.outcome for a in row.attempts] == ["failed", "done"]
    assert row.attempts[0].cause == "timed out after 1 s in frame 1" and row.attempts[0].logged
    assert (row.last and row.last.worker, row.last and row.last.render_s) == ("w2", 1.25)
    assert [r.attempts for r in others] == [[], [], []]
    # a record of a tile the job no longer has (trimmed) is not written back
    store.conn.delete(f"tessera:job:{job_id}:tiles")
    records.ended(TileTask(job_id, 2, 0, 1), 105.0, "done")
    assert not store.conn.exists(f"tessera:job:{job_id}:tiles")


def test_an_end_given_its_start_record_writes_it_whole_without_reading_it_back(
    store: JobStore, job_id: str
) -> None:
    records = TaskRecords(store.conn)
    task = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(task) == "ok"
    kept = records.started(task, "w1", "GPU 0 (T4)", 100.0, "t4")
    assert kept == Attempt(1, "w1", "GPU 0 (T4)", 100.0, device_class="t4")
    # the stored start is what the end builds on only where no record is given
    field = f"{task.key}:r{task.attempt}"
    store.conn.hset(f"tessera:job:{job_id}:tiles", field, '{"attempt": 1, "worker": "other", '
                    '"device": "x", "started_s": 1.0}')  # fmt: skip
    records.ended(task, 102.5, "done", started=kept, render_s=2.0)
    (row, *_) = records.rows(job_id)
    assert row.attempts == [
        Attempt(1, "w1", "GPU 0 (T4)", 100.0, 102.5, 2.0, outcome="done", device_class="t4")
    ]
    records.ended(task, 103.0, "done")  # read back: what is stored now
    assert records.rows(job_id)[0].attempts[0].worker == "w1"


def _row(frame: int, index: int, state: str, *attempts: Attempt) -> TaskRow:
    return TaskRow(frame, index, state, attempts[-1].attempt if attempts else 1, list(attempts))


def test_eta_is_the_median_task_time_times_tasks_left_over_workers_rendering() -> None:
    rows = [
        _row(1, 0, "done", Attempt(1, "a", "", 0.0, 10.0, 8.0, 40.0, "done")),
        _row(1, 1, "done", Attempt(1, "b", "", 0.0, 12.0, 9.0, 42.0, "done")),
        _row(2, 0, "done", Attempt(1, "a", "", 10.0, 30.0, 18.0, 41.0, "done")),
        _row(2, 1, "rendering", Attempt(1, "b", "", 12.0)),
        _row(3, 0, "rendering", Attempt(1, "a", "", 30.0)),
        *(_row(f, i, "queued") for f in (3, 4) for i in (0, 1) if (f, i) != (3, 0)),
    ]
    p = progress(rows)
    assert (p.tasks_total, p.tasks_done, p.median_task_s, p.workers) == (8, 3, 12.0, 2)
    assert p.eta_s == 12.0 * 5 / 2
    # frame 1 is complete: its tasks' render times summed, its wall time first start to last end
    assert [(f.frame, f.render_s, f.wall_s) for f in p.frames] == [(1, 17.0, 12.0)]
    # nothing done yet: no ETA; everything done: none either
    assert progress(rows[3:]).eta_s is None
    assert progress(rows[:3]).eta_s is None
    # a retried tile's time is its committed attempt's, not its failed one's
    retried = _row(5, 0, "done", Attempt(1, "a", "", 0.0, 100.0, outcome="failed"),
                   Attempt(2, "c", "", 100.0, 104.0, 3.0, 40.0, "done"))  # fmt: skip
    assert progress([retried]).median_task_s == 4.0
