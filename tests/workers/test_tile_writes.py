"""What a worker writes to Redis as a tile starts and as it leaves its device, each in one round
trip: the tile's start with the attempt's start record (one step of the job store's) and the
operator's disabled flag; the attempt's end record, the worker's return to idle with the
tile's counts and the device lease's release."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from farm import jobstore, keys, queue, workerstate
from farm.alloc import scripts
from farm.alloc.allocator import DeviceOffer, Lease, Request, SlotAllocator
from farm.alloc.devices import Device
from farm.models import BlendSource, JobSpec, TileTask
from farm.settings import Settings
from farm.storage.local import LocalStorage
from farm.submission import submit
from workers.child import BlenderChild
from workers.tasks import WorkerContext, _Ending, rendering_shown

OFFER = DeviceOffer("cpu-writes", "cpu", "test CPU", 4096, 0, 1)
RENDER = Request("render", vram_mib=10, render_slots=1, device_ids=(OFFER.id,))
NAME = "writer"


@pytest.fixture
def ctx(redis_url: str, tmp_path: Path) -> WorkerContext:
    """A worker's context on the test Redis with its workers-page entry; its Blender child is
    never started."""
    settings = Settings(redis_url=redis_url, work_dir=tmp_path / "work", python=sys.executable)
    conn = jobstore.connect(redis_url)
    allocator = SlotAllocator(conn, ttl_s=30)
    allocator.register("agent-writes", "host-writes", [OFFER], ttl_s=3600)
    registry = workerstate.registry_for(conn, settings)
    registry.beat(NAME, {"kind": "render"})
    return WorkerContext(
        settings=settings,
        name=NAME,
        conn=conn,
        store=jobstore.JobStore(conn, tile_lease_s=30),
        queue=queue.RenderQueue(queue.connect(redis_url), "cpu"),
        storage=LocalStorage(tmp_path / "storage"),
        child=BlenderChild.for_settings(settings, NAME),
        allocator=allocator,
        device=Device(OFFER.id, "host-writes", None, "cpu", "cpu", 4096, 0, 1),
        report=workerstate.Reporter(registry, NAME),
    )


def _queued(ctx: WorkerContext, tiles: str = "1x1") -> str:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    spec = JobSpec(source, (1,), tiles, 64, 32, "/tmp/out")
    return submit(ctx.queue.conn, ctx.store, ctx.queue, spec, [], scripts_blocked=False)


def _started(ctx: WorkerContext) -> TileTask:
    task = TileTask(_queued(ctx), 1, 0, 1)
    assert ctx.begin(task) == ("ok", False)
    return task


def _sent(round_trips: Counter[str]) -> int:
    return round_trips[threading.current_thread().name]


def test_a_tiles_start_its_record_and_the_disabled_flag_are_one_round_trip(
    ctx: WorkerContext, round_trips: Counter[str]
) -> None:
    job_id = _queued(ctx, "3x1")
    first, task, third = (TileTask(job_id, 1, i, 1) for i in range(3))
    ctx.begin(first)  # the first call on a fresh server also loads the job store's functions
    before = _sent(round_trips)
    assert ctx.begin(task) == ("ok", False)
    assert _sent(round_trips) - before == 1
    attempts = {row.index: row.attempts for row in ctx.records.rows(job_id)}
    (row,) = attempts[1]
    assert (row.worker, row.device, row.outcome, row.device_class) == (
        NAME, "the CPU", "rendering", "cpu")  # fmt: skip

    # a tile not this attempt's is not started, and no record of it is written
    assert ctx.begin(task) == ("stale", False)
    time.sleep(0.01)
    assert ctx.records.rows(job_id)[1].attempts == attempts[1]  # (not written again)
    assert ctx.begin(TileTask(job_id, 1, 2, 2)) == ("stale", False)
    assert [row.attempts for row in ctx.records.rows(job_id)][2] == []

    assert ctx.report.registry is not None
    ctx.report.registry.set_disabled(NAME, True, by="an operator")
    assert ctx.begin(third) == ("ok", True)


def _ended_on_device(
    ctx: WorkerContext, outcome: str, **fields: Any
) -> tuple[TileTask, Lease, _Ending]:
    """A tile rendered on its device and ended there with ``outcome``: the end's writes are
    held for its ``_Ending``, not sent yet."""
    task = _started(ctx)
    # the first call on a fresh server loads the records' function: a tile of no job, which it
    # writes nothing for
    ctx.records.started(TileTask("no-job", 1, 0, 1), NAME, "the CPU", 1.0)
    lease = ctx.allocator.acquire(NAME, RENDER)
    ending = _Ending(ctx, task, lease)
    ctx.report.begin("rendering", task="tile", job=task.job_id, frame=1, tile=0, lease=lease.id)
    ctx._ending = ending
    ctx.record(task, outcome, **fields)
    ctx._ending = None
    return task, lease, ending


def test_a_tile_leaves_its_device_in_one_round_trip(
    ctx: WorkerContext, round_trips: Counter[str]
) -> None:
    task, lease, ending = _ended_on_device(ctx, "done", render_s=2.5, logged=True)
    ctx.report.count("done")

    before = _sent(round_trips)
    ending.send()
    assert _sent(round_trips) - before == 1

    ((row,),) = [r.attempts for r in ctx.records.rows(task.job_id)]
    assert (row.outcome, row.render_s, row.logged, row.worker) == ("done", 2.5, True, NAME)
    assert ctx.report.registry is not None
    me = ctx.report.registry.get(NAME)
    assert me is not None
    assert (me.state.value, me.job, me.tile, me.lease, me.tiles_done_today) == (
        "idle", "", None, "", 1)  # fmt: skip
    assert not ctx.allocator.check(lease)
    assert ctx.conn.exists(keys.lease(lease.id)) == 0


def test_a_tile_that_fails_on_its_device_leaves_it_in_one_round_trip_too(
    ctx: WorkerContext, round_trips: Counter[str]
) -> None:
    task, lease, ending = _ended_on_device(ctx, "requeued", cause="lease lost")
    # the lease was lost meanwhile: its release finds nothing, and says so without raising
    ctx.allocator.release(lease)

    before = _sent(round_trips)
    ending.send()
    assert _sent(round_trips) - before == 1
    ((row,),) = [r.attempts for r in ctx.records.rows(task.job_id)]
    assert (row.outcome, row.cause) == ("requeued", "lease lost")


def test_a_tiles_device_lease_and_its_row_on_the_workers_page_are_one_round_trip(
    ctx: WorkerContext, round_trips: Counter[str]
) -> None:
    """The page's row is written in the grant's round trip, and only where the lease was
    granted: a refused attempt (the device busy) leaves the worker's row as it was."""
    task = _started(ctx)
    registry = ctx.report.registry
    assert registry is not None

    shown = rendering_shown(ctx.report, task, "a project")
    other = ctx.allocator.acquire("someone", RENDER)  # the device's one render slot
    assert ctx.allocator.try_acquire(NAME, RENDER, shown) is None
    me = registry.get(NAME)
    assert me is not None and (me.state.value, me.lease) == ("idle", "")

    ctx.allocator.release(other)
    before = _sent(round_trips)
    lease = ctx.allocator.acquire(NAME, RENDER, beside=shown)
    assert _sent(round_trips) - before == 1
    me = registry.get(NAME)
    assert me is not None
    assert (me.state.value, me.lease, me.job, me.project, me.tile) == (
        "rendering", lease.id, task.job_id, "a project", 0)  # fmt: skip
    ctx.report.count("done")  # counted with the activity's end, not on its own
    before = _sent(round_trips)
    ending = _Ending(ctx, task, lease)
    ending.send()
    assert _sent(round_trips) - before == 1
    me = registry.get(NAME)
    assert me is not None and (me.state.value, me.tiles_done_today) == ("idle", 1)


def test_a_grant_made_again_after_its_library_loaded_still_shows_its_tile(
    ctx: WorkerContext,
) -> None:
    """A server without the allocator's functions (restarted empty, or an older farm's) runs
    the attempt again on its own once they are loaded: the row beside it follows it."""
    task = _started(ctx)

    shown = rendering_shown(ctx.report, task, "a project")
    ctx.allocator.release(ctx.allocator.acquire(NAME, RENDER, beside=shown))  # both loaded
    ctx.conn.function_delete(scripts.LIBRARY.name)
    lease = ctx.allocator.acquire(NAME, RENDER, beside=shown)
    assert ctx.report.registry is not None
    me = ctx.report.registry.get(NAME)
    assert me is not None and (me.state.value, me.lease) == ("rendering", lease.id)
