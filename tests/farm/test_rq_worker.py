"""The farm's rq worker against a real redis-server: what a task costs in round trips, what it
leaves behind, and the rq behaviours its savings must keep (a registration that lives as long as
rq set it, ``rq suspend``)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis
import redis.connection
from rq import Callback, Queue
from rq.job import Job
from rq.suspension import suspend
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from farm import jobstore, keys, workerstate
from farm.errors import QueueError
from farm.queue import (
    HOLD_POLL_S,
    MAINTENANCE_INTERVAL_S,
    WORKER_TTL_S,
    RenderQueue,
    _FarmWorker,
    build_worker,
    run_worker,
)

TASKS = 40
#: rq 3's own worker made 21 round trips per task of these (measured with the counter below);
#: the farm's makes 3 (the pick, the start, the success) and the worker's start and end
MOST_ROUND_TRIPS_PER_TASK = 4


def test_a_task_costs_a_fifth_of_the_round_trips_of_rqs_worker_and_leaves_nothing_behind(
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


def test_the_farms_queues_refuse_rq_dependencies_which_its_worker_does_not_read(
    redis_url: str,
) -> None:
    """The worker finishes a task without reading what depends on it in rq (two round trips a
    task): nothing may, so the farm's queues refuse rq's ``depends_on`` (a job's dependencies
    are the farm's own), in every band and in ``enqueue_many`` too."""
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    first = queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0)
    with pytest.raises(QueueError, match="no rq dependencies"):
        queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0, depends_on=first)
    with pytest.raises(QueueError, match="no rq dependencies"):
        queue.band(5).enqueue_many(
            [Queue.prepare_data("builtins.len", args=([1],), depends_on=[first.id])]
        )
    assert queue.depth() == 1 and not queue.conn.exists(first.dependents_key)


def test_a_task_whose_hash_is_gone_is_passed_over_as_rq_does(redis_url: str) -> None:
    """The pick reads a task's hash with its take (rq's fetch, one round trip less); a task
    whose hash is gone is passed over, and the next one runs."""
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    gone = queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0)
    kept = queue.queue.enqueue_call("builtins.len", args=([1, 2],), result_ttl=60)
    queue.conn.delete(gone.key)
    run_worker(queue.conn, "cpu", "gone", burst=True)
    assert queue.depth() == 0
    assert kept.get_status(refresh=True) == "finished" and kept.return_value() == 2


def test_a_beat_is_skipped_only_where_the_registration_already_expires_about_then(
    redis_url: str, round_trips: Counter[str]
) -> None:
    conn = redis.Redis.from_url(redis_url)
    worker = _FarmWorker([Queue("beats", connection=conn)], name="beats", connection=conn,
                         worker_ttl=WORKER_TTL_S)  # fmt: skip
    worker.register_birth()  # type: ignore[no-untyped-call]
    me = threading.current_thread().name
    clock = [1000.0]
    worker.clock = lambda: clock[0]

    def beat(timeout: int | None = None) -> int:
        before = round_trips[me]
        worker.heartbeat(timeout)
        return round_trips[me] - before

    assert beat() == 1 and conn.ttl(worker.key) > WORKER_TTL_S + 55
    clock[0] += 0.5
    assert beat() == 0  # the same expiry, a moment later
    clock[0] += 1.0
    assert beat() == 1  # a second and a half later
    assert beat(300) == 1 and conn.ttl(worker.key) > 295  # later
    assert beat() == 1 and conn.ttl(worker.key) <= WORKER_TTL_S + 60  # earlier: rq's expiry
    with conn.pipeline() as pipe:  # in a caller's transaction: always written
        worker.heartbeat(200, pipeline=pipe)
        pipe.execute()
    assert conn.ttl(worker.key) > 195
    assert beat() == 1 and conn.ttl(worker.key) <= WORKER_TTL_S + 60


def test_a_state_is_written_once_and_a_callbacks_beat_kept(
    redis_url: str, round_trips: Counter[str]
) -> None:
    conn = redis.Redis.from_url(redis_url)
    worker = _FarmWorker([Queue("states", connection=conn)], name="states", connection=conn)
    me = threading.current_thread().name

    def trips(step: Callable[[], object]) -> int:
        before = round_trips[me]
        step()
        return round_trips[me] - before

    assert trips(lambda: worker.set_state("busy")) == 1
    assert trips(lambda: worker.set_state("busy")) == 0 and worker.get_state() == "busy"
    assert trips(lambda: worker.set_state("idle")) == 1
    assert conn.hget(worker.key, "state") == b"idle"
    with conn.pipeline() as pipe:  # written by the caller's pipeline, or not at all
        worker.set_state("busy", pipeline=pipe)
    assert trips(lambda: worker.set_state("busy")) == 1
    assert conn.hget(worker.key, "state") == b"busy"

    # a task's beat as its function returns is rq's where a callback is to run (it gives the
    # callback its time), and costs nothing where none is
    queue = RenderQueue(conn, "cpu")
    plain = queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0)
    called = queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0,
                                      on_success=Callback("builtins.print"))  # fmt: skip
    assert trips(lambda: worker.handle_execution_ended(plain, queue.queue, 60)) == 0
    assert trips(lambda: worker.handle_execution_ended(called, queue.queue, 60)) == 1


def test_rq_suspend_still_holds_the_farms_worker(redis_url: str) -> None:
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    queue.queue.enqueue_call("builtins.len", args=([1],), result_ttl=0)
    suspend(queue.conn)
    run_worker(queue.conn, "cpu", "held", burst=True)  # a suspended burst worker stops at once
    assert queue.depth() == 1


def test_rqs_registry_maintenance_runs_once_an_interval_for_the_whole_farm(
    redis_url: str,
) -> None:
    """rq releases its maintenance lock when a cleaning ends, so every worker whose own
    interval passed cleaned again, reading every worker's registration: here one worker of the
    farm cleans per interval."""
    conn = redis.Redis.from_url(redis_url)
    a, b = (build_worker(conn, "cpu", name) for name in ("maint-a", "maint-b"))
    queue_name = keys.render_queue("cpu")

    def ghost() -> None:  # a registration whose worker is gone: a cleaning drops it
        conn.sadd(WORKERS_BY_QUEUE_KEY % queue_name, "rq:worker:ghost")

    def ghost_listed() -> bool:
        return bool(conn.sismember(WORKERS_BY_QUEUE_KEY % queue_name, "rq:worker:ghost"))

    ghost()
    a.clean_registries()
    assert not ghost_listed()
    ghost()
    b.clean_registries()  # the same interval: b leaves it to the next one
    assert ghost_listed() and b.last_cleaned_at is not None
    assert conn.ttl(keys.rq_maintenance(queue_name)) > MAINTENANCE_INTERVAL_S - 3
    conn.delete(keys.rq_maintenance(queue_name))  # the interval ends
    b.clean_registries()
    assert not ghost_listed()


def test_a_worker_an_operator_disabled_takes_nothing_until_enabled(redis_url: str) -> None:
    """The pick reads the operator's flag in the take's own round trip (the worker read it in
    one of its own before each take): a disabled worker takes nothing, in burst mode it finds
    the queue as if empty, and a waiting one takes the task once enabled."""
    conn = redis.Redis.from_url(redis_url)
    queue = RenderQueue(conn, "cpu")
    task = queue.queue.enqueue_call("builtins.len", args=([1, 2],), result_ttl=60)
    registry = workerstate.WorkerRegistry(jobstore.connect(redis_url), silent_s=30,
                                          retention_s=3600)  # fmt: skip
    registry.beat("held", {"kind": "render"})
    registry.set_disabled("held", True)
    run_worker(conn, "cpu", "held", burst=True)
    assert queue.depth() == 1 and task.get_status(refresh=True) == "queued"

    worker = build_worker(conn, "cpu", "held")
    worker.register_birth()  # type: ignore[no-untyped-call]
    taken: list[tuple[Job, Queue] | None] = []
    waiting = threading.Thread(target=lambda: taken.append(worker.dequeue_job_and_maintain_ttl(30)))
    waiting.start()
    time.sleep(3 * HOLD_POLL_S)
    assert waiting.is_alive() and queue.depth() == 1  # held, asking again
    registry.set_disabled("held", False)
    waiting.join(10 * HOLD_POLL_S)
    assert not waiting.is_alive()
    (got,) = taken
    assert got is not None and got[0].id == task.id and queue.depth() == 0
