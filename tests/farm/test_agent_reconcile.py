"""A GPU agent's beat in one round trip: the registration works out the memory no lease
explains from NVML's reading, against the device's leases at that instant, and returns those
leases for the agent's drift log. The agent read them in a round trip of its own before."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import redis

from farm.alloc.agent import DeviceAgent
from farm.alloc.allocator import Request, SlotAllocator
from farm.alloc.reconcile import DriftKind, Tolerance
from farm.gpu.fake import FakeNvml
from farm.settings import Settings

LEASED_MIB = 4000
#: what the tolerance lets 4000 leased MiB use without drift: 4000 + 512 + 10 %
ALLOWED_MIB = 4912
RENDER = Request("render", vram_mib=LEASED_MIB, render_slots=1)


@pytest.fixture
def gpu(redis_url: str) -> tuple[FakeNvml, DeviceAgent]:
    nvml = FakeNvml(["t4"])
    nvml.set_usage(0, memory_used_mib=300)  # the driver's own
    alloc = SlotAllocator(redis.Redis.from_url(redis_url, decode_responses=True), ttl_s=30)
    agent = DeviceAgent(Settings(nvml="fake:t4"), alloc, "agent-t4", nvml=nvml)
    agent.beat()  # registered (the first call on a fresh server also loads the functions)
    return nvml, agent


def _held_back(agent: DeviceAgent) -> int:
    (device,) = agent.allocator.devices([agent.devices[0].id])
    return device.unexplained_vram_mib


def test_the_rule_is_the_tolerances() -> None:
    assert Tolerance().allowed_vram_mib(LEASED_MIB) == ALLOWED_MIB


def test_a_gpu_agents_beat_is_one_round_trip_and_holds_back_what_no_lease_explains(
    gpu: tuple[FakeNvml, DeviceAgent], round_trips: Counter[str]
) -> None:
    nvml, agent = gpu
    lease = agent.allocator.acquire("w", RENDER)
    nvml.set_usage(0, memory_used_mib=ALLOWED_MIB)
    me = threading.current_thread().name
    before = round_trips[me]
    agent.beat()
    assert round_trips[me] - before == 1
    assert _held_back(agent) == 0 and agent.drifts == []  # within the tolerance

    nvml.set_usage(0, memory_used_mib=ALLOWED_MIB + 1)
    agent.beat()
    assert _held_back(agent) == ALLOWED_MIB + 1 - LEASED_MIB
    (drift,) = agent.drifts  # logged against the leases the registration saw
    assert (drift.kind, drift.expected, drift.observed) == (
        DriftKind.MEMORY, LEASED_MIB, ALLOWED_MIB + 1)  # fmt: skip

    agent.allocator.release(lease)  # the memory stays in use: nothing explains it now
    agent.beat()
    assert _held_back(agent) == ALLOWED_MIB + 1
    nvml.set_usage(0, memory_used_mib=300)
    agent.beat()
    assert _held_back(agent) == 0 and agent.drifts == []


def test_a_lease_that_expired_explains_nothing(gpu: tuple[FakeNvml, DeviceAgent]) -> None:
    """What expired is reclaimed before the registration compares (as the agent's own read of
    the leases did): a dead holder's lease does not hide the memory in use."""
    nvml, agent = gpu
    short = SlotAllocator(agent.allocator.conn, ttl_s=0.2)
    short.acquire("dead", RENDER)
    nvml.set_usage(0, memory_used_mib=LEASED_MIB)
    time.sleep(0.4)
    agent.beat()
    assert _held_back(agent) == LEASED_MIB
    (device,) = agent.allocator.devices([agent.devices[0].id])
    assert device.used_vram_mib == 0 and device.leases == []
