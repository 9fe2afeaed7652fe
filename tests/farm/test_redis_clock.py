"""One clock for the farm's deadlines: the Redis server's (farm.redisclock).

A host's clock may be wrong by seconds or minutes (no NTP, a VM resumed from a snapshot). Each
test gives one side a clock 60 s behind and checks that the other side, with the right time,
agrees with it: a tile a worker behind renders is not taken back from it by the sweep, and a
sweeper behind takes back a dead worker's tile; a tag slot renewed by a host behind still
counts, and a host behind counts no expired one; a beat from a host behind is not silent, and a
host behind sees a silent worker silent. With the hosts' own clocks each of them fails."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest
import redis

from farm import jobstore, keys, queue, redisclient, redisclock, tagslots, workerstate
from farm.accounts import Accounts
from farm.jobstore import JobStore
from farm.models import BlendSource, JobSpec, TileTask
from farm.redisclient import Redis
from farm.settings import Settings
from farm.states import TileState
from farm.submission import submit
from tests.clocks import host_clock, off_by, process_clock
from web import streams

#: how far behind the wrong host's clock runs: past every lease of these tests
BEHIND_S = 60.0
LEASE_S = 5.0


_behind = off_by(-BEHIND_S)


def host_behind(monkeypatch: pytest.MonkeyPatch) -> contextlib.AbstractContextManager[None]:
    """Inside, this process's clock runs BEHIND_S behind: what a host with that clock does."""
    return process_clock(monkeypatch, _behind)


def _server_time(conn: redis.Redis) -> float:
    seconds, micros = conn.time()
    return seconds + micros / 1e6


@pytest.fixture
def conn(redis_url: str) -> Iterator[Redis]:
    """A client of a host with the right time."""
    client = jobstore.connect(redis_url)
    yield client
    client.close()


@pytest.fixture
def behind(redis_url: str) -> Iterator[Redis]:
    """A client of a host whose clock runs BEHIND_S behind: its own pool, so its own clock."""
    client = jobstore.connect(redis_url)
    host_clock(client, _behind)
    yield client
    client.close()


def test_the_clock_reads_the_servers_time_however_wrong_the_hosts(conn: Redis) -> None:
    clock = redisclock.RedisClock(conn, local=lambda: time.time() - 3600)
    assert abs(clock() - _server_time(conn)) < 0.05
    # read without a round trip until the next refresh
    assert clock.offset_s == pytest.approx(3600, abs=0.05)


def test_one_clock_per_connection_pool_and_the_job_store_uses_it(
    conn: Redis, behind: Redis
) -> None:
    assert redisclock.clock_for(conn) is redisclock.clock_for(conn)
    assert redisclock.clock_for(conn) is not redisclock.clock_for(behind)
    assert JobStore(conn).clock is redisclock.clock_for(conn)


def _job(redis_url: str, store: JobStore) -> str:
    render_queue = queue.RenderQueue(queue.connect(redis_url), "cpu")
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    spec = JobSpec(source, (1,), "1x1", 64, 32, "/tmp/out", max_attempts=3)
    return submit(render_queue.conn, store, render_queue, spec, [], scripts_blocked=False)


def test_a_worker_whose_clock_runs_behind_keeps_the_tile_it_renders(
    redis_url: str, conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweeper = JobStore(conn, tile_lease_s=LEASE_S)
    task = TileTask(_job(redis_url, sweeper), 1, 0, 1)
    with host_behind(monkeypatch):
        worker = JobStore(behind, tile_lease_s=LEASE_S)
        assert worker.start_tile(task) == "ok"
        assert worker.touch_tile(task)
    found = sweeper.sweep("sweeper", LEASE_S)
    assert found.leader
    assert found.tiles == [], "the sweep took the tile back from its worker"
    assert sweeper.tile_states(task.job_id) == {task.key: TileState.RENDERING}


def test_a_sweeper_whose_clock_runs_behind_takes_back_a_dead_workers_tile(
    redis_url: str, conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = JobStore(conn, tile_lease_s=-1)  # its lease over at once: it never renews
    task = TileTask(_job(redis_url, worker), 1, 0, 1)
    assert worker.start_tile(task) == "ok"
    with host_behind(monkeypatch):
        found = JobStore(behind, tile_lease_s=LEASE_S).sweep("sweeper", LEASE_S)
    assert found.leader
    assert found.tiles == [TileTask(task.job_id, 1, 0, 2)], "the dead worker's tile waits on"


def test_a_tag_slot_renewed_by_a_host_behind_still_counts(
    conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the pick takes a slot until Redis's time plus the lease (farm.queue's Lua)
    conn.zadd(keys.tag_slots("licence"), {"tile-1": _server_time(conn) + LEASE_S})
    with host_behind(monkeypatch):
        pipe = behind.pipeline(transaction=False)  # a tile's renewal's round trip
        assert tagslots.renew_in(pipe, behind, ["licence"], "tile-1", LEASE_S) == 1
        pipe.execute()
    assert tagslots.running(conn, "licence") == 1


def test_a_host_behind_counts_no_expired_tag_slot(
    conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn.zadd(keys.tag_slots("licence"), {"tile-1": _server_time(conn) - 1})
    with host_behind(monkeypatch):
        assert tagslots.running(behind, "licence") == 0


def test_a_beat_from_a_host_behind_is_not_silent(
    conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings()
    with host_behind(monkeypatch):
        workerstate.registry_for(behind, settings).beat("w-behind", {"kind": "render"})
    (seen,) = workerstate.registry_for(conn, settings).list(["w-behind"])
    assert seen.state != workerstate.WorkerState.SILENT
    assert abs(seen.last_beat - _server_time(conn)) < 5


def test_a_host_behind_sees_a_silent_worker_silent(
    conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings()
    last = _server_time(conn) - settings.worker_silent_s - 10
    workerstate.registry_for(conn, settings).beat("w-quiet", {"kind": "render"}, now=last)
    with host_behind(monkeypatch):
        (seen,) = workerstate.registry_for(behind, settings).list(["w-quiet"])
    assert seen.state == workerstate.WorkerState.SILENT


def test_a_host_behind_lists_no_stream_service_past_its_deadline(
    conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a service writes its alive_until on Redis's clock (encoder.service), the web reads it
    entry = {"url": "http://127.0.0.1:1", "device_id": "cpu-x", "alive_until": 0.0}
    for name, until in (("gone", _server_time(conn) - 1), ("here", _server_time(conn) + 30)):
        conn.hset(keys.STREAM_SERVICES, name, json.dumps({**entry, "alive_until": until}))
    with host_behind(monkeypatch):
        listed = streams._services(behind)
    assert [e["alive_until"] > _server_time(conn) for e in listed] == [True]


def test_a_web_session_made_on_a_host_behind_is_listed_on_another(
    conn: Redis, behind: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a web replica behind by more than the session's life makes it; another lists it
    host_clock(behind, off_by(-600.0))
    with process_clock(monkeypatch, off_by(-600.0)):
        Accounts(behind).create_session("alice", ttl_s=300)
    assert [s["user"] for s in Accounts(conn).sessions("alice")] == ["alice"]


def test_an_event_loops_reading_never_waits_for_a_redis_that_is_away() -> None:
    # nothing listens on this port: each reading rides the outage out (1 s here, 15 s by
    # default), which an event loop (the web, the stream service) must never sit through
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    away = redisclient.connect(f"redis://127.0.0.1:{port}/0", ride_out_s=1.0)
    clock = redisclock.RedisClock(away, local=_behind)
    t0 = time.monotonic()
    assert clock.nowait() == pytest.approx(_behind(), abs=0.1)  # this host's time, at once
    assert time.monotonic() - t0 < 0.2
    # a blocking reading (off the event loop) sits through the outage, then goes on with
    # this host's time
    t0 = time.monotonic()
    assert redisclock.RedisClock(away, local=_behind)() == pytest.approx(_behind(), abs=2)
    assert time.monotonic() - t0 >= 0.5
    away.close()
