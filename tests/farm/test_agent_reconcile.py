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
from farm.errors import NoCapacity
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


STREAM = Request("stream", encoder_sessions=1)


def _foreign_sessions(agent: DeviceAgent) -> int:
    (device,) = agent.allocator.devices([agent.devices[0].id])
    return device.unexplained_encoder_sessions


def test_encoder_sessions_no_lease_explains_are_held_back(
    gpu: tuple[FakeNvml, DeviceAgent],
) -> None:
    """Sessions another program opened on the GPU's encoder (a screen recorder, a leaked
    session) leave fewer for streams: the allocator grants only what is left."""
    nvml, agent = gpu
    sessions = agent.devices[0].encoder_sessions  # 8 on a T4
    nvml.set_usage(0, encoder_sessions=sessions - 1)
    agent.beat()
    assert _foreign_sessions(agent) == sessions - 1
    ours = agent.allocator.acquire("s1", STREAM)
    assert agent.allocator.try_acquire("s2", STREAM) is None  # the encoder is full

    nvml.set_usage(0, encoder_sessions=sessions)  # ours opened: explained by its lease
    agent.beat()
    assert _foreign_sessions(agent) == sessions - 1
    assert agent.drifts[0].kind is DriftKind.ENCODER

    nvml.set_usage(0, encoder_sessions=1)  # the other program closed its sessions
    agent.beat()
    assert _foreign_sessions(agent) == 0 and agent.drifts == []
    assert agent.allocator.try_acquire("s2", STREAM) is not None
    agent.allocator.release(ours)


def test_foreign_encoder_sessions_count_on_the_hosts_budget(redis_url: str) -> None:
    """A consumer driver caps encoder sessions per system, whoever opened them: sessions no
    lease explains on one GPU leave fewer for the host's other GPUs, until the GPU's agent
    is gone."""
    nvml = FakeNvml(["2xl4"])
    alloc = SlotAllocator(redis.Redis.from_url(redis_url, decode_responses=True), ttl_s=30)
    agent = DeviceAgent(Settings(nvml="fake:2xl4", host_encoder_budget=3, agent_timeout_s=1),
                        alloc, "agent-consumer", nvml=nvml)  # fmt: skip
    agent.beat()
    nvml.set_usage(0, encoder_sessions=2)
    agent.beat()
    second = agent.devices[1].id
    granted = alloc.acquire("s1", Request("stream", encoder_sessions=1, device_ids=(second,)))
    assert alloc.try_acquire("s2", Request("stream", encoder_sessions=1)) is None

    alloc.release(granted)
    time.sleep(1.2)  # the agent silent past its timeout: its devices are reaped
    with pytest.raises(NoCapacity):  # no live device: nothing to grant, nothing counted
        alloc.acquire("s3", STREAM)
    nvml.set_usage(0, encoder_sessions=0)
    agent.beat()
    for name in ("s4", "s5", "s6"):  # the whole budget again
        assert alloc.try_acquire(name, STREAM) is not None
