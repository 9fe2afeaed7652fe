"""Redis behind Sentinels: the primary killed mid-job, a replica promoted, the job completes with
every frame bit-exact and delivered once; and the forms of a Sentinel FARM_REDIS_URL."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from farm import jobstore, redisclient, redisurl
from farm.errors import BadParameter
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, until, wait_for
from workers import exr

SERVICE = "farm"
#: a primary silent this long is down for a Sentinel; two of three agreeing start a failover
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


class Sentinels:
    """Three `redis-server --sentinel` children on loopback watching one primary."""

    def __init__(self, work: Path, primary_port: int) -> None:
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for n in range(3):
            port = _free_port()
            home = work / f"sentinel{n}"
            home.mkdir(parents=True)
            conf = home / "sentinel.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {home}\n"
                f"logfile {home / 'sentinel.log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            )
            command = ["redis-server", str(conf), "--sentinel"]
            self.procs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
            self.ports.append(port)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def master(self, n: int = 0) -> dict[str, Any]:
        state = redis.Redis(port=self.ports[n]).sentinel_master(SERVICE)
        assert isinstance(state, dict)
        return state

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(10)


@contextlib.contextmanager
def _servers(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """Two redis-servers on loopback, to be a primary and its replica; both stopped at the end."""
    primary = RedisServer(tmp_path / "primary", unix_socket=False)
    replica = RedisServer(tmp_path / "replica", unix_socket=False)
    primary.start()
    replica.start()
    try:
        assert primary.port is not None and replica.port is not None
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


def _replicate(primary: RedisServer, replica: RedisServer, first_sync_delay_s: int) -> None:
    """Make ``replica`` a replica of ``primary``, its first sync held back that long (Redis
    waits 5 s by default, for more replicas to share one diskless sync)."""
    assert primary.port is not None and replica.port is not None
    redis.Redis(port=primary.port).config_set("repl-diskless-sync-delay", first_sync_delay_s)
    redis.Redis(port=replica.port).replicaof("127.0.0.1", primary.port)


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer, Sentinels]]:
    with _servers(tmp_path) as (primary, replica):
        assert primary.port is not None
        _replicate(primary, replica, 0)
        # in sync, not only connected: Sentinel may promote a replica still in its first sync
        # (its link down for -1 s), and a primary killed then leaves an empty one in its place
        to_primary = redis.Redis(port=primary.port)
        until(lambda: _replica_state(to_primary) == "online", 30, "the replica in sync")
        sentinels = Sentinels(tmp_path, primary.port)
        try:
            for n in range(3):
                until(functools.partial(_ready, sentinels, n), 30,
                      f"sentinel {n} knowing the replica and the other sentinels")  # fmt: skip
            yield primary, replica, sentinels
        finally:
            sentinels.stop()


def _replica_state(primary: redis.Redis) -> str:
    """The primary's one replica's replication state ('' while none is connected)."""
    replica = primary.info("replication").get("slave0", {})
    return str(replica.get("state", ""))


def _ready(sentinels: Sentinels, n: int) -> bool:
    """Sentinel ``n`` answers and knows the replica and both others: a failover can be agreed."""
    if not _answers(sentinels.ports[n]):
        return False
    state = sentinels.master(n)
    return bool(state["num-slaves"] == 1 and state["num-other-sentinels"] == 2)


def _deliveries(log: str, job_id: str) -> dict[str, int]:
    """How many times each file of the job was put into its output, by name."""
    found = re.findall(rf"event=file_delivered job={job_id} frame=\d+ url=\S+/([^/ ]+) ", log)
    return {name: found.count(name) for name in set(found)}


def test_the_primary_killed_mid_job_the_replica_takes_over_and_every_frame_arrives_once(
    replicated: tuple[RedisServer, RedisServer, Sentinels], tmp_path: Path
) -> None:
    primary, replica, sentinels = replicated
    # about half a second a tile, so the failover lands with most of the job still to do
    scene = make_scene(tmp_path / "anim.blend", frame_end=3, samples=150)
    w = WorkerProcess(sentinels.url, tmp_path, "w1")
    try:
        # the reference: the same job, no fault
        store, ref_id = submit(w.settings, scene, tmp_path / "ref", tiles="2x2")
        wait_for(store, ref_id, lambda e: e.type == "job_state" and e.state == "done", 180)

        store, job_id = submit(w.settings, scene, tmp_path / "run", tiles="2x2")
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "done")
        assert store.status(job_id).tiles_done < 6, "the failover must come mid-job"
        assert primary.pid is not None
        os.kill(primary.pid, signal.SIGKILL)
        until(lambda: sentinels.master()["port"] == replica.port, 30, "the replica promoted")

        done = jobstore.JobStore(jobstore.connect(sentinels.url))
        wait_for(done, job_id, lambda e: e.type == "job_state" and e.state == "done", 180)
        status = done.status(job_id)
        assert status.frames_done == 3 and status.tiles_done == 12
        for frame in (1, 2, 3):
            name = f"frame_{frame:04d}.exr"
            got = exr.read_rgba(tmp_path / "run" / "o" / name)
            want = exr.read_rgba(tmp_path / "ref" / "o" / name)
            assert np.array_equal(got, want), f"frame {frame} differs from the reference"
        delivered = {f"frame_{frame:04d}.exr": 1 for frame in (1, 2, 3)}
        assert _deliveries(w.log_text(), job_id) == {**delivered, "preview.mp4": 1}
        assert w.proc.poll() is None, "the worker died with the failover"
    finally:
        w.stop()


#: how long the primary holds back a replica's first sync in the test below: longer than the
#: test takes to write, shorter than the farm's wait for a replica (REPLICA_WAIT_S)
FIRST_SYNC_DELAY_S = 3


def test_an_accepted_write_waits_for_a_replica_still_in_its_first_sync(tmp_path: Path) -> None:
    """ROLE lists a replica only once it is in sync, but Sentinel may promote it before that:
    a write the farm must not lose waits for the replica's first sync to end, rather than
    count on no failover coming (where the replica would hold nothing at all)."""
    with _servers(tmp_path) as (primary, replica):
        assert primary.port is not None and replica.port is not None
        sentinels = Sentinels(tmp_path, primary.port)
        conn = None
        try:
            for port in sentinels.ports:
                until(functools.partial(_answers, port), 30, f"sentinel on {port} answering")
            # replicating only now: the sentinels' start does not eat into the held sync
            _replicate(primary, replica, FIRST_SYNC_DELAY_S)
            to_primary = redis.Redis(port=primary.port)
            until(lambda: _replica_state(to_primary) != "", 30, "the replica connecting")
            conn = redisclient.connect(sentinels.url)
            conn.set("accepted", "job")
            assert _replica_state(to_primary) != "online", "the test needs a replica not in sync"
            assert redisclient.confirm_replicated(conn, "accepted")
            assert redis.Redis(port=replica.port).get("accepted") == b"job"
        finally:
            if conn is not None:
                conn.close()
            sentinels.stop()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://127.0.0.1:26379", "names no service"),
        ("redis+sentinel://sentinel-a/farm", "'sentinel-a', which is not host:port"),
        ("redis+sentinel://a:1,b:99999/farm", "'b:99999', which is not host:port"),
        ("redis+sentinel://user:secret@a:1/farm", "credentials other than ':password'"),
        ("redis+sentinel://a:1/farm/zero", "database that is not a number"),
        ("sentinel://a:1/farm", "is not redis://, rediss://, unix:// or redis+sentinel://"),
    ],
)
def test_a_bad_sentinel_url_is_refused_saying_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(BadParameter) as refused:
        Settings.from_env({"FARM_REDIS_URL": url})
    assert why in refused.value.message
    assert "secret" not in refused.value.message


def test_a_sentinel_url_names_its_sentinels_service_database_and_password() -> None:
    address = redisurl.parse_sentinel("redis+sentinel://:p%40ss@10.0.0.1:26379,s2:26380/farm/2")
    assert address == redisurl.SentinelAddress(
        (("10.0.0.1", 26379), ("s2", 26380)), "farm", 2, "p@ss"
    )
    assert redisurl.parse_sentinel("redis+sentinel://s:1/farm").db == 0
