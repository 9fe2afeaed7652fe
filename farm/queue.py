"""The rq adapter: a render queue per device class, tile/assembly/inspection jobs, the worker.

This is the only module that imports rq. rq's own job status is not the record of a tile: the
farm's job store is (``farm.jobstore``); rq only carries the work to a worker.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any

from rq import Queue, SimpleWorker
from rq.job import Job
from rq.utils import now

from farm import keys, redisclient
from farm.models import BlendSource, TileTask
from farm.redisclient import Redis, guard

TILE_TASK = "workers.tasks.render_tile"
ASSEMBLE_TASK = "workers.tasks.assemble_frame"
INSPECT_TASK = "workers.tasks.inspect_blend"

#: how long rq keeps a failed task's traceback (the farm keeps its own record of failures)
FAILURE_TTL_S = 24 * 3600
#: seconds between a worker's passes over rq's registries (the farm's own recovery sweep runs
#: on its own thread, see workers.worker)
MAINTENANCE_INTERVAL_S = 10
#: a worker's heartbeat TTL; rq waits for new work this long minus 15 s per blocking pop
WORKER_TTL_S = 35


def connect(url: str) -> Redis:
    """A Redis client for rq (binary replies, as rq requires)."""
    return redisclient.connect(url, text=False)


class RenderQueue:
    """The queue of one device class (``cpu``, ``gpu``, later ``t4``, ``l4``...)."""

    def __init__(self, conn: Redis, device_class: str) -> None:
        self.conn = conn
        self.device_class = device_class
        self.queue = Queue(keys.render_queue(device_class), connection=conn)
        self._reorder = conn.register_script(_REORDER)

    def stage_tiles(
        self, tasks: Iterable[TileTask], timeout_s: float, pipeline: Any = None
    ) -> None:
        """Push tile attempts; with ``pipeline`` the pushes join the caller's transaction."""
        datas = [
            Queue.prepare_data(
                TILE_TASK,
                args=(t.job_id, t.frame, t.index, t.attempt),
                timeout=_rq_timeout(timeout_s),
                result_ttl=0,
                failure_ttl=FAILURE_TTL_S,
                job_id=t.rq_id,
                description=f"job {t.job_id} frame {t.frame} tile {t.index} attempt {t.attempt}",
            )
            for t in tasks
        ]
        if datas:
            guard(self.queue.enqueue_many, datas, pipeline=pipeline)

    def enqueue_assembly(self, job_id: str, frame: int, timeout_s: float) -> None:
        # at the front: a finished frame is worth more to the user than one more tile
        guard(
            self.queue.enqueue_call,
            ASSEMBLE_TASK,
            args=(job_id, frame),
            timeout=_rq_timeout(timeout_s),
            result_ttl=0,
            failure_ttl=FAILURE_TTL_S,
            job_id=f"assemble-{job_id}-{frame}",
            at_front=True,
            description=f"job {job_id} assemble frame {frame}",
        )

    def enqueue_inspection(self, source: BlendSource, reply_key: str, timeout_s: float) -> None:
        guard(
            self.queue.enqueue_call,
            INSPECT_TASK,
            args=(source.to_dict(), reply_key),
            timeout=_rq_timeout(timeout_s),
            result_ttl=0,
            failure_ttl=FAILURE_TTL_S,
            at_front=True,
            description=f"inspect {source.name}",
        )

    def set_priority(self, job_id: str, priority: int) -> None:
        """Give a job's waiting tiles their place: before every job of lower priority, after
        every job of higher priority.

        Among equal priorities the queue keeps its order (new jobs join the back of their
        priority). A retried tile joins the back of the queue and finds its place at the next
        reorder. Sorting costs O(n log n) in Redis for n waiting tasks, once per change.
        """
        if priority:
            guard(self.conn.hset, keys.PRIORITIES, job_id, priority)
        else:
            guard(self.conn.hdel, keys.PRIORITIES, job_id)
        self.reorder()

    def reorder(self) -> int:
        """Sort the waiting tasks by their job's priority (nothing to do while none is set)."""
        return int(guard(self._reorder, keys=[self.queue.key, keys.PRIORITIES]))

    def depth(self) -> int:
        return int(self.queue.count)

    def missing(self, tasks: Sequence[TileTask]) -> list[TileTask]:
        """The tile attempts that have no task in rq (lost between a state change and a push)."""
        pipe = self.conn.pipeline(transaction=False)
        for t in tasks:
            pipe.exists(Job.key_for(t.rq_id))
        found = guard(pipe.execute) if tasks else []
        return [t for t, exists in zip(tasks, found, strict=True) if not exists]


#: Sorts a queue's waiting tasks by their job's priority, highest first, keeping the order
#: within a priority (stable). Assemblies and inspections stay in front of every tile: a
#: finished frame or a waiting user is worth more than one more tile.
#: KEYS: the rq queue list, the priorities hash.   Returns how many entries were sorted.
_REORDER = """
if redis.call('HLEN', KEYS[2]) == 0 then return 0 end
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
local items = {}
for i, id in ipairs(ids) do
  local p = 1e12
  local job = string.match(id, '^tile%-(%d+%-%d+%-%x+)%-')
  if job then p = tonumber(redis.call('HGET', KEYS[2], job) or '0') end
  items[i] = {p, i, id}
end
table.sort(items, function(a, b)
  if a[1] ~= b[1] then return a[1] > b[1] end
  return a[2] < b[2]
end)
redis.call('DEL', KEYS[1])
for start = 1, #items, 5000 do
  local chunk = {}
  for i = start, math.min(start + 4999, #items) do chunk[#chunk + 1] = items[i][3] end
  redis.call('RPUSH', KEYS[1], unpack(chunk))
end
return #items
"""


class _FarmWorker(SimpleWorker):
    """rq's in-process worker (no fork per job: the Blender child must outlive each tile).

    rq's second signal is a cold shutdown: SystemExit raised wherever the task happens to be,
    between a tile's upload and its commit for instance. Here every signal goes to the farm's
    ``on_signal``, which ends the current task cleanly; rq only stops taking work.
    """

    on_signal: Callable[[int], None] | None = None

    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._farm_stop)
        signal.signal(signal.SIGTERM, self._farm_stop)

    def _farm_stop(self, signum: int, frame: FrameType | None) -> None:
        first = not self._stop_requested and self._shutdown_requested_date is None
        if self.on_signal is not None:
            self.on_signal(signum)
        if first:
            self._shutdown_requested_date = now()
            # raises StopRequested when idle; when busy, stops after the current task
            self._shutdown()  # type: ignore[no-untyped-call]


def run_worker(
    conn: Redis,
    device_class: str,
    name: str,
    *,
    burst: bool = False,
    log_level: str = "INFO",
    on_signal: Callable[[int], None] | None = None,
) -> None:
    """Serve the device class's queue until stopped (SIGINT/SIGTERM) or, with ``burst``, empty.

    The first SIGINT/SIGTERM stops the worker taking work once the current task returns; every
    signal is also passed to ``on_signal``, which decides how long the current task may run.
    """
    worker = _FarmWorker(
        [RenderQueue(conn, device_class).queue],
        name=name,
        connection=conn,
        maintenance_interval=MAINTENANCE_INTERVAL_S,
        worker_ttl=WORKER_TTL_S,
        log_job_description=False,
    )
    worker.on_signal = on_signal
    logging.getLogger("rq.worker").setLevel(log_level)
    guard(worker.work, burst=burst, logging_level=log_level, with_scheduler=False)


def depths(conn: Redis) -> dict[str, int]:
    """Tasks waiting in each of the farm's queues (every queue rq knows named ``tessera-*``)."""
    out: dict[str, int] = {}
    for q in guard(Queue.all, connection=conn):
        if q.name.startswith(f"{keys.PREFIX}-"):
            out[q.name] = int(guard(_count, q))
    return out


def _count(q: Queue) -> int:
    return int(q.count)


def _rq_timeout(timeout_s: float) -> int:
    # The worker enforces the real limit by killing its Blender child; rq's own alarm is a
    # backstop well past it, so it never fires first.
    return int(timeout_s * 2 + 120)
