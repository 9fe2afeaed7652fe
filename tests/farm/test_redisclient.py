"""A farm client cut off from Redis says so at once, rides the cut out for its budget, then fails;
it carries on by itself when the network heals in time."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis

from farm.errors import QueueError
from farm.redisclient import connect, guard
from tests.farmprocs import until

#: the test's budgets: short, so a cut costs seconds, with the production code paths
RIDE_OUT_S = 3.0
SOCKET_TIMEOUT_S = 1.0


class Partition:
    """A TCP relay to Redis on loopback that can be cut as a dropped network is: connections
    stay open and new ones are accepted, but no byte gets through either way."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.cut = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self._lock:
                self._open.append(client)
            if self.cut.is_set():
                continue  # held open, answered never
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._open.append(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self.cut.is_set():
                    dst.sendall(data)

    def heal(self) -> None:
        """Traffic flows again; connections that lost bytes in the cut are reset, as the peer's
        retransmissions would find them after a long cut."""
        self.cut.clear()
        with self._lock:
            stale, self._open = self._open, []
        for sock in stale:
            sock.close()

    def close(self) -> None:
        self.server.close()
        self.heal()


@pytest.fixture
def partition(redis_url: str) -> Iterator[Partition]:
    where = urlsplit(redis_url)
    relay = Partition((where.hostname or "127.0.0.1", where.port or 6379))
    yield relay
    relay.close()


def test_a_cut_is_logged_at_once_and_fails_after_the_ride_out(
    partition: Partition, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect(f"redis://127.0.0.1:{partition.port}/0", ride_out_s=RIDE_OUT_S,
                     socket_timeout_s=SOCKET_TIMEOUT_S)  # fmt: skip
    assert guard(client.ping)
    partition.cut.set()
    caplog.set_level(logging.WARNING, logger="tessera.redis")
    start = time.time()
    with pytest.raises(QueueError, match="cannot reach Redis"):
        guard(client.ping)
    failed_after_s = time.time() - start

    events = {r.getMessage().split()[0]: r.created - start for r in caplog.records}
    # the first failed reply is logged, not the end of the ride-out
    assert events["event=redis_unreachable"] < SOCKET_TIMEOUT_S + 0.5
    assert "event=redis_given_up" in events
    # the budget, plus at most one attempt in flight when it ran out
    assert RIDE_OUT_S <= failed_after_s < RIDE_OUT_S + SOCKET_TIMEOUT_S + 1.0
    client.close()


def test_a_cut_healed_within_the_ride_out_costs_nothing_but_time(
    partition: Partition, caplog: pytest.LogCaptureFixture
) -> None:
    client = connect(f"redis://127.0.0.1:{partition.port}/0", ride_out_s=RIDE_OUT_S * 4,
                     socket_timeout_s=SOCKET_TIMEOUT_S)  # fmt: skip
    guard(client.set, "tessera-test:partition", "before")
    partition.cut.set()
    caplog.set_level(logging.WARNING, logger="tessera.redis")
    healer = threading.Timer(SOCKET_TIMEOUT_S * 2, partition.heal)
    healer.start()
    try:
        assert guard(client.get, "tessera-test:partition") == "before"
    finally:
        healer.cancel()
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("event=redis_unreachable") for m in messages)
    assert any(m.startswith("event=redis_reachable") for m in messages)
    assert not any(m.startswith("event=redis_given_up") for m in messages)
    client.close()


def test_closing_a_client_closes_its_connections(redis_url: str, rconn: redis.Redis) -> None:
    """A farm client's close() ends its sockets: left to the garbage collector they stay open
    (one connection per client the farm made and closed) and warn as unclosed sockets."""
    name = f"closing-{time.monotonic_ns()}"
    conn = connect(redis_url)
    conn.client_setname(name)
    assert _clients_named(rconn, name) == 1
    conn.close()
    # redis-server drops a closed client when its event loop reads the EOF: on a loaded
    # machine CLIENT LIST from another connection came first once (fresh-clone CI run)
    until(lambda: _clients_named(rconn, name) == 0, 2.0, "the closed client leaving CLIENT LIST")


def _clients_named(rconn: redis.Redis, name: str) -> int:
    return sum(1 for c in rconn.client_list() if c.get("name") == name)
