"""A GPU agent whose driver stops answering: its beats go on without NVML's reading, so its
devices stay alive and whatever rides its heartbeat (a stream service's renewals, the workers
page) keeps its time; once NVML has been silent for the agent timeout its GPUs are offered as
unavailable (no new lease placed there), and they come back when NVML answers again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from farm import metrics, workerstate
from farm.alloc.agent import DeviceAgent
from farm.alloc.allocator import Request, SlotAllocator
from farm.gpu.fake import FakeNvml
from farm.settings import Settings

#: how long a beat waits for NVML here
WAIT_S = 0.2
TIMEOUT_S = 1.0
RENDER = Request("render", vram_mib=1000, render_slots=1)
STREAM = Request("stream", vram_mib=500, encoder_sessions=1)


@pytest.fixture
def stalled(redis_url: str) -> Iterator[tuple[FakeNvml, DeviceAgent]]:
    nvml = FakeNvml(["t4"])
    nvml.set_usage(0, utilization_pct=41)
    alloc = SlotAllocator(redis.Redis.from_url(redis_url, decode_responses=True), ttl_s=30)
    settings = Settings(nvml="fake:t4", agent_timeout_s=TIMEOUT_S)
    agent = DeviceAgent(settings, alloc, "agent-hung", nvml=nvml, nvml_wait_s=WAIT_S)
    # its process's entry on the workers page, with the agent's gauges, as a worker wires it
    registry = workerstate.registry_for(alloc.conn, settings)
    beacon = workerstate.Beacon(registry, agent.name, {"kind": "render"}, agent.gauges)
    agent.beside = beacon.beat_in
    agent.beat()
    assert _shown_utilization(agent) == 41
    nvml.stall()
    yield nvml, agent
    nvml.answer()  # the reading left waiting returns
    for reader in _readers():
        reader.join(5)


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nvml-read"]


def _shown_utilization(agent: DeviceAgent) -> int | None:
    """The utilisation the workers page shows for the agent's process."""
    listed = workerstate.registry_for(agent.allocator.conn, agent.settings).get(agent.name)
    assert listed is not None
    return listed.utilization_pct


def _scraped_utilization(agent: DeviceAgent) -> float | None:
    """What Prometheus would scrape of the agent's GPU's utilisation (None: no sample)."""
    device = agent.devices[0]
    return metrics.REGISTRY.get_sample_value("tessera_gpu_utilization_percent", {
        "device": device.id, "device_class": device.device_class, "host": device.host})  # fmt: skip


def _beat(agent: DeviceAgent) -> None:
    """``agent.beat()``, failing (not hanging) where it waits on NVML past its wait."""
    beat = threading.Thread(target=agent.beat, daemon=True)
    beat.start()
    beat.join(WAIT_S + 0.5)
    assert not beat.is_alive(), "the beat is held by NVML"


def test_a_beat_waits_for_a_hung_nvml_no_longer_than_its_wait(
    stalled: tuple[FakeNvml, DeviceAgent],
) -> None:
    _, agent = stalled
    alloc = agent.allocator
    for _ in range(3):
        _beat(agent)
    # one reading in flight, not one more a beat on a driver that does not answer
    assert len(_readers()) == 1
    # nothing stale reported: not on the workers page, not to Prometheus
    assert _shown_utilization(agent) is None
    assert _scraped_utilization(agent) is None
    (device,) = alloc.devices([agent.devices[0].id])
    assert device.alive and device.available  # silent for less than the agent timeout
    lease = alloc.acquire("w1", RENDER)
    alloc.release(lease)


def test_gpus_silent_for_the_agent_timeout_are_unavailable_until_nvml_answers(
    stalled: tuple[FakeNvml, DeviceAgent],
) -> None:
    nvml, agent = stalled
    alloc = agent.allocator
    held = alloc.acquire("s1", STREAM)
    _beat(agent)
    time.sleep(TIMEOUT_S)
    _beat(agent)
    (device,) = alloc.devices([agent.devices[0].id])
    assert device.alive and not device.available
    assert "NVML has not answered" in device.unavailable_reason
    assert alloc.try_acquire("w2", RENDER) is None  # nothing new placed there
    assert alloc.renew(held).id == held.id  # what already runs there keeps its lease

    nvml.answer()
    agent.beat()
    (device,) = alloc.devices([agent.devices[0].id])
    assert device.available and device.unavailable_reason == ""
    assert _shown_utilization(agent) == 41
    assert _scraped_utilization(agent) == 41
    granted = alloc.try_acquire("w2", RENDER)
    assert granted is not None
    alloc.release(granted)
    alloc.release(held)
