"""The allocator's cost does not grow with the farm: Redis commands per call, counted by Redis.

Each case runs the same calls against a small pool and a pool fifty times larger and compares
the commands Redis executed for them (``INFO commandstats``, which counts the commands a Lua
script issues). A scan of the devices would multiply them by fifty.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator

CLASSES = (("t4", "Tesla T4", 15360, 8), ("l4", "NVIDIA L4", 23034, 16), ("a100", "A100", 81920, 0))


class Clock:
    def __init__(self) -> None:
        self.ms = 7_000_000

    def __call__(self) -> int:
        return self.ms


def _pool(conn: redis.Redis, clock: Clock, devices: int) -> SlotAllocator:
    conn.flushall()
    alloc = SlotAllocator(conn, ttl_s=10, clock_ms=clock)
    for host in range(devices // 8):
        offers = []
        for i in range(8):
            name, model, vram, enc = CLASSES[(host + i) % len(CLASSES)]
            offers.append(DeviceOffer(f"gpu-{host}-{i}", name, model, vram, enc, 2))
        alloc.register(f"agent-{host}", f"host-{host}", offers, ttl_s=3600)
    return alloc


def _commands(conn: redis.Redis, calls: Callable[[], object]) -> int:
    """Commands Redis executed for ``calls`` (the INFO reads themselves left out)."""

    def total() -> int:
        stats = conn.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")

    before = total()
    calls()
    return total() - before


@pytest.mark.parametrize(
    "request_",
    [
        Request("render", vram_mib=4096, render_slots=1, device_ids=("gpu-0-1",)),
        Request("stream", vram_mib=1536, encoder_sessions=1),
        Request("stream", vram_mib=1536, encoder_sessions=1, classes=("l4",)),
        Request("render", vram_mib=4096, render_slots=1),
    ],
    ids=["pinned-render", "any-stream", "class-stream", "any-render"],
)
def test_acquire_renew_release_cost_the_same_on_8_and_400_devices(
    rconn: redis.Redis, request_: Request
) -> None:
    clock = Clock()
    counts = []
    for devices in (8, 400):
        alloc = _pool(rconn, clock, devices)
        # a busy farm: half the devices hold a render (the lease under test skips them or not)
        for d in range(0, devices, 2):
            alloc.acquire(
                "busy", Request("render", render_slots=1, device_ids=(f"gpu-{d // 8}-{d % 8}",))
            )

        def cycle(alloc: SlotAllocator = alloc) -> None:
            lease = alloc.acquire("h", request_)
            lease = alloc.renew(lease)
            assert alloc.release(lease)

        counts.append(_commands(rconn, cycle))
    assert counts[1] <= counts[0] + 2, f"commands on 8 vs 400 devices: {counts}"


def test_expired_leases_and_silent_devices_are_reclaimed_in_proportion_to_them(
    rconn: redis.Redis,
) -> None:
    clock = Clock()
    alloc = _pool(rconn, clock, 400)
    alloc.register("short", "host-x", [DeviceOffer("gpu-x", "t4", "Tesla T4", 15360, 8, 2)], 1)
    held = alloc.acquire("r", Request("render", render_slots=1, device_ids=("gpu-x",)))
    brief = SlotAllocator(rconn, ttl_s=1, clock_ms=clock)
    expiring = brief.acquire("r", Request("render", render_slots=1, device_ids=("gpu-1-1",)))
    clock.ms += 2_000  # past the brief lease's TTL and the short agent's timeout
    probe = Request("render", render_slots=1, device_ids=("gpu-2-2",))
    cost = _commands(rconn, lambda: alloc.release(alloc.acquire("p", probe)))
    assert alloc.why_gone(held.id) == "revoked: the device's agent stopped answering"
    assert alloc.why_gone(expiring.id) == "expired"
    quiet = _commands(rconn, lambda: alloc.release(alloc.acquire("p", probe)))
    # two leases ended (usage records, counters, indexes), nothing read per device
    assert cost - quiet <= 40, (cost, quiet)
    assert "gpu-x" not in {d.id for d in alloc.devices() if d.alive}


def test_a_heartbeat_that_changes_nothing_only_moves_the_deadlines(rconn: redis.Redis) -> None:
    clock = Clock()
    alloc = _pool(rconn, clock, 8)
    offers = [DeviceOffer(f"gpu-0-{i}", "t4", "Tesla T4", 15360, 8, 2) for i in range(8)]
    alloc.register("agent-0", "host-0", offers, ttl_s=3600)
    clock.ms += 5_000
    beat = _commands(rconn, lambda: alloc.register("agent-0", "host-0", offers, ttl_s=3600))
    assert beat <= 3 * len(offers) + 6, beat
    # a change (memory no lease explains) still reaches the placement indexes at once
    busy = [DeviceOffer(o.id, "t4", "Tesla T4", 15360, 8, 2, unexplained_vram_mib=15000)
            for o in offers]  # fmt: skip
    alloc.register("agent-0", "host-0", busy, ttl_s=3600)
    assert alloc.try_acquire("s", Request("stream", vram_mib=1000, encoder_sessions=1)) is None


def test_a_device_whose_agent_comes_back_is_placed_again(rconn: redis.Redis) -> None:
    clock = Clock()
    rconn.flushall()
    alloc = SlotAllocator(rconn, ttl_s=10, clock_ms=clock)
    t4 = [DeviceOffer("gpu-back", "t4", "Tesla T4", 15360, 8, 2)]
    alloc.register("agent", "host", t4, ttl_s=1)
    clock.ms += 2_000  # silent past its timeout: the next call takes it out of the pool
    assert alloc.try_acquire("s", Request("stream", encoder_sessions=1)) is None
    alloc.register("agent", "host", t4, ttl_s=1)  # the same offer, beating again
    lease = alloc.try_acquire("s", Request("stream", encoder_sessions=1))
    assert lease is not None and lease.device == "gpu-back"


STREAM = Request("stream", encoder_sessions=1, vram_mib=1000)


def test_consumer_hosts_with_their_encoder_budget_spent_are_not_walked_past(
    rconn: redis.Redis,
) -> None:
    clock = Clock()
    counts = []
    for hosts in (1, 50):
        rconn.flushall()
        alloc = SlotAllocator(rconn, ttl_s=10, clock_ms=clock)
        for h in range(hosts):
            rtx = [DeviceOffer(f"rtx-{h}-{i}", "rtx4090", "RTX 4090", 24564, 16, 2)
                   for i in range(8)]  # fmt: skip
            alloc.register(f"a-{h}", f"gamer-{h}", rtx, ttl_s=3600, host_encoder_budget=1)
            alloc.acquire("s", Request("stream", encoder_sessions=1, device_ids=(f"rtx-{h}-0",)))
        # named to sort after them: among equal scores the walk goes by name
        alloc.register("dc", "dc-host", [DeviceOffer("z-l4", "l4", "L4", 23034, 16, 2)], 3600)
        lease = alloc.acquire("s", STREAM)
        assert lease.device == "z-l4"  # every consumer host is at its budget
        alloc.release(lease)

        def cycle(a: SlotAllocator = alloc) -> None:
            a.release(a.acquire("s", STREAM))

        counts.append(_commands(rconn, cycle))
    assert counts[1] <= counts[0] + 2, f"commands with 8 vs 400 capped consumer GPUs: {counts}"
