"""The worker's recovery sweep: what the job store's sweep found goes into the real rq queue on
the test Redis, each tile attempt once, and one job's failed push neither stops the others nor
is forgotten (issue #14 item 2)."""

from __future__ import annotations

import logging
import sys
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
