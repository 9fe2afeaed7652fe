"""The job store's Lua state machine against a real redis-server."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from rq.exceptions import DequeueTimeout

from farm import jobscripts, keys
from farm.errors import Conflict, NotFound
from farm.jobstore import JobStore, Sweep
from farm.models import BlendSource, JobSpec, TileTask
from farm.queue import RenderQueue, _BandedQueue, run_worker
from farm.settings import Settings
from farm.states import JOB_TRANSITIONS, TILE_TRANSITIONS, JobState, TileState
from farm.submission import submit


def _spec(frames: tuple[int, ...] = (1, 2), tiles: str = "2x1", attempts: int = 2) -> JobSpec:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    return JobSpec(source, frames, tiles, 64, 32, "/tmp/out", max_attempts=attempts)


@pytest.fixture
def store(redis_url: str) -> JobStore:
    return JobStore(redis.Redis.from_url(redis_url, decode_responses=True))


@pytest.fixture
def queue(redis_url: str) -> RenderQueue:
    return RenderQueue(redis.Redis.from_url(redis_url), "cpu")


def _new_job(store: JobStore, queue: RenderQueue, spec: JobSpec | None = None) -> str:
    return submit(queue.conn, store, queue, spec or _spec(), [], scripts_blocked=False)


def test_submit_creates_job_and_queues_every_tile_at_once(
    store: JobStore, queue: RenderQueue
) -> None:
    job_id = _new_job(store, queue)
    status = store.status(job_id)
    assert (status.state, status.tiles_total, status.frames_total) == ("queued", 4, 2)
    assert queue.depth() == 4
    assert set(store.tile_states(job_id).values()) == {TileState.QUEUED}


def test_a_job_is_in_its_projects_index_from_the_transaction_that_creates_it(
    store: JobStore, queue: RenderQueue, rconn: redis.Redis
) -> None:
    before = rconn.info("commandstats")
    job_id = _new_job(store, queue, dataclasses.replace(_spec(), project="shorts", priority=4))
    after = rconn.info("commandstats")
    # the web lists a project's jobs from this index: a job is there exactly when it exists
    assert store.project_job_ids("shorts") == [(job_id, store.created_s(job_id))]
    assert store.project_job_ids("other") == []
    assert store.spec(job_id).priority == 4
    assert queue.band(4).count == 4, "the tiles wait in their priority's band"
    # job, tiles, index and queue pushes: one MULTI/EXEC, nothing written outside it
    calls = {k: int(after[k]["calls"]) - int(before.get(k, {"calls": 0})["calls"])
             for k in ("cmdstat_multi", "cmdstat_exec")}  # fmt: skip
    assert calls == {"cmdstat_multi": 1, "cmdstat_exec": 1}


def test_priority_and_blocked_scripts_are_written_by_the_store(
    store: JobStore, queue: RenderQueue
) -> None:
    job_id = _new_job(store, queue)
    assert store.set_priority(job_id, 9).priority == 9
    assert store.spec(job_id).priority == 9
    assert not store.status(job_id).scripts_blocked
    store.mark_scripts_blocked(job_id)
    assert store.status(job_id).scripts_blocked
    store.end_job(job_id, JobState.CANCELED, "by test")
    with pytest.raises(Conflict, match="has ended \\(canceled\\); its priority is fixed"):
        store.set_priority(job_id, 1)
    assert store.spec(job_id).priority == 9
    with pytest.raises(NotFound):
        store.set_priority("no-such-job", 1)


def test_a_rendering_tile_is_leased_for_the_farms_lease_ttl(
    redis_url: str, queue: RenderQueue, rconn: redis.Redis
) -> None:
    # the tile's lease and its device lease expire together: one setting (FARM_LEASE_TTL_S)
    now = 1_000_000.0
    store = JobStore(redis.Redis.from_url(redis_url, decode_responses=True), clock=lambda: now)
    job_id = _new_job(store, queue)
    assert store.start_tile(TileTask(job_id, 1, 0, 1)) == "ok"
    assert float(rconn.hget(keys.tiles(job_id), "1:0:d") or 0) == now + Settings().lease_ttl_s


def test_a_job_runs_through_to_done_with_one_assembly_per_frame(
    store: JobStore, queue: RenderQueue
) -> None:
    job_id = _new_job(store, queue)
    ready = []
    for frame in (1, 2):
        for index in (0, 1):
            task = TileTask(job_id, frame, index, 1)
            assert store.start_tile(task) == "ok"
            assert store.state(job_id) == JobState.RUNNING
            outcome = store.finish_tile(task, tiles_per_frame=2)
            if outcome == "frame_ready":
                ready.append(frame)
    assert ready == [1, 2]
    assert store.state(job_id) == JobState.ASSEMBLING
    assert store.claim_frame(job_id, 1)
    assert store.finish_frame(job_id, 1) == "ok"
    assert store.finish_frame(job_id, 1) == "stale"  # a late duplicate assembly does not count
    assert store.finish_frame(job_id, 2) == "ok"
    status = store.status(job_id)
    assert (status.state, status.frames_done, status.tiles_done) == ("done", 2, 4)
    kinds = [e.type for e in store.events(job_id)]
    assert kinds.count("frame_done") == 2 and kinds[-1] == "job_state"


def test_a_tile_commits_once_and_a_stale_attempt_never(store: JobStore, queue: RenderQueue) -> None:
    job_id = _new_job(store, queue)
    task = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(task) == "ok"
    assert store.start_tile(task) == "stale"  # a duplicate delivery of the same attempt
    assert store.finish_tile(task, 2) == "ok"
    # the same commit sent again (its reply lost to a Redis restart) answers as the first time
    # and counts nothing twice
    assert store.finish_tile(task, 2) == "ok"
    assert store.status(job_id).tiles_done == 1
    last = TileTask(job_id, 1, 1, 1)
    assert store.start_tile(last) == "ok"
    assert store.finish_tile(last, 2) == "frame_ready"
    assert store.finish_tile(last, 2) == "frame_ready", "the frame's assembly must not be lost"
    assert store.status(job_id).tiles_done == 2
    # an attempt number that is not the tile's current one is refused outright
    assert store.start_tile(TileTask(job_id, 2, 1, 7)) == "stale"


def test_failures_retry_then_fail_the_job_with_a_reason(
    store: JobStore, queue: RenderQueue
) -> None:
    job_id = _new_job(store, queue, _spec(attempts=2))
    task = TileTask(job_id, 1, 0, 1)
    store.start_tile(task)
    assert store.fail_tile(task, "Blender exited with SIGABRT", 2) == ("retry", 2)
    assert store.fail_tile(task, "again", 2)[0] == "stale"  # attempt 1 is over
    retry = TileTask(job_id, 1, 0, 2)
    assert store.start_tile(retry) == "ok"
    assert store.fail_tile(retry, "Blender exited with SIGABRT", 2)[0] == "failed"
    status = store.status(job_id)
    assert status.state == "failed"
    assert "frame 1 tile 0 failed after 2 attempt(s): Blender exited with SIGABRT" in status.reason
    assert status.tile_failures == 2
    # the other tiles of a failed job are not started
    assert store.start_tile(TileTask(job_id, 1, 1, 1)) == "job_failed"


def test_a_requeue_that_is_not_a_failure_does_not_use_up_attempts(
    store: JobStore, queue: RenderQueue
) -> None:
    job_id = _new_job(store, queue, _spec(attempts=1))
    attempt = 1
    for _ in range(3):
        task = TileTask(job_id, 1, 0, attempt)
        assert store.start_tile(task) == "ok"
        outcome, attempt = store.fail_tile(task, "preempted", 1, counts=False)
        assert outcome == "retry"
    assert store.status(job_id).state == "running"


def test_cancel_stops_new_tiles_and_refuses_late_commits(
    store: JobStore, queue: RenderQueue
) -> None:
    job_id = _new_job(store, queue)
    running = TileTask(job_id, 1, 0, 1)
    store.start_tile(running)
    assert store.end_job(job_id, JobState.CANCELED, "by test") == "ok"
    assert store.start_tile(TileTask(job_id, 1, 1, 1)) == "job_canceled"
    assert store.finish_tile(running, 2) == "job_canceled"
    states = store.tile_states(job_id)
    assert states["1:0"] == TileState.CANCELED and states["2:1"] == TileState.CANCELED
    assert store.end_job(job_id, JobState.CANCELED) == "job_canceled"
    assert store.status(job_id).tiles_done == 0


@pytest.mark.parametrize(
    "ending", ["a tile out of attempts", "the sweep", "canceled", "failed by its assembler"]
)
def test_a_job_that_ends_takes_its_unfinished_tiles_with_it(
    store: JobStore, queue: RenderQueue, rconn: redis.Redis, ending: str
) -> None:
    job_id = _new_job(store, queue, _spec(attempts=1))
    # frame 1 tile 0 renders on a worker that then vanishes (its lease is still fresh)
    vanished = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(vanished) == "ok"
    # frame 1 tile 1 was handed back (preempted) and its push never confirmed
    handed_back = TileTask(job_id, 1, 1, 1)
    assert store.start_tile(handed_back) == "ok"
    assert store.fail_tile(handed_back, "preempted", 1, counts=False) == ("retry", 2)
    # frame 2 tile 0 waits in the queue; frame 2 tile 1 is the one that ends the job
    last = TileTask(job_id, 2, 1, 1)
    if ending == "a tile out of attempts":
        assert store.start_tile(last) == "ok"
        assert store.fail_tile(last, "Blender exited with SIGABRT", 1)[0] == "failed"
    elif ending == "the sweep":
        assert JobStore(store.conn, tile_lease_s=-1).start_tile(last) == "ok"
        assert store.sweep("w1", period_s=5).tiles == []
    elif ending == "canceled":
        assert store.end_job(job_id, JobState.CANCELED, "by test") == "ok"
    else:
        assert store.end_job(job_id, JobState.FAILED, "frame 1 could not be stored") == "ok"
    state = store.state(job_id)
    assert state == (JobState.CANCELED if ending == "canceled" else JobState.FAILED)
    # in the same step: no tile is left queued or rendering, none in the sweep's indexes
    states = store.tile_states(job_id)
    left = {k: s for k, s in states.items() if s in (TileState.QUEUED, TileState.RENDERING)}
    assert left == {}
    assert states["1:0"] == states["1:1"] == states["2:0"] == TileState.CANCELED
    indexed = [m for k in (keys.TILE_DEADLINES, keys.REQUEUED)
               for m in rconn.zrange(k, 0, -1) if str(m).startswith(job_id)]  # fmt: skip
    assert indexed == []
    assert not [f for f in rconn.hkeys(keys.tiles(job_id)) if str(f).endswith(":d")]
    # the vanished worker comes back: nothing it does counts, and it is told why
    assert store.finish_tile(vanished, 2) == f"job_{state}"
    assert store.fail_tile(vanished, "late", 1) == (f"job_{state}", 0)
    assert store.status(job_id).tiles_done == 0
    if state == JobState.FAILED:
        # the user retries: every tile not done goes again, the canceled ones included
        outcome, tasks = store.retry_failed(job_id)
        assert outcome == "ok"
        assert sorted(t.key for t in tasks) == ["1:0", "1:1", "2:0", "2:1"]
        assert set(store.tile_states(job_id).values()) == {TileState.QUEUED}
        assert all(store.start_tile(t) == "ok" for t in tasks)


def test_touch_renews_only_the_current_attempt(store: JobStore, queue: RenderQueue) -> None:
    job_id = _new_job(store, queue)
    task = TileTask(job_id, 1, 0, 1)
    store.start_tile(task)
    assert store.touch_tile(task)
    assert not store.touch_tile(TileTask(job_id, 1, 0, 2))


def test_the_scripts_refuse_a_move_the_table_forbids(
    store: JobStore, queue: RenderQueue, rconn: redis.Redis
) -> None:
    # A running job's end may only be failed or canceled: 'done' comes from its last frame.
    # END_JOB reaches the transition check (the job has not ended) and the table says no.
    assert JobState.DONE not in JOB_TRANSITIONS[JobState.RUNNING]
    job_id = _new_job(store, queue)
    assert store.start_tile(TileTask(job_id, 1, 0, 1)) == "ok"
    events = len(store.events(job_id))
    assert store.end_job(job_id, JobState.DONE, "forced") == "job_running"
    assert store.state(job_id) == JobState.RUNNING
    assert store.status(job_id).tiles_done == 0
    assert len(store.events(job_id)) == events, "a refused move tells nobody it happened"
    # A tile's moves go through the same table: a done tile cannot start rendering again.
    assert TileState.RENDERING not in TILE_TRANSITIONS[TileState.DONE]
    move = rconn.register_script(jobscripts.PRELUDE + "return tile_move(KEYS[1], ARGV[1], ARGV[2])")
    rconn.hset(keys.tiles(job_id), "2:0", "done")
    with pytest.raises(redis.ResponseError, match="illegal tile transition done -> rendering"):
        move(keys=[keys.tiles(job_id)], args=["2:0", "rendering"])
    assert rconn.hget(keys.tiles(job_id), "2:0") == "done"
    assert move(keys=[keys.tiles(job_id)], args=["1:0", "done"]) is None  # an allowed one moves
    assert rconn.hget(keys.tiles(job_id), "1:0") == "done"


def test_spec_round_trips_through_json(tmp_path: Path) -> None:
    spec = _spec()
    assert JobSpec.from_json(spec.to_json()) == spec


def test_priority_orders_waiting_tiles_and_a_change_moves_them(
    store: JobStore, queue: RenderQueue
) -> None:
    low = _new_job(store, queue, _spec(frames=(1,)))
    high = _new_job(store, queue, dataclasses.replace(_spec(frames=(1,)), priority=5))
    later = _new_job(store, queue, _spec(frames=(1,)))
    short = {low: "low", high: "high", later: "later"}
    assert [short[j] for j in _job_order(queue)] == ["high", "low", "later"]
    # a frame's assembly stays in front of every tile, whatever the priorities
    queue.enqueue_assembly(low, 1, 60)
    assert queue.waiting_ids()[0] == f"assemble-{low}-1-1"
    queue.set_priority(later, 9)
    assert [short[j] for j in _job_order(queue)] == ["later", "high", "low"]
    # back to 0: behind the higher job again, at the back of its band
    queue.set_priority(later, 0)
    assert [short[j] for j in _job_order(queue)] == ["high", "low", "later"]
    assert queue.waiting_ids()[0] == f"assemble-{low}-1-1"
    assert queue.depth() == 7, "moving loses and duplicates nothing"
    # workers take them in that order, one reliable take at a time
    taken = [_take(queue) for _ in range(7)]
    assert taken[0] == f"assemble-{low}-1-1"
    assert [short[j] for j in dict.fromkeys(_job_of(t) for t in taken[1:])] == [
        "high", "low", "later",
    ]  # fmt: skip
    assert queue.depth() == 0 and _take(queue) is None


def test_a_submission_reorders_nothing_and_a_blocked_worker_wakes_for_a_band(
    store: JobStore, queue: RenderQueue, rconn: redis.Redis
) -> None:
    for _ in range(30):
        _new_job(store, queue, _spec(frames=(1, 2, 3)))
    before = rconn.info("commandstats")
    _new_job(store, queue, dataclasses.replace(_spec(frames=(1,)), priority=3))
    after = rconn.info("commandstats")
    # 180 tiles wait; staging 2 more costs no read of them (the old reorder read each one)
    reads = sum(
        int(after[k]["calls"]) - int(before.get(k, {"calls": 0})["calls"])
        for k in ("cmdstat_lrange", "cmdstat_hget", "cmdstat_lindex")
        if k in after
    )
    assert reads == 0
    # an empty class queue: a worker blocked on it is woken by a push into a band
    empty = RenderQueue(queue.conn, "gpu")
    job_id = store.new_job_id()
    store.conn.hset(keys.job(job_id), "spec", dataclasses.replace(_spec(), priority=2).to_json())
    taken: list[Any] = []

    def worker() -> None:
        with contextlib.suppress(DequeueTimeout):
            taken.append(_BandedQueue.dequeue_any([empty.queue], 20, connection=empty.conn))

    thread = threading.Thread(target=worker)
    thread.start()
    deadline = time.monotonic() + 10
    while not any(c.get("cmd") == "blmove" for c in rconn.client_list()):
        assert time.monotonic() < deadline, "the worker never blocked on its queue"
        time.sleep(0.01)  # polling for the worker to block, bounded
    woken_at = time.monotonic()
    empty.stage_tiles([TileTask(job_id, 1, 0, 1)], 60)
    thread.join()
    assert taken and taken[0][0].id == TileTask(job_id, 1, 0, 1).rq_id
    assert time.monotonic() - woken_at < 10, "woken by the push, not by its timeout"


def _take(queue: RenderQueue) -> str | None:
    got = _BandedQueue.dequeue_any([queue.queue], None, connection=queue.conn)
    return None if got is None else str(got[0].id)


def _job_of(rq_id: str | None) -> str:
    return "-".join(str(rq_id).split("-")[1:4])


def _job_order(queue: RenderQueue) -> list[str]:
    """Each job id once, in the order its first waiting tile comes in the queue."""
    seen: list[str] = []
    for rq_id in queue.waiting_ids():
        if rq_id.startswith("tile-"):
            job = _job_of(rq_id)
            if job not in seen:
                seen.append(job)
    return seen


def test_one_sweeper_requeues_expired_tiles_of_every_job_and_reopens_stalled_frames(
    store: JobStore, queue: RenderQueue, rconn: redis.Redis
) -> None:
    jobs = [_new_job(store, queue) for _ in range(3)]
    stuck = TileTask(jobs[1], 2, 1, 1)
    fresh = TileTask(jobs[2], 1, 0, 1)
    assert store.start_tile(fresh) == "ok"
    assert store.sweep("w1", period_s=5).tiles == []  # its lease is fresh
    # a worker that will never renew: its tile's lease is over as soon as it starts
    silent = JobStore(store.conn, tile_lease_s=-1)
    assert silent.start_tile(stuck) == "ok"
    # another worker asks while w1 holds the sweeper's lease: it does nothing
    assert store.sweep("w2", period_s=5) == Sweep(False, [], [], [])
    found = store.sweep("w1", period_s=5)
    assert found.leader and found.tiles == [TileTask(jobs[1], 2, 1, 2)]
    assert store.finish_tile(stuck, 2) == "stale"  # the lost worker cannot commit late
    # a frame whose assembler vanished is offered again, once
    last = [TileTask(jobs[0], 1, i, 1) for i in (0, 1)]
    for task in last:
        store.start_tile(task)
        store.finish_tile(task, 2)
    rconn.hset(keys.assembling(jobs[0]), "1", time.time() - 1)
    rconn.zadd(keys.FRAME_DEADLINES, {f"{jobs[0]}|1": time.time() - 1})
    # under the next assembly attempt: the vanished assembler's lease is fenced off
    assert store.sweep("w1", period_s=5).frames == [(jobs[0], 1, 2)]
    assert store.sweep("w1", period_s=5).frames == []
    assert not store.claim_frame(jobs[0], 1, 1) and store.claim_frame(jobs[0], 1, 2)
    # the requeued attempt was never confirmed pushed: after the grace the sweep names it, and
    # names it again (a push that failed) until the caller confirms it is in the queue
    requeued = TileTask(jobs[1], 2, 1, 2)
    assert store.sweep("w1", period_s=5, requeue_grace_s=-1).unconfirmed == [requeued]
    assert store.sweep("w1", period_s=5, requeue_grace_s=-1).unconfirmed == [requeued]
    store.confirm_pushed([requeued])
    assert store.sweep("w1", period_s=5, requeue_grace_s=-1).unconfirmed == []
    # the requeued attempt renders: the next worker starts it, and nothing is requeued twice
    assert store.start_tile(requeued) == "ok"
    assert store.sweep("w1", period_s=5).tiles == []


def test_a_sweep_reads_only_what_expired_not_every_job(
    store: JobStore, queue: RenderQueue, rconn: redis.Redis
) -> None:
    def commands() -> int:
        stats = rconn.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")

    store.sweep("w1", period_s=5)  # its scripts loaded
    for jobs in (2, 60):
        for _ in range(jobs):
            store.start_tile(TileTask(_new_job(store, queue), 1, 0, 1))
        before = commands()
        store.sweep("w1", period_s=5)
        # the recovery sweep's few, and the trim's (ended jobs, the usage of each project)
        assert commands() - before <= 12, f"a quiet sweep over {jobs} jobs"


def test_a_list_reads_every_status_at_once(store: JobStore, queue: RenderQueue) -> None:
    first, second = _new_job(store, queue), _new_job(store, queue)
    store.end_job(second, JobState.CANCELED, "by test")
    reads: list[int] = []
    execute: Callable[..., Any] = store.conn.execute_command

    def counting(*args: Any, **kwargs: Any) -> Any:
        reads.append(1)
        return execute(*args, **kwargs)

    store.conn.execute_command = counting  # type: ignore[method-assign]
    found = store.statuses([first, "no-such-job", second])
    assert reads == [], "one pipeline, not a call per job"
    assert [s.state if s else None for s in found] == ["queued", None, "canceled"]
    assert found[0] == store.status(first)


def test_a_burst_worker_serves_its_class_through_the_banded_dequeue(
    store: JobStore, queue: RenderQueue
) -> None:
    # a real rq worker with the farm's dequeue takes work from the class queue and a band
    queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=60)
    high = queue.band(3).enqueue_call("builtins.len", args=([1, 2],), result_ttl=60)
    queue.conn.zadd(queue.bands_key, {queue.band(3).key: 3})
    assert queue.depth() == 2
    run_worker(queue.conn, "cpu", "burst-test", burst=True)
    assert queue.depth() == 0
    assert high.get_status(refresh=True) == "finished" and high.return_value() == 2


def test_the_scripts_allow_exactly_the_moves_of_farm_states(rconn: redis.Redis) -> None:
    check = rconn.register_script(
        jobscripts.PRELUDE
        + "return {allowed(JOB_MOVES, ARGV[1], ARGV[2]) and 1 or 0,"
        + " allowed(TILE_MOVES, ARGV[1], ARGV[2]) and 1 or 0}"
    )
    # (old, new) -> allowed, as farm.states says, for jobs (column 0) and tiles (column 1)
    expected: list[tuple[int, str, str, bool]] = []
    for j_old in JobState:
        for j_new in JobState:
            expected.append((0, j_old, j_new, j_new in JOB_TRANSITIONS.get(j_old, ())))
    for t_old in TileState:
        for t_new in TileState:
            expected.append((1, t_old, t_new, t_new in TILE_TRANSITIONS.get(t_old, ())))
    for column, old, new, ok in expected:
        assert check(args=[old, new])[column] == int(ok), (old, new)
