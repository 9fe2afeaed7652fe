"""The rq adapter: a render queue per device class, tile/assembly/inspection jobs, the worker.

This is the only module that imports rq. rq's own job status is not the record of a tile: the
farm's job store is (``farm.jobstore``); rq only carries the work to a worker.
"""

from __future__ import annotations

import json
import logging
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType
from typing import Any

from rq import Queue, SimpleWorker
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job
from rq.utils import as_text, now
from rq.worker import WorkerStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

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
#: how often a worker an operator disabled asks whether it may take work again
HOLD_POLL_S = 0.5


def connect(url: str) -> Redis:
    """A Redis client for rq (binary replies, as rq requires)."""
    return redisclient.connect(url, text=False)


class RenderQueue:
    """The queue of one device class (``cpu``, ``gpu``, later ``t4``, ``l4``...)."""

    def __init__(self, conn: Redis, device_class: str) -> None:
        self.conn = conn
        self.device_class = device_class
        self.queue = Queue(keys.render_queue(device_class), connection=conn)
        self.bands_key = keys.render_bands(device_class)
        self._wake = conn.register_script(_WAKE)
        self._move = conn.register_script(_MOVE)

    def band(self, priority: int) -> Queue:
        """The rq queue holding the waiting tiles of one priority (0: the class's own queue)."""
        if not priority:
            return self.queue
        return Queue(f"{self.queue.name}-p{priority}", connection=self.conn)

    def stage_tiles(
        self,
        tasks: Iterable[TileTask],
        timeout_s: float,
        pipeline: Any = None,
        priority: int | None = None,
    ) -> None:
        """Push tile attempts into their job's priority band; with ``pipeline`` the pushes join
        the caller's transaction. ``priority`` None: read each job's (a retry, a requeue).
        An attempt named twice is pushed once: rq refuses an id twice in one push."""
        tasks = list({t.rq_id: t for t in tasks}.values())
        if priority is None:
            by_job: dict[int, list[TileTask]] = {}
            for t in tasks:
                by_job.setdefault(self._job_priority(t.job_id), []).append(t)
            for p, mine in by_job.items():
                self.stage_tiles(mine, timeout_s, pipeline, p)
            return
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
        if not datas:
            return
        band = self.band(priority)
        pipe = pipeline if pipeline is not None else self.conn.pipeline()
        band.enqueue_many(datas, pipeline=pipe)
        if band is not self.queue:
            # workers waiting for work block on the class's own queue: ring it
            wakes = min(len(datas), _MAX_WAKES)
            self._wake(
                keys=[self.queue.key, self.bands_key], args=[band.key, priority, wakes], client=pipe
            )
        if pipeline is None:
            guard(pipe.execute)

    def _job_priority(self, job_id: str) -> int:
        text = guard(self.conn.hget, keys.job(job_id), "spec")
        if text is None:
            return 0
        return int(json.loads(text).get("priority", 0))

    def enqueue_assembly(self, job_id: str, frame: int, timeout_s: float, attempt: int = 1) -> None:
        # at the front: a finished frame is worth more to the user than one more tile. Each
        # assembly attempt is its own rq task: a re-offer never reuses a task rq may still hold
        guard(
            self.queue.enqueue_call,
            ASSEMBLE_TASK,
            args=(job_id, frame, attempt),
            timeout=_rq_timeout(timeout_s),
            result_ttl=0,
            failure_ttl=FAILURE_TTL_S,
            job_id=f"assemble-{job_id}-{frame}-{attempt}",
            at_front=True,
            description=f"job {job_id} assemble frame {frame}",
        )

    def enqueue_inspection(
        self, source: BlendSource, reply_key: str, timeout_s: float, project: str
    ) -> str:
        """Queue an inspection for ``project`` at the front; returns its rq id (for
        drop_waiting). The worker opens the file in a child of that project's only."""
        job: Job = guard(
            self.queue.enqueue_call,
            INSPECT_TASK,
            args=(source.to_dict(), reply_key, project),
            timeout=_rq_timeout(timeout_s),
            result_ttl=0,
            failure_ttl=FAILURE_TTL_S,
            at_front=True,
            description=f"inspect {source.name}",
        )
        return str(job.id)

    def drop_waiting(self, rq_id: str) -> bool:
        """Take a task no worker has started off the queue (an inspection no one waits for any
        more); False when a worker already has it."""
        if not guard(self.queue.remove, rq_id):
            return False
        guard(self.conn.delete, Job.key_for(rq_id))
        return True

    def set_priority(self, job_id: str, priority: int) -> None:
        """Move a job's waiting tiles to the band of ``priority``: before every job of lower
        priority, after every job of higher priority, at the back of their new band.

        New jobs go straight into their band when staged (no reordering at submission); a
        change reads the waiting tasks of the class once (a user's action, not a hot path).
        """
        band = self.band(priority)
        guard(self._move, keys=[self.queue.key, self.bands_key, band.key],
              args=[f"tile-{job_id}-", priority, _MAX_WAKES])  # fmt: skip

    def waiting_ids(self) -> list[str]:
        """The waiting task ids in the order workers take them."""
        ids = [as_text(i) for i in guard(self.conn.lrange, self.queue.key, 0, -1)]
        front = 0
        while front < len(ids) and not ids[front].startswith("tile-"):
            front += 1
        bands = guard(self.conn.zrevrange, self.bands_key, 0, -1, withscores=True)
        out = ids[:front]
        for key, score in bands:
            if score > 0:
                out += [as_text(i) for i in guard(self.conn.lrange, key, 0, -1)]
        out += [i for i in ids[front:] if i != _WAKE_ID]
        for key, score in bands:
            if score < 0:
                out += [as_text(i) for i in guard(self.conn.lrange, key, 0, -1)]
        return out

    def depth(self) -> int:
        """Tasks waiting in every band of the class."""
        pipe = self.conn.pipeline(transaction=False)
        pipe.llen(self.queue.key)
        for key in guard(self.conn.zrange, self.bands_key, 0, -1):
            pipe.llen(key)
        return sum(int(n) for n in guard(pipe.execute))

    def missing(self, tasks: Sequence[TileTask]) -> list[TileTask]:
        """The tile attempts that have no task in rq (lost between a state change and a push)."""
        pipe = self.conn.pipeline(transaction=False)
        for t in tasks:
            pipe.exists(Job.key_for(t.rq_id))
        found = guard(pipe.execute) if tasks else []
        return [t for t, exists in zip(tasks, found, strict=True) if not exists]


#: the suffix of a priority band's queue name (``tessera-render-gpu-p5``)
_BAND_NAME = re.compile(r"-p-?\d+$")
#: the id of a task that is no task: pushed onto a class's queue to wake blocked workers
_WAKE_ID = "wake"
#: wake at most this many blocked workers per push into a band
_MAX_WAKES = 64

#: Index a band (KEYS[2]: band key -> priority) and, when the class's own queue (KEYS[1]) is
#: empty (so workers may be blocked on it), push wakes onto it.   ARGV: band key, priority, n
_WAKE = f"""
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
if redis.call('LLEN', KEYS[1]) == 0 then
  for i = 1, tonumber(ARGV[3]) do redis.call('RPUSH', KEYS[1], '{_WAKE_ID}') end
end
return 1
"""

#: Move a job's waiting tiles (ids starting ARGV[1]) from every band to KEYS[3], the band of
#: priority ARGV[2].   KEYS: the class's own queue, the bands index, the new band
_MOVE = f"""
local moved = {{}}
local lists = redis.call('ZRANGE', KEYS[2], 0, -1)
table.insert(lists, KEYS[1])
for _, key in ipairs(lists) do
  if key ~= KEYS[3] then
    for _, id in ipairs(redis.call('LRANGE', key, 0, -1)) do
      if string.sub(id, 1, #ARGV[1]) == ARGV[1] then
        redis.call('LREM', key, 1, id)
        table.insert(moved, id)
      end
    end
  end
end
for i = 1, #moved, 5000 do
  redis.call('RPUSH', KEYS[3], unpack(moved, i, math.min(i + 4999, #moved)))
end
if KEYS[3] ~= KEYS[1] and #moved > 0 then
  redis.call('ZADD', KEYS[2], ARGV[2], KEYS[3])
  if redis.call('LLEN', KEYS[1]) == 0 then
    for i = 1, math.min(#moved, tonumber(ARGV[3])) do redis.call('RPUSH', KEYS[1], '{_WAKE_ID}') end
  end
end
return #moved
"""

#: A worker's next task, moved (as rq's reliable dequeue does) onto its queue's intermediate
#: list: a task at the front of the class's own queue that is not a tile (an assembly, an
#: inspection, a wake), else the head of the highest band above 0, the class's own queue, the
#: bands below 0. Empty bands leave the index. KEYS: the class's own queue, the bands index.
#: Returns {queue key, task id} or nil.
_PICK = """
local function take(key)
  local id = redis.call('LMOVE', key, key .. ':intermediate', 'LEFT', 'RIGHT')
  if id then return {key, id} end
  return nil
end
local head = redis.call('LINDEX', KEYS[1], 0)
if head and string.sub(head, 1, 5) ~= 'tile-' then return take(KEYS[1]) end
local function bands(lo, hi)
  for _, key in ipairs(redis.call('ZREVRANGEBYSCORE', KEYS[2], hi, lo)) do
    local got = take(key)
    if got then return got end
    redis.call('ZREM', KEYS[2], key)
  end
  return nil
end
return bands('(0', '+inf') or take(KEYS[1]) or bands('-inf', '(0')
"""


class _BandedQueue(Queue):
    """rq's queue with the farm's dequeue: one worker listens to its class's queue only (so
    rq keeps its reliable dequeue and intermediate-list bookkeeping), and each take looks at
    the class's priority bands first (``_PICK``), in one step."""

    @classmethod
    def dequeue_any(
        cls,
        queues: Iterable[Queue],
        timeout: int | None,
        connection: Redis,
        job_class: Any = None,
        serializer: Any = None,
        death_penalty_class: Any = None,
    ) -> tuple[Job, Queue] | None:
        (base,) = queues
        pick = connection.register_script(_PICK)
        bands_key = keys.render_bands(base.name.removeprefix(keys.render_queue("")))
        while True:
            got = pick(keys=[base.key, bands_key])
            if got is None:
                if timeout is None:
                    return None
                got = cls.lmove(connection, base.key, timeout)  # raises DequeueTimeout
            queue_key, job_id = as_text(got[0]), as_text(got[1])
            if job_id == _WAKE_ID:
                connection.lrem(IntermediateQueue.get_intermediate_queue_key(queue_key), 1, job_id)
                continue
            fetched = cls._fetch_dequeued_job(
                connection, queue_key, job_id, job_class=job_class, serializer=serializer,
                death_penalty_class=death_penalty_class,
            )  # fmt: skip
            if fetched is not None:
                return fetched


class _FarmWorker(SimpleWorker):
    """rq's in-process worker (no fork per job: the Blender child must outlive each tile).

    rq's second signal is a cold shutdown: SystemExit raised wherever the task happens to be,
    between a tile's upload and its commit for instance. Here every signal goes to the farm's
    ``on_signal``, which ends the current task cleanly; rq only stops taking work.
    """

    on_signal: Callable[[int], None] | None = None
    #: False while the worker must take no task (an operator disabled it): it waits, idle
    may_take: Callable[[], bool] | None = None

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        if self.may_take is not None and not self.may_take():
            # idle, so a stop signal meanwhile raises StopRequested (rq's _shutdown)
            self.set_state(WorkerStatus.IDLE)
            self.procline("disabled by an operator: taking no tasks")  # type: ignore[no-untyped-call]
            while not self.may_take():
                if timeout is None:
                    return None  # burst: as if the queue were empty
                self.heartbeat()
                time.sleep(HOLD_POLL_S)
        return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)

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
    may_take: Callable[[], bool] | None = None,
) -> None:
    """Serve the device class's queue until stopped (SIGINT/SIGTERM) or, with ``burst``, empty.
    While ``may_take()`` is False the worker takes nothing (and stays registered).

    The first SIGINT/SIGTERM stops the worker taking work once the current task returns; every
    signal is also passed to ``on_signal``, which decides how long the current task may run.
    """
    worker = _FarmWorker(
        [_BandedQueue(keys.render_queue(device_class), connection=conn)],
        queue_class=_BandedQueue,
        name=name,
        connection=conn,
        maintenance_interval=MAINTENANCE_INTERVAL_S,
        worker_ttl=WORKER_TTL_S,
        log_job_description=False,
    )
    worker.on_signal = on_signal
    worker.may_take = may_take
    logging.getLogger("rq.worker").setLevel(log_level)
    guard(worker.work, burst=burst, logging_level=log_level, with_scheduler=False)


def live_workers(conn: Redis, device_class: str) -> int:
    """Render workers serving ``device_class``'s queue now: rq's registrations whose heartbeat
    key still lives (a worker killed outright drops out within WORKER_TTL_S)."""
    registered = list(guard(conn.smembers, WORKERS_BY_QUEUE_KEY % keys.render_queue(device_class)))
    if not registered:
        return 0
    pipe = conn.pipeline(transaction=False)
    for key in registered:
        pipe.exists(key)
    return sum(1 for alive in guard(pipe.execute) if alive)


def depths(conn: Redis) -> dict[str, int]:
    """Tasks waiting in each of the farm's queues (every queue rq knows named ``tessera-*``)."""
    out: dict[str, int] = {}
    for q in guard(Queue.all, connection=conn):
        if q.name.startswith(f"{keys.PREFIX}-"):
            # a priority band counts in its class's queue (one gauge per class)
            name = _BAND_NAME.sub("", q.name)
            out[name] = out.get(name, 0) + int(guard(_count, q))
    return out


def _count(q: Queue) -> int:
    return int(q.count)


def _rq_timeout(timeout_s: float) -> int:
    # The worker enforces the real limit by killing its Blender child; rq's own alarm is a
    # backstop well past it, so it never fires first.
    return int(timeout_s * 2 + 120)
