"""A lease past its expiry with no grant to reclaim it: the allocator's view, `farm gpus` and the
farm's metrics count only leases still held (issue #14 item 5), and the device's next heartbeat
reclaims it and records its usage."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import redis

from farm import keys, metrics
from farm.alloc import scripts
from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator
from farm.settings import Settings
from tests.conftest import REPO
from tests.farmprocs import until

#: one CPU device with room for every lease of the test (one render slot and 10 MiB each)
DEVICE = DeviceOffer("cpu-expiry", "cpu", "test CPU", 64 * 1024, 0, 1024)
_REAP = re.search(r"local REAP = (\d+)", scripts.PRELUDE)
assert _REAP is not None
#: expired leases one allocator call reclaims at most (the scripts' bound)
REAP = int(_REAP[1])
#: more leases than three reads reclaim: every view's first read after the expiry still finds
#: some unreclaimed
HELD = 3 * REAP + 1


def _views(redis_url: str, allocator: SlotAllocator) -> dict[str, tuple[int, int, int]]:
    """(leases, render slots used, MiB used) of the device in the allocator's view, in
    `farm gpus --json` run as a user runs it, and in the farm collector's gauges."""
    (device,) = allocator.devices()
    out = {"devices()": (len(device.leases), device.used_render_slots, device.used_vram_mib)}
    proc = subprocess.run(
        [sys.executable, "-m", "farm", "gpus", "--json"], cwd=REPO, capture_output=True,
        text=True, timeout=120, env={**os.environ, "FARM_REDIS_URL": redis_url}, check=True,
    )  # fmt: skip
    (shown,) = json.loads(proc.stdout)
    out["farm gpus"] = (len(shown["leases"]), shown["used_render_slots"], shown["used_vram_mib"])
    gauges: dict[str, float] = {}
    for family in metrics.FarmCollector(Settings(redis_url=redis_url)).collect():
        for sample in family.samples:
            if sample.labels.get("device") == DEVICE.id and sample.labels.get("kind") != "stream":
                gauges[sample.name] = sample.value
    out["metrics"] = (
        int(gauges["tessera_device_leases"]),
        int(gauges["tessera_device_render_slots_used"]),
        int(gauges["tessera_device_vram_used_bytes"]) // 2**20,
    )
    return out


def test_a_vanished_holders_expired_leases_leave_every_view_without_a_grant(
    redis_url: str, rconn: redis.Redis
) -> None:
    conn = redis.Redis.from_url(redis_url)
    allocator = SlotAllocator(conn, ttl_s=60)
    allocator.register("agent-expiry", "host-expiry", [DEVICE], ttl_s=3600)
    request = Request("render", vram_mib=10, render_slots=1, device_ids=(DEVICE.id,))
    leases = [allocator.acquire(f"worker-{i}", request) for i in range(HELD)]
    assert set(_views(redis_url, allocator).values()) == {(HELD, HELD, HELD * 10)}
    # each holder's last renewal leaves its lease 3 s; then the holders vanish, never to renew
    last = SlotAllocator(conn, ttl_s=3)
    expires_ms = max(last.renew(lease).expires_ms for lease in leases)

    def redis_ms() -> int:
        seconds, micros = rconn.time()
        return int(seconds) * 1000 + int(micros) // 1000

    until(lambda: redis_ms() > expires_ms, 30, "the leases' expiry passing on Redis's clock")
    # nobody acquires: the reads alone must stop counting what is no longer held
    assert _views(redis_url, allocator) == dict.fromkeys(
        ("devices()", "farm gpus", "metrics"), (0, 0, 0)
    )
    conn.close()


def test_a_dead_holders_lease_is_reclaimed_by_the_next_heartbeat(
    redis_url: str, rconn: redis.Redis
) -> None:
    """A holder that dies after the farm's last grant: nobody acquires and nobody reads, but
    the device's agent beats, and its beat reclaims the lease and records its usage."""
    conn = redis.Redis.from_url(redis_url)
    allocator = SlotAllocator(conn, ttl_s=60)
    allocator.register("agent-beat", "host-beat", [DEVICE], ttl_s=3600)
    request = Request("render", vram_mib=10, render_slots=1, device_ids=(DEVICE.id,))
    lease = SlotAllocator(conn, ttl_s=1).acquire("worker-dead", request)  # never renewed

    def redis_ms() -> int:
        seconds, micros = rconn.time()
        return int(seconds) * 1000 + int(micros) // 1000

    until(lambda: redis_ms() > lease.expires_ms, 30, "the lease's expiry passing")
    assert rconn.zscore(keys.LEASE_EXPIRY, lease.id) is not None  # (nothing reclaimed it yet)
    allocator.register("agent-beat", "host-beat", [DEVICE], ttl_s=3600)
    assert rconn.zscore(keys.LEASE_EXPIRY, lease.id) is None
    assert not rconn.exists(keys.lease(lease.id))
    assert rconn.hget(keys.device(DEVICE.id), "used_slots") == "0"
    recorded = [fields or {} for _id, fields in rconn.xrange(keys.usage("unassigned")) or []]
    assert [(f["lease"], f["why"]) for f in recorded] == [(lease.id, "expired")]
    conn.close()
