"""Tests of the private redis-server the embedded farm and the test fixtures start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from farm.errors import BadParameter, SetupError
from farm.redisserver import INSTALL_HINT, UNIX_PATH_MAX_BYTES, RedisServer

WAIT_S = 10.0


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    # The state letter follows the command name in parentheses, which may itself hold spaces.
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until_gone(pid: int, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def ping(url: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return bool(client.ping())
    finally:
        client.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as srv:
        yield srv


def test_unix_socket_server_answers_ping(server: RedisServer) -> None:
    assert server.url.startswith("unix://")
    assert server.url.endswith("/redis.sock")
    assert ping(server.url)


def test_tcp_server_answers_ping_on_loopback(tmp_path: Path) -> None:
    with RedisServer(tmp_path, unix_socket=False) as srv:
        assert srv.url == f"redis://127.0.0.1:{srv.port}/0"
        assert ping(srv.url)
        client = redis.Redis.from_url(srv.url)
        try:
            config = client.config_get("*")
        finally:
            client.close()
    assert config["bind"] == "127.0.0.1"
    assert config["protected-mode"] == "yes"
    assert config["save"] == ""
    assert config["appendonly"] == "no"
    assert config["maxmemory-policy"] == "noeviction"
    assert config["dir"] == str(tmp_path.absolute())


def test_two_servers_get_different_addresses(tmp_path: Path) -> None:
    with (
        RedisServer(tmp_path / "a", unix_socket=False) as a,
        RedisServer(tmp_path / "b", unix_socket=False) as b,
        RedisServer(tmp_path / "c") as c,
        RedisServer(tmp_path / "d") as d,
    ):
        urls = {a.url, b.url, c.url, d.url}
        assert len(urls) == 4
        assert all(ping(url) for url in urls)


def test_stop_leaves_no_process_and_no_socket(tmp_path: Path) -> None:
    srv = RedisServer(tmp_path)
    srv.start()
    pid = srv.pid
    assert pid is not None
    socket_path = Path(srv.url.removeprefix("unix://"))
    assert socket_path.exists()
    srv.stop()
    assert not alive(pid)
    assert not socket_path.exists()
    assert srv.pid is None
    srv.stop()  # a second stop does nothing


def test_discard_ends_the_server_at_once_without_a_clean_shutdown(tmp_path: Path) -> None:
    """The embedded farm's Redis is thrown away with its folder: discard kills it rather than
    wait for the clean stop (Redis acts on SIGTERM at its next cron tick, up to 100 ms)."""
    kept, thrown = RedisServer(tmp_path / "kept"), RedisServer(tmp_path / "thrown")
    for srv in (kept, thrown):
        srv.start()
    pids = [kept.pid, thrown.pid]
    socket_path = Path(thrown.url.removeprefix("unix://"))
    kept.stop()
    thrown.discard()
    assert not any(alive(pid) for pid in pids if pid is not None)
    assert not socket_path.exists()
    assert thrown.pid is None
    thrown.discard()  # a second one does nothing
    # a clean stop says goodbye in its log; a discarded server had no time to
    assert "ready to exit" in (tmp_path / "kept" / "redis.log").read_text()
    assert "ready to exit" not in (tmp_path / "thrown" / "redis.log").read_text()


def test_long_work_dir_gets_a_short_socket_path(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with RedisServer(deep) as srv:
        socket_path = srv.url.removeprefix("unix://")
        assert len(os.fsencode(socket_path)) <= UNIX_PATH_MAX_BYTES
        assert socket_path.startswith("/tmp/")
        assert ping(srv.url)
        assert (deep / "redis.log").exists()
    assert not Path(socket_path).parent.exists()


def test_missing_binary_names_the_setup_command(tmp_path: Path) -> None:
    with pytest.raises(SetupError) as raised:
        RedisServer(tmp_path, binary="redis-server-that-is-not-here").start()
    assert raised.value.message == INSTALL_HINT
    assert "make setup" in str(raised.value)


def test_out_of_range_port_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadParameter):
        RedisServer(tmp_path, unix_socket=False, port=70000)


def test_server_that_exits_early_reports_its_log(tmp_path: Path) -> None:
    # Another Redis already answers on the port: ours must not take its PONG for its own.
    with RedisServer(tmp_path / "a", unix_socket=False) as first:
        second = RedisServer(tmp_path / "b", unix_socket=False, port=first.port)
        with pytest.raises(SetupError) as raised:
            second.start()
        assert "exited before it was ready" in raised.value.message
        assert "already in use" in raised.value.message
        assert "already in use" in raised.value.fields["log_tail"]
        assert second.pid is None
        assert ping(first.url)


def test_restart_keeps_address_and_aof_data(tmp_path: Path) -> None:
    with RedisServer(tmp_path, unix_socket=False, appendonly=True) as srv:
        url, old_pid = srv.url, srv.pid
        client = redis.Redis.from_url(url)
        try:
            client.set("job:1", "queued")
        finally:
            client.close()
        srv.restart()
        assert srv.url == url
        assert srv.pid != old_pid
        client = redis.Redis.from_url(url)
        try:
            assert client.get("job:1") == b"queued"
        finally:
            client.close()


def test_restart_on_unix_socket_keeps_the_url(server: RedisServer) -> None:
    url = server.url
    server.restart()
    assert server.url == url
    assert ping(url)


CHILD = """
import sys
from pathlib import Path
from farm.redisserver import RedisServer
srv = RedisServer(Path(sys.argv[1]))
srv.start()
print(srv.pid, flush=True)
sys.stdin.read()
"""


def test_server_dies_with_a_parent_killed_by_sigkill(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None and parent.stdin is not None
    try:
        server_pid = int(parent.stdout.readline())
        assert alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=WAIT_S)
        assert wait_until_gone(server_pid), "redis-server outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()
