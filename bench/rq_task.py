"""What rq's bookkeeping costs per task: the farm's worker against the same worker with rq's own
bookkeeping, paired, on one private redis-server.

Both arms are the farm's worker (its pick script, its pipelined beat); the baseline (``rq``)
keeps rq's own handling of what the farm trims (farm/queue.py): the fetch of a task's hash
after the take (the farm's pick reads it with the take), the delete of a finished task that
first reads its status and its executions, a beat on every call rq makes, ``rq suspend``
asked before every take, the worker's state written again when unchanged, the task's beat as
it returns (for a callback the farm's tasks do not have), registry maintenance by every
worker each interval (bench/scale.py shows what that costs a large farm; a block here is too
short), the execution's record and the task's start in two transactions, the success's WATCH
and read of the task's dependents, and the return to idle and its beat each in a round trip
of its own. Each round runs a block of trivial tasks (``builtins.len``) through a burst
worker of each arm, in alternating order; per task it measures the worker's round trips, the
Redis commands and Redis CPU (``INFO``), and the wall time. A block counts only where every
task ran (the queue empty, nothing failed).

    python bench/rq_task.py [--rounds 8] [--tasks 300]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis
import redis.connection
from rq import SimpleWorker
from rq.job import Job

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from farm import queue as farmqueue  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402

ARMS = ("rq", "farm")
FIGURES = ("round_trips", "commands", "redis_cpu_us", "wall_ms")


class _RqBookkeeping(farmqueue._FarmWorker):
    """The farm's worker with rq's bookkeeping: a (pipelined) beat on every call rq makes, the
    suspension asked before every take, every state written, the task's beat as it returns,
    rq's maintenance lock, the execution's record and the task's start in two transactions,
    the success read its dependents and go idle apart; built with rq's Job (its delete)."""

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        if pipeline is not None:
            SimpleWorker.heartbeat(self, timeout, pipeline=pipeline)
            return
        with self.connection.pipeline(transaction=False) as pipe:
            SimpleWorker.heartbeat(self, timeout, pipeline=pipe)
            pipe.execute()

    def check_for_suspension(self, burst: bool) -> None:
        SimpleWorker.check_for_suspension(self, burst)

    def set_state(self, state: str, pipeline: Any = None) -> None:
        SimpleWorker.set_state(self, state, pipeline)

    def handle_execution_ended(self, job: Job, queue: Any, heartbeat_ttl: int) -> None:
        SimpleWorker.handle_execution_ended(self, job, queue, heartbeat_ttl)

    def clean_registries(self) -> None:
        SimpleWorker.clean_registries(self)  # type: ignore[no-untyped-call]

    def prepare_execution(self, job: Job) -> Any:
        return SimpleWorker.prepare_execution(self, job)

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        SimpleWorker.prepare_job_execution(self, job, remove_from_intermediate_queue)

    def handle_job_success(self, job: Job, queue: Any, started_job_registry: Any,
                           execution: Any) -> None:  # fmt: skip
        SimpleWorker.handle_job_success(self, job, queue, started_job_registry, execution)


class _RqFetch(farmqueue._BandedQueue):
    """The farm's pick, followed by rq's fetch of the task's hash (its own round trip)."""

    @classmethod
    def _restore_picked(
        cls, connection: Any, queue_key: str, job_id: str, fields: list[bytes],
        job_class: Any, serializer: Any, death_penalty_class: Any,
    ) -> Any:  # fmt: skip
        return cls._fetch_dequeued_job(connection, queue_key, job_id, job_class=job_class,
                                       serializer=serializer,
                                       death_penalty_class=death_penalty_class)  # fmt: skip


#: commands (or pipelines) sent to Redis, by the sending thread's name, once ``_counted`` is
#: installed as redis-py's send (here and in bench/scale.py)
_sent: Counter[str] = Counter()
_send = redis.connection.AbstractConnection.send_packed_command


def _counted(self: Any, command: Any, check_health: bool = True) -> None:
    _sent[threading.current_thread().name] += 1
    _send(self, command, check_health)  # type: ignore[no-untyped-call]


def _redis_figures(conn: redis.Redis) -> tuple[int, float]:
    """Commands Redis has run and its CPU seconds so far."""
    stats = conn.info("commandstats")
    cpu = conn.info("cpu")
    commands = sum(int(v["calls"]) for v in stats.values())
    return commands, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def block(conn: redis.Redis, arm: str, tasks: int, n: int) -> dict[str, float] | None:
    """One burst worker of ``arm`` through ``tasks`` trivial tasks; per-task figures, or None
    where not every task ran."""
    queue = farmqueue.RenderQueue(conn, "cpu")
    for i in range(tasks):
        queue.queue.enqueue_call("builtins.len", args=([0] * (i % 7),), result_ttl=0,
                                 job_id=f"{arm}-{n}-{i}")  # fmt: skip
    if arm == "rq":
        worker = farmqueue.build_worker(conn, "cpu", f"w-{arm}-{n}", None, _RqBookkeeping, Job,
                                        _RqFetch)  # fmt: skip
    else:
        worker = farmqueue.build_worker(conn, "cpu", f"w-{arm}-{n}")
    me = threading.current_thread().name
    commands0, cpu0 = _redis_figures(conn)
    trips0 = _sent[me]
    t0 = time.perf_counter()
    worker.work(burst=True, logging_level="WARNING", with_scheduler=False)
    wall = time.perf_counter() - t0
    trips = _sent[me] - trips0
    commands1, cpu1 = _redis_figures(conn)
    if queue.depth() or queue.queue.failed_job_registry.count:
        return None
    return {
        "round_trips": trips / tasks,
        # less the two INFO calls of the measurement itself
        "commands": (commands1 - commands0 - 2) / tasks,
        "redis_cpu_us": (cpu1 - cpu0) * 1e6 / tasks,
        "wall_ms": wall * 1000 / tasks,
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f} .. {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=300)
    args = parser.parse_args()
    logging.getLogger("rq.worker").setLevel(logging.WARNING)
    redis.connection.AbstractConnection.send_packed_command = _counted  # type: ignore[method-assign]

    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    ratios: dict[str, list[float]] = {f: [] for f in FIGURES}
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        conn = redis.Redis.from_url(server.url)
        block(conn, "farm", 50, -1)  # warm: scripts loaded, imports done
        for n in range(args.rounds):
            order = ARMS if n % 2 == 0 else ARMS[::-1]
            got = {arm: block(conn, arm, args.tasks, n) for arm in order}
            rq_, farm = got["rq"], got["farm"]
            if rq_ is None or farm is None:
                print(f"round {n}: not every task ran, not counted")
                continue
            runs["rq"].append(rq_)
            runs["farm"].append(farm)
            for f in FIGURES:
                ratios[f].append(farm[f] / rq_[f])
            print(f"round {n}: " + ", ".join(f"{f} {farm[f]:.2f}/{rq_[f]:.2f}" for f in FIGURES))

    counted = len(ratios["wall_ms"])
    print(f"\n{args.tasks} tasks a block, {counted} rounds counted of {args.rounds}; per task, "
          "median [min .. max] of the rounds")  # fmt: skip
    print("| figure | rq's bookkeeping | the farm's | farm / rq (paired) |")
    print("| --- | --- | --- | --- |")
    for f in FIGURES:
        if counted:
            print(f"| {f} | {spread([r[f] for r in runs['rq']])} | "
                  f"{spread([r[f] for r in runs['farm']])} | {spread(ratios[f])} |")  # fmt: skip
    out: dict[str, Any] = {"rounds_counted": counted, "tasks_per_block": args.tasks}
    for f in FIGURES:
        if counted:
            unit = f.rsplit("_", 1)[-1] if f.endswith(("_us", "_ms")) else "per_task"
            name = f.removesuffix("_us").removesuffix("_ms")
            out[f"rq_{name}_{unit}"] = round(statistics.median(r[f] for r in runs["rq"]), 3)
            out[f"farm_{name}_{unit}"] = round(statistics.median(r[f] for r in runs["farm"]), 3)
            out[f"ratio_{name}"] = round(statistics.median(ratios[f]), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
