"""A hypothesis state machine drives the real allocator scripts in a real redis-server.

Invariants checked after every step: no device is used beyond its capacity in any dimension;
the allocator's counters equal the sum of the live leases; fencing tokens only grow; a released
or expired lease freed exactly its amounts and can no longer be renewed or pass the fence.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from farm.alloc.allocator import DeviceOffer, Lease, Request, SlotAllocator
from farm.errors import LeaseLost, NeverFits
from farm.redisserver import RedisServer

DEVICES = [
    DeviceOffer("gpu-t4", "t4", "Tesla T4", 15360, 8, 2),
    DeviceOffer("gpu-l4", "l4", "NVIDIA L4", 23034, 16, 2),
    DeviceOffer("gpu-a100", "a100", "A100", 81920, 0, 4),
    DeviceOffer("cpu-h1", "cpu", "CPU", 24000, 2, 1),
]
TTL_MS = 1000


@dataclass
class Held:
    lease: Lease
    request: Request
    expires_ms: int


class AllocatorMachine(RuleBasedStateMachine):
    server: RedisServer

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.conn = redis.Redis.from_url(self.server.url)
        self.conn.flushall()
        self.now = 1_000_000
        self.alloc = SlotAllocator(self.conn, ttl_s=TTL_MS / 1000, clock_ms=lambda: self.now)
        self.held: dict[str, Held] = {}
        self.tokens: dict[str, int] = {}

    @initialize()
    def register(self) -> None:
        # the agent lives far beyond the test's clock: only lease expiry is exercised here
        self.alloc.register("agent", "host", DEVICES, ttl_s=3600)

    @rule(
        target=leases,
        kind=st.sampled_from(["render", "stream"]),
        vram=st.sampled_from([0, 512, 4096, 12000, 30000, 90000]),
        enc=st.integers(0, 3),
        slots=st.integers(0, 2),
        classes=st.sampled_from([(), ("t4",), ("l4", "a100"), ("cpu",)]),
        preempt=st.booleans(),
    )
    def acquire(
        self, kind: str, vram: int, enc: int, slots: int, classes: tuple[str, ...], preempt: bool
    ) -> Lease | None:
        request = Request(kind, vram, enc, slots, classes, preempt=preempt and kind == "stream")
        try:
            lease = self.alloc.try_acquire("h", request)
        except NeverFits:
            # truly never: no device of those classes has that much capacity
            assert not any(
                (not classes or d.device_class in classes)
                and d.vram_mib >= vram
                and d.encoder_sessions >= enc
                and d.render_slots >= slots
                for d in DEVICES
            )
            return None
        if lease is None:
            return None
        device = next(d for d in DEVICES if d.id == lease.device)
        assert not classes or device.device_class in classes
        self._drop_revoked_and_expired()
        self.held[lease.id] = Held(lease, request, lease.expires_ms)
        return lease

    @rule(lease=leases)
    def renew(self, lease: Lease | None) -> None:
        if lease is None:
            return
        try:
            renewed = self.alloc.renew(lease)
        except LeaseLost:
            assert lease.id not in self.held or self.held[lease.id].expires_ms < self.now
            self.held.pop(lease.id, None)
            return
        assert lease.id in self.held and self.held[lease.id].expires_ms >= self.now
        self.held[lease.id].expires_ms = renewed.expires_ms

    @rule(lease=consumes(leases))
    def release(self, lease: Lease | None) -> None:
        if lease is None:
            return
        released = self.alloc.release(lease)
        if released:
            # only a lease we hold can be released, and it frees exactly its amounts (invariant)
            assert lease.id in self.held
            self.held.pop(lease.id)
        else:
            # not held: it expired or was revoked, and another call reclaimed it
            self._drop_revoked_and_expired()
            assert lease.id not in self.held
        assert not self.alloc.check(lease)

    @rule(ms=st.sampled_from([10, 400, 900, 1500]))
    def advance(self, ms: int) -> None:
        self.now += ms

    def _drop_revoked_and_expired(self) -> None:
        for lease_id in list(self.held):
            why = self.alloc.why_gone(lease_id)
            if why is not None:
                held = self.held.pop(lease_id)
                if why == "expired":
                    assert held.expires_ms <= self.now
                else:
                    assert why.startswith("revoked: preempted") and held.request.kind == "render"

    @invariant()
    def within_capacity_and_consistent(self) -> None:
        self._drop_revoked_and_expired()
        for d in self.alloc.devices():
            assert 0 <= d.used_vram_mib <= d.vram_mib, d
            assert 0 <= d.used_encoder_sessions <= d.encoder_sessions, d
            assert 0 <= d.used_render_slots <= d.render_slots, d
            # the counters are exactly the sum of the leases still recorded on the device
            assert d.used_vram_mib == sum(int(lease["vram"]) for lease in d.leases)
            assert d.used_encoder_sessions == sum(int(lease["enc"]) for lease in d.leases)
            assert d.used_render_slots == sum(int(lease["slots"]) for lease in d.leases)
            assert d.token >= self.tokens.get(d.id, 0)
            self.tokens[d.id] = d.token
            for lease in d.leases:
                # every lease we think we hold and have not seen end is recorded, and vice versa
                if int(lease["expires"]) >= self.now:
                    assert lease["id"] in self.held

    def teardown(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def machine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("slots-redis"))
    server.start()
    yield server
    server.stop()


def test_allocator_state_machine(machine_server: RedisServer) -> None:
    AllocatorMachine.server = machine_server
    run_state_machine_as_test(
        AllocatorMachine,
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
