"""A rendering tile's renewal: its device's lease and the tile's own in one round trip to the
test Redis, and what the worker learns when either is gone."""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from farm import jobstore, keys, queue
from farm.alloc.agent import heartbeat
from farm.alloc.allocator import DeviceOffer, Lease, Request, SlotAllocator
from farm.alloc.devices import Device
from farm.models import BlendSource, JobSpec, TileTask
from farm.settings import Settings
from farm.storage.local import LocalStorage
from farm.submission import submit
from workers.child import BlenderChild
from workers.tasks import CarriedRenewal, WorkerContext, _Renewal

OFFER = DeviceOffer("cpu-renewal", "cpu", "test CPU", 4096, 0, 1)
RENDER = Request("render", vram_mib=10, render_slots=1, device_ids=(OFFER.id,))


@pytest.fixture
def ctx(redis_url: str, tmp_path: Path) -> WorkerContext:
    """A worker's context on the test Redis; its Blender child is never started."""
    settings = Settings(redis_url=redis_url, work_dir=tmp_path / "work", python=sys.executable)
    conn = jobstore.connect(redis_url)
    allocator = SlotAllocator(conn, ttl_s=30)
    allocator.register("agent-renewal", "host-renewal", [OFFER], ttl_s=3600)
    return WorkerContext(
        settings=settings,
        name="renewer",
        conn=conn,
        store=jobstore.JobStore(conn, tile_lease_s=30),
        queue=queue.RenderQueue(queue.connect(redis_url), "cpu"),
        storage=LocalStorage(tmp_path / "storage"),
        child=BlenderChild.for_settings(settings, "renewer"),
        allocator=allocator,
        device=Device(OFFER.id, "host-renewal", None, "cpu", "cpu", 4096, 0, 1),
    )


def _rendering(ctx: WorkerContext) -> tuple[TileTask, Lease]:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    spec = JobSpec(source, (1,), "1x1", 64, 32, "/tmp/out")
    job_id = submit(ctx.queue.conn, ctx.store, ctx.queue, spec, [], scripts_blocked=False)
    task = TileTask(job_id, 1, 0, 1)
    assert ctx.store.start_tile(task) == "ok"
    return task, ctx.allocator.acquire("renewer", RENDER)


def _deadline(ctx: WorkerContext, task: TileTask) -> float:
    return float(ctx.conn.hget(keys.tiles(task.job_id), f"{task.key}:d") or 0)


def test_a_renewal_renews_both_leases_in_one_round_trip(
    ctx: WorkerContext, round_trips: Counter[str]
) -> None:
    task, lease = _rendering(ctx)
    renewal = _Renewal(ctx, task, lease)
    ctx.conn.hset(keys.tiles(task.job_id), f"{task.key}:d", 0)
    time.sleep(0.01)  # a later expiry on Redis's clock (ms)

    me = threading.current_thread().name
    before = round_trips[me]
    renewal.renew()
    assert round_trips[me] - before == 1
    assert renewal.lost is None
    assert renewal.lease.expires_ms > lease.expires_ms
    assert _deadline(ctx, task) > 0


def test_a_lost_lease_or_a_tile_taken_over_is_what_the_worker_learns(
    ctx: WorkerContext,
) -> None:
    task, lease = _rendering(ctx)
    # another attempt of the tile is the one rendering now
    taken = _Renewal(ctx, TileTask(task.job_id, task.frame, task.index, 2), lease)
    taken.renew()
    assert taken.lost == "the tile was taken over"

    ctx.allocator.release(lease)
    gone = _Renewal(ctx, task, lease)
    gone.renew()
    assert gone.lost == "unknown lease"
    with pytest.raises(Exception, match="lease lost: unknown lease"):
        gone.check()


def _carrying(ctx: WorkerContext, interval_s: float) -> CarriedRenewal:
    ctx.carried = CarriedRenewal(interval_s)
    return ctx.carried


def test_the_workers_heartbeat_carries_its_tiles_renewal_in_its_one_round_trip(
    ctx: WorkerContext, round_trips: Counter[str]
) -> None:
    """A rendering worker renewed its tile in a round trip of its own every third of the lease,
    beside its agent's heartbeat every third of the agent timeout; the beat now carries it."""
    carried = _carrying(ctx, interval_s=5.0)
    task, lease = _rendering(ctx)
    ctx.conn.hset(keys.tiles(task.job_id), f"{task.key}:d", 0)
    time.sleep(0.01)  # a later expiry on Redis's clock (ms)
    with _Renewal(ctx, task, lease) as renewal:
        assert renewal.carried  # a 30 s lease renewed every 10 s: beats every 5 s carry it
        me = threading.current_thread().name
        before = round_trips[me]
        heartbeat(ctx.allocator, "agent-renewal", "host-renewal", [OFFER], 3600, None,
                  beside=carried.beat_in)  # fmt: skip
        assert round_trips[me] - before == 1
        assert renewal.lost is None and renewal.lease.expires_ms > lease.expires_ms
        assert _deadline(ctx, task) > 0
    ctx.conn.hset(keys.tiles(task.job_id), f"{task.key}:d", 0)
    heartbeat(ctx.allocator, "agent-renewal", "host-renewal", [OFFER], 3600, None,
              beside=carried.beat_in)  # fmt: skip
    assert _deadline(ctx, task) == 0  # the tile off the device: nothing carried


def test_a_lease_a_beat_finds_lost_cancels_the_render_at_once(
    ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    carried = _carrying(ctx, interval_s=5.0)
    task, lease = _rendering(ctx)
    cancelled = threading.Event()

    def cancel(why: str) -> bool:
        cancelled.set()
        return True

    monkeypatch.setattr(ctx.child, "cancel", cancel)
    with _Renewal(ctx, task, lease) as renewal:
        ctx.allocator.release(lease)  # preempted
        heartbeat(ctx.allocator, "agent-renewal", "host-renewal", [OFFER], 3600, None,
                  beside=carried.beat_in)  # fmt: skip
        assert renewal.lost == "unknown lease"
        assert cancelled.wait(2.0)  # not a period later


@pytest.mark.parametrize("interval_s", [0.1, 5.0], ids=["beats-stopped", "beats-too-seldom"])
def test_a_tile_no_beat_renews_renews_on_its_own(ctx: WorkerContext, interval_s: float) -> None:
    """Beats that stop (a carried tile) or come too seldom for the lease (a tile not carried):
    the tile's own renewal keeps its lease."""
    ctx.allocator = SlotAllocator(ctx.conn, ttl_s=1.5)  # renewed every 0.5 s
    _carrying(ctx, interval_s)
    task, lease = _rendering(ctx)
    with _Renewal(ctx, task, lease) as renewal:
        assert renewal.carried == (interval_s <= 0.5)
        time.sleep(3.2)  # past two lease lifetimes without a beat
        assert renewal.lost is None
        assert ctx.allocator.renew(renewal.lease).id == lease.id
    ctx.allocator.release(renewal.lease)


@pytest.mark.parametrize("how", ["own", "carried"])
def test_a_tiles_tag_slots_are_renewed_in_its_renewals_round_trip(
    ctx: WorkerContext, round_trips: Counter[str], how: str
) -> None:
    """A tile of a limited tag holds a slot of it, renewed with its lease: that was a round
    trip of its own after each renewal."""
    carried = _carrying(ctx, interval_s=5.0)
    ctx.tag_limits = {"licence": 1, "other": 2}
    task, lease = _rendering(ctx)
    ctx.conn.zadd(keys.tag_slots("licence"), {task.rq_id: 1.0})  # the pick's slot, near expiry
    with _Renewal(ctx, task, lease) as renewal:
        me = threading.current_thread().name
        before = round_trips[me]
        if how == "own":
            renewal.renew()
        else:
            heartbeat(ctx.allocator, "agent-renewal", "host-renewal", [OFFER], 3600, None,
                      beside=carried.beat_in)  # fmt: skip
        assert round_trips[me] - before == 1
        assert renewal.lost is None
    slot = ctx.conn.zscore(keys.tag_slots("licence"), task.rq_id)
    assert slot is not None and slot > time.time() + 20  # a lease period (30 s) from now
    assert ctx.conn.zscore(keys.tag_slots("other"), task.rq_id) is None  # none held: none made
