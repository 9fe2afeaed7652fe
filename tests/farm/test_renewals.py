"""A process's leases renewed together (a stream service's sessions): ``renew_many`` answers each
lease as ``renew`` would, in one call, and ``Renewals`` sends what its holders ask at one tick
in one round trip, against a real redis-server on a clock the test drives."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from farm.alloc.allocator import DeviceOffer, Lease, Request, SlotAllocator
from farm.alloc.renewals import Renewals
from farm.errors import LeaseLost, QueueError

DEVICE = DeviceOffer("gpu-renew", "l4", "NVIDIA L4", 24_000, 16, 1)
STREAM = Request("stream", vram_mib=100, encoder_sessions=1, device_ids=(DEVICE.id,))
TTL_S = 15.0


@pytest.fixture
def clock() -> list[int]:
    return [1_000_000]


@pytest.fixture
def allocator(redis_url: str, clock: list[int]) -> SlotAllocator:
    allocator = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=TTL_S,
                              clock_ms=lambda: clock[0])  # fmt: skip
    allocator.register("agent-renew", "host-renew", [DEVICE], ttl_s=3600)
    return allocator


def test_renew_many_answers_each_lease_as_renew_does(
    allocator: SlotAllocator, clock: list[int]
) -> None:
    held, released, stale, late = (allocator.acquire(f"s{i}", STREAM) for i in range(4))
    allocator.release(released)
    forged = Lease(stale.id, stale.holder, stale.kind, stale.device, stale.token + 1,
                   stale.expires_ms)  # fmt: skip
    # ``late`` alone lapses: the others are renewed first, on their own
    clock[0] += 10_000
    held, stale = allocator.renew(held), allocator.renew(stale)
    clock[0] += 6_000
    out = allocator.renew_many([held, released, forged, late, stale])

    assert isinstance(out[0], Lease) and out[0].expires_ms == clock[0] + int(TTL_S * 1000)
    assert out[4] == Lease(stale.id, stale.holder, stale.kind, stale.device, stale.token,
                           clock[0] + int(TTL_S * 1000))  # fmt: skip
    assert [o.fields["why"] for o in out[1:4] if isinstance(o, LeaseLost)] == [
        "unknown lease", "unknown lease", "expired",
    ]  # fmt: skip
    # the lapsed lease ended in the call: its encoder session is free again
    (device,) = allocator.devices()
    assert device.used_encoder_sessions == 2
    assert allocator.renew_many([]) == []


def test_a_services_sessions_renew_in_one_call_a_tick(
    allocator: SlotAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    leases = [allocator.acquire(f"session-{i}", STREAM) for i in range(6)]
    allocator.release(leases[2])
    calls: list[int] = []
    renew_many = allocator.renew_many

    def counted(asked: list[Lease]) -> list[Lease | LeaseLost]:
        calls.append(len(asked))
        return renew_many(asked)

    monkeypatch.setattr(allocator, "renew_many", counted)

    async def run() -> list[Lease | BaseException]:
        renewals = Renewals(allocator)
        renewals.every_s = 0.2

        async def session(lease: Lease) -> Lease:
            await renewals.next_tick()
            return await renewals.renew(lease)

        first = await asyncio.gather(*map(session, leases), return_exceptions=True)
        # a holder alone at a later tick is a call of its own
        assert isinstance(first[0], Lease)
        return [*first, await session(first[0])]

    out = asyncio.run(run())
    assert calls == [6, 1]
    assert isinstance(out[2], LeaseLost) and out[2].fields["why"] == "unknown lease"
    assert all(isinstance(o, Lease) for i, o in enumerate(out) if i != 2)


def test_redis_away_fails_every_renewal_of_the_call(redis_url: str) -> None:
    allocator = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=TTL_S)
    allocator.register("agent-away", "host-away", [DEVICE], ttl_s=3600)
    leases = [allocator.acquire(f"s{i}", STREAM) for i in range(3)]
    # nothing listens there, and the client gives up at once (no retries)
    away = redis.Redis(unix_socket_path="/nonexistent", retry=Retry(NoBackoff(), 0))
    allocator.conn = allocator._renew_many.conn = away

    async def run() -> list[Lease | BaseException]:
        renewals = Renewals(allocator)
        return await asyncio.gather(*map(renewals.renew, leases), return_exceptions=True)

    out = asyncio.run(run())
    assert all(isinstance(o, QueueError) for o in out), out


def test_a_carrier_takes_each_ticks_renewals_and_a_beat_makes_the_call(
    allocator: SlotAllocator, clock: list[int]
) -> None:
    """A stream service's device agent carries its sessions' renewals in its heartbeat: each
    tick is one call with the leases asked at it, made even when none is (the beat), and a
    call that fails fails every waiter of it."""
    leases = [allocator.acquire(f"session-{i}", STREAM) for i in range(2)]
    carried: list[list[str]] = []
    failing = [False]

    def carrier(asked: Sequence[Lease]) -> list[Lease | LeaseLost]:
        carried.append([lease.holder for lease in asked])
        if failing[0]:
            raise QueueError("Redis went away")
        return allocator.renew_many(asked)

    async def run() -> tuple[list[Lease | None], list[BaseException | None]]:
        renewals = Renewals(allocator, every_s=0.2, carrier=carrier)

        async def tick(*asked: Lease) -> list[Any]:
            await renewals.next_tick()
            asks = [renewals.renew(lease) for lease in asked]
            return await asyncio.gather(renewals.beat(), *asks, return_exceptions=True)

        clock[0] += 1_000
        renewed = await tick(*leases)
        alone = await tick()
        failing[0] = True
        failed = await tick(leases[0])
        return [*renewed, *alone], failed

    answered, failed = asyncio.run(run())
    assert carried == [["session-0", "session-1"], [], ["session-0"]]
    assert answered[0] is None and answered[3] is None  # the beats
    expires = clock[0] + int(TTL_S * 1000)
    assert [lease.expires_ms for lease in answered[1:3] if lease] == [expires, expires]
    assert all(isinstance(e, QueueError) for e in failed), failed


def test_a_waiter_gone_before_the_call_asks_for_nothing(allocator: SlotAllocator) -> None:
    """A stream service stopping cancels its beat: a call made after that would register the
    service again once it has unregistered."""
    carried: list[list[Lease]] = []

    def carrier(asked: Sequence[Lease]) -> list[Lease | LeaseLost]:
        carried.append(list(asked))
        return allocator.renew_many(asked)

    async def run() -> None:
        renewals = Renewals(allocator, every_s=0.2, carrier=carrier)
        beat = asyncio.ensure_future(renewals.beat())
        await asyncio.sleep(0)  # it asked: the call goes at the loop's next turn
        beat.cancel()
        await asyncio.sleep(0.05)
        await renewals.drain()

    asyncio.run(run())
    assert carried == []
