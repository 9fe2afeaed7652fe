"""The worker's recovery sweep: what the job store's sweep found goes into the real rq queue on
the test Redis, each tile attempt once, and one job's failed push neither stops the others nor
is forgotten (issue #14 item 2). Also the task records a worker's context writes around each
task."""

from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from farm import jobstore, keys, queue
from farm.alloc.allocator import SlotAllocator
from farm.alloc.devices import Device
from farm.jobstore import JobStore, Sweep
from farm.models import BlendSource, JobSpec, TileTask
from farm.settings import Settings
from farm.storage.local import LocalStorage
from farm.submission import submit
from tests.farmprocs import blocked_on_a_queue, until
from workers.child import BlenderChild
from workers.tasks import WorkerContext


class NoGraceStore(JobStore):
    """The real job store, sweeping with no grace for unconfirmed pushes (requeue_grace_s < 0):
    one sweep then names an attempt it requeues both as requeued and as unconfirmed."""

    def sweep(
        self, sweeper: str, period_s: float, limit: int = 1000, requeue_grace_s: float | None = None
    ) -> Sweep:
        return super().sweep(sweeper, period_s, limit, requeue_grace_s=-1)


@pytest.fixture
def ctx(redis_url: str, tmp_path: Path) -> WorkerContext:
    """A worker's context on the test Redis; its Blender child is never started (a sweep
    renders nothing)."""
    settings = Settings(redis_url=redis_url, work_dir=tmp_path / "work", python=sys.executable)
    conn = jobstore.connect(redis_url)
    return WorkerContext(
        settings=settings,
        name="sweeper",
        conn=conn,
        store=NoGraceStore(conn, tile_lease_s=settings.lease_ttl_s),
        queue=queue.RenderQueue(queue.connect(redis_url), "cpu"),
        storage=LocalStorage(tmp_path / "storage"),
        child=BlenderChild.for_settings(settings, "sweeper"),
        allocator=SlotAllocator(conn),
        device=Device("cpu-sweep", "host", None, "cpu", "cpu", 1024, 0, 1),
    )


def _job(ctx: WorkerContext) -> str:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    spec = JobSpec(source, (1,), "2x1", 64, 32, "/tmp/out", max_attempts=3)
    return submit(ctx.queue.conn, ctx.store, ctx.queue, spec, [], scripts_blocked=False)


def _vanish(ctx: WorkerContext, task: TileTask) -> None:
    """``task`` starts rendering on a worker that never renews it: its lease is over at once."""
    assert JobStore(ctx.store.conn, tile_lease_s=-1).start_tile(task) == "ok"


def _waiting(ctx: WorkerContext, task: TileTask) -> int:
    """How many times ``task`` waits in the queue."""
    return ctx.queue.waiting_ids().count(task.rq_id)


def test_an_attempt_both_requeued_and_unconfirmed_is_pushed_once(
    ctx: WorkerContext, rconn: redis.Redis
) -> None:
    job_id = _job(ctx)
    _vanish(ctx, TileTask(job_id, 1, 0, 1))
    retry = TileTask(job_id, 1, 0, 2)
    found = ctx.store.sweep("probe", ctx.settings.lease_ttl_s)
    assert found.tiles == found.unconfirmed == [retry], "the case under test: named twice"
    # the worker's own sweep meets the same case with the job's other tile, and the retry above
    # (requeued by that probe, never pushed) as unconfirmed
    _vanish(ctx, TileTask(job_id, 1, 1, 1))
    rconn.delete(keys.SWEEPER)
    ctx.sweep()
    again = TileTask(job_id, 1, 1, 2)
    assert (_waiting(ctx, retry), _waiting(ctx, again)) == (1, 1)
    assert rconn.zrange(keys.REQUEUED, 0, -1) == [], "every push confirmed"


def test_one_jobs_failed_push_skips_nothing_and_the_next_sweep_pushes_it(
    ctx: WorkerContext, rconn: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    broken, fine = sorted([_job(ctx), _job(ctx)])  # the broken one is pushed first
    for job_id in (broken, fine):
        _vanish(ctx, TileTask(job_id, 1, 0, 1))
    # the broken job's record cannot be read for a while: its push fails
    spec = rconn.hget(keys.job(broken), "spec")
    assert spec is not None
    rconn.hdel(keys.job(broken), "spec")
    with caplog.at_level(logging.WARNING, logger="tessera.worker"):
        ctx.sweep()
        assert _waiting(ctx, TileTask(fine, 1, 0, 2)) == 1, "the other job is pushed"
        assert _waiting(ctx, TileTask(broken, 1, 0, 2)) == 0
        # still unreadable at the next sweep: named again (as unconfirmed), failing again
        ctx.sweep()
    failed = [r.getMessage() for r in caplog.records if "event=sweep_push_failed" in r.getMessage()]
    assert len(failed) == 2 and all(f"job={broken}" in m for m in failed), failed
    rconn.hset(keys.job(broken), "spec", spec)
    ctx.sweep()
    assert _waiting(ctx, TileTask(broken, 1, 0, 2)) == 1, "a later sweep pushes it"
    assert _waiting(ctx, TileTask(fine, 1, 0, 2)) == 1
    assert rconn.zrange(keys.REQUEUED, 0, -1) == []


#: how long a worker may take between taking a tile task and starting the tile, in this test
START_GRACE_S = 0.3


def _taker(ctx: WorkerContext) -> tuple[type[queue._BandedQueue], queue._BandedQueue]:
    """A worker's queue with its pick (as run_worker makes it), for taking tasks by hand."""
    picker = queue.Picker("taker", slot_lease_s=START_GRACE_S)
    cls = type("_TakerQueue", (queue._BandedQueue,), {"picker": picker})
    return cls, cls(keys.render_queue("cpu"), connection=ctx.queue.conn)


def test_a_tile_taken_by_a_worker_that_died_before_starting_it_is_queued_again(
    ctx: WorkerContext, rconn: redis.Redis
) -> None:
    """rq would only fail a task whose worker died between taking it and starting it, a minute
    (or an hour) later: the job waited for ever (the short chaos run once, its worker killed
    there). The take is noted, and the sweep after the start's grace queues the tile again, no
    failure counted; a tile that was started is left to its lease. Both takes count: the pick
    and the blocking take of a worker that waited on an empty queue."""
    taker_class, taker = _taker(ctx)
    job_id = _job(ctx)
    taken = []
    for _ in range(2):
        got = taker_class.dequeue_any([taker], None, connection=ctx.queue.conn)
        assert got is not None
        taken.append(got[0].id)
    assert taken == [TileTask(job_id, 1, 0, 1).rq_id, TileTask(job_id, 1, 1, 1).rq_id]
    # tile 1 is started (and lives on its lease); tile 0's worker died before starting it
    assert ctx.store.start_tile(TileTask(job_id, 1, 1, 1)) == "ok"
    # the blocking take: the queue is empty until another job's tiles come
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(taker_class.dequeue_any, [taker], 5, connection=ctx.queue.conn)
        until(lambda: blocked_on_a_queue(rconn), 5, "the worker blocking on its empty queue")
        other = _job(ctx)
        got = waiting.result(10)
    assert got is not None and got[0].id == TileTask(other, 1, 0, 1).rq_id
    time.sleep(START_GRACE_S + 0.2)
    ctx.sweep()
    again = [TileTask(job_id, 1, 0, 2), TileTask(other, 1, 0, 2)]
    assert [_waiting(ctx, t) for t in again] == [1, 1], "queued again, each once"
    assert ctx.store.tile_states(job_id) == {"1:0": "queued", "1:1": "rendering"}
    assert ctx.store.status(job_id).tile_failures == 0
    why = [e.message for e in ctx.store.events(job_id) if e.type == "tile_state" and e.message]
    assert why == ["the worker that took it stopped before starting it"]
    # the old attempt, were its task run after all, is stale; the new one starts
    assert ctx.store.start_tile(TileTask(job_id, 1, 0, 1)) == "stale"
    assert ctx.store.start_tile(again[0]) == "ok"


def test_a_task_records_end_builds_on_its_own_start_only(ctx: WorkerContext) -> None:
    """The context keeps the start it wrote last (no read at the end); an end of another task
    (a sweep's, a failure after a restart) reads its own start back."""
    job_id = _job(ctx)
    first, second = TileTask(job_id, 1, 0, 1), TileTask(job_id, 1, 1, 1)
    assert ctx.begin(first) == ("ok", False)
    assert ctx.store.start_tile(second) == "ok"
    ctx.records.started(second, "elsewhere", "GPU 1 (T4)", 5.0, "t4")  # another process's
    ctx.record(second, "failed", cause="lost")
    ctx.record(first, "done", render_s=1.5)
    by_tile = {row.index: row.attempts for row in ctx.records.rows(job_id)}
    assert [(a.worker, a.outcome) for a in by_tile[1]] == [("elsewhere", "failed")]
    ((done,),) = [by_tile[0]]
    assert (done.worker, done.device, done.outcome, done.render_s) == (
        "sweeper", "the CPU", "done", 1.5)  # fmt: skip
    assert done.ended_s is not None and done.ended_s >= done.started_s > 0
