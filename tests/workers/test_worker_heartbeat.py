"""A render worker's rq heartbeat costs one round trip to Redis, not three.

rq beats (the registration's date, then two expiries, each its own call) before and after every
take, so at a few milliseconds of work per tile its heartbeats were a fifth of a tile's Redis
calls. The farm's worker sends the three together; what they write is unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from redis.connection import AbstractConnection
from rq import Queue

from farm import keys, queue
from farm.queue import _FarmWorker


def test_a_heartbeat_is_one_round_trip_and_writes_what_rqs_does(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = queue.connect(redis_url)
    try:
        worker = _FarmWorker([Queue(keys.render_queue("cpu"), connection=conn)],
                             connection=conn, name="heartbeat")  # fmt: skip
        worker.register_birth()  # type: ignore[no-untyped-call]
        conn.hset(worker.executions_key, "x", "1")  # an expiry needs a key to land on
        sent: list[int] = []
        real = AbstractConnection.send_packed_command

        def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
            sent.append(1)
            real(self, command, check_health)  # type: ignore[no-untyped-call]

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
        worker.heartbeat(timeout=123)
        monkeypatch.undo()
        assert len(sent) == 1, f"a heartbeat took {len(sent)} round trips"
        assert conn.hget(worker.key, "last_heartbeat")
        assert 0 < conn.ttl(worker.key) <= 123
        assert 0 < conn.ttl(worker.executions_key) <= 123
    finally:
        conn.delete(worker.key, worker.executions_key)
        conn.close()
