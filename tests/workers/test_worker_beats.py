"""A render worker's two beats, its device agent's heartbeat (the device alive in the pool) and
its entry on the workers page, go to Redis in one round trip; a write Redis refuses in one of
them leaves the other written, and only the heartbeat's refusal reaches the agent's loop."""

from __future__ import annotations

import logging
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from farm import jobstore, keys, workerstate
from farm.alloc.agent import DeviceAgent
from farm.alloc.allocator import SlotAllocator
from farm.errors import FarmError
from farm.redisclient import Redis
from farm.settings import Settings

NAME = "beating"


@pytest.fixture
def conn(redis_url: str) -> Redis:
    return jobstore.connect(redis_url)


def _worker(conn: Redis, redis_url: str, tmp_path: Path) -> tuple[DeviceAgent, Settings]:
    """A CPU render worker's agent with its beacon beside it, as ``workers.worker`` wires them."""
    settings = Settings(redis_url=redis_url, work_dir=tmp_path / "work", python=sys.executable,
                        device="cpu")  # fmt: skip
    agent = DeviceAgent(settings, SlotAllocator(conn), NAME, nvml=None,
                        select=lambda d: d.index is None)  # fmt: skip
    beacon = workerstate.Beacon(
        workerstate.registry_for(conn, settings),
        NAME,
        {"kind": "render", "queue": "cpu"},
        gauges=lambda: {"utilization_pct": 42},
    )
    agent.beside = beacon.beat_in
    return agent, settings


def _sent(round_trips: Counter[str]) -> int:
    return round_trips[threading.current_thread().name]


def test_the_agents_heartbeat_and_the_workers_page_beat_are_one_round_trip(
    conn: Redis, redis_url: str, tmp_path: Path, round_trips: Counter[str]
) -> None:
    agent, settings = _worker(conn, redis_url, tmp_path)
    agent.beat()  # the first beat on a fresh server also loads the two functions
    conn.delete(keys.worker(NAME))
    before = _sent(round_trips)
    agent.beat()
    assert _sent(round_trips) - before == 1
    (device,) = agent.allocator.devices([agent.devices[0].id])
    assert device.alive and device.agent == NAME
    (row,) = workerstate.registry_for(conn, settings).list()
    assert (row.name, row.kind, row.queue, row.utilization_pct) == (NAME, "render", "cpu", 42)


def test_a_refused_page_beat_is_logged_and_the_device_stays_alive(
    conn: Redis, redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent, _ = _worker(conn, redis_url, tmp_path)
    conn.set(keys.worker(NAME), "not a hash")  # the page's HSET is refused (WRONGTYPE)
    with caplog.at_level(logging.WARNING, "tessera.workerstate"):
        agent.beat()
    assert "event=beacon_failed" in caplog.text
    (device,) = agent.allocator.devices([agent.devices[0].id])
    assert device.alive


def test_a_refused_heartbeat_raises_to_the_agents_loop_and_the_page_beat_lands(
    conn: Redis, redis_url: str, tmp_path: Path
) -> None:
    agent, settings = _worker(conn, redis_url, tmp_path)
    conn.set(keys.DEVICES, "not a set")  # the registration's SADD is refused (WRONGTYPE)
    with pytest.raises(FarmError):
        agent.beat()
    (row,) = workerstate.registry_for(conn, settings).list()
    assert row.name == NAME
