"""The farm's rq worker against a real redis-server: what a task costs in round trips, what it
leaves behind, and the rq behaviours its savings must keep (a registration that lives as long as
rq set it, ``rq suspend``)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
import redis.connection
from rq import Queue
from rq.suspension import suspend

from farm.queue import WORKER_TTL_S, RenderQueue, _FarmWorker, run_worker

TASKS = 40
#: rq 3's own worker made 21 round trips per task of these (measured with the counter below)
MOST_ROUND_TRIPS_PER_TASK = 12


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Commands (or pipelines) sent to Redis, by the name of the thread that sent them."""
    sent: Counter[str] = Counter()
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(
        self: redis.connection.AbstractConnection, command: object, check_health: bool = True
    ) -> None:
        sent[threading.current_thread().name] += 1
        send(self, command, check_health)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    yield sent


def test_a_task_costs_half_the_round_trips_of_rqs_worker_and_leaves_nothing_behind(
    redis_url: str, round_trips: Counter[str]
) -> None:
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    ids = [
        queue.queue.enqueue_call("builtins.len", args=([0] * i,), result_ttl=0, job_id=f"t{i}").id
        for i in range(TASKS)
    ]
    round_trips.clear()
    run_worker(queue.conn, "cpu", "trips", burst=True)
    # the worker's own thread (its pub/sub thread aside), start and end included
    per_task = round_trips[threading.current_thread().name] / TASKS
    assert per_task <= MOST_ROUND_TRIPS_PER_TASK, f"{per_task:.1f} round trips a task"

    conn = queue.conn
    assert queue.depth() == 0 and queue.queue.failed_job_registry.count == 0
    # each task's hash, result, dependents and executions are gone, as rq's delete leaves them
    for rq_id in ids:
        for key in ("rq:job:{}", "rq:results:{}", "rq:job:{}:dependents", "rq:executions:{}"):
            assert not conn.exists(key.format(rq_id)), key.format(rq_id)
    assert not list(conn.scan_iter("rq:execution:*"))
    assert queue.queue.started_job_registry.count == 0
    assert queue.queue.finished_job_registry.count == 0
    assert conn.scard("rq:worker:trips:executions") == 0


def test_a_beat_is_skipped_only_where_the_registration_already_expires_about_then(
    redis_url: str, round_trips: Counter[str]
) -> None:
    conn = redis.Redis.from_url(redis_url)
    worker = _FarmWorker([Queue("beats", connection=conn)], name="beats", connection=conn,
                         worker_ttl=WORKER_TTL_S)  # fmt: skip
    worker.register_birth()  # type: ignore[no-untyped-call]
    me = threading.current_thread().name

    def beat(timeout: int | None = None) -> int:
        before = round_trips[me]
        worker.heartbeat(timeout)
        return round_trips[me] - before

    assert beat() == 1 and conn.ttl(worker.key) > WORKER_TTL_S + 55
    assert beat() == 0  # the same expiry, a moment later
    assert beat(300) == 1 and conn.ttl(worker.key) > 295  # later
    assert beat() == 1 and conn.ttl(worker.key) <= WORKER_TTL_S + 60  # earlier: rq's expiry
    with conn.pipeline() as pipe:  # in a caller's transaction: always written
        worker.heartbeat(200, pipeline=pipe)
        pipe.execute()
    assert conn.ttl(worker.key) > 195
    assert beat() == 1 and conn.ttl(worker.key) <= WORKER_TTL_S + 60


def test_rq_suspend_still_holds_the_farms_worker(redis_url: str) -> None:
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0)
    suspend(queue.conn)
    run_worker(queue.conn, "cpu", "held", burst=True)  # a suspended burst worker stops at once
    assert queue.depth() == 1
