"""The rq adapter: a render queue per device class, tile/assembly/inspection jobs, the worker.

This is the only module that imports rq. rq's own job status is not the record of a tile: the
farm's job store is (``farm.jobstore``); rq only carries the work to a worker.
"""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

from rq import Queue, SimpleWorker, Worker
from rq.exceptions import DequeueTimeout, StopRequested
from rq.executions import Execution
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.results import Result
from rq.utils import as_text, backend_class, now
from rq.worker import WorkerStatus
from rq.worker_registration import WORKERS_BY_QUEUE_KEY

from farm import keys, redisclient
from farm.errors import QueueError
from farm.models import BlendSource, TileTask
from farm.redisclient import Redis, guard
from farm.tags import band_suffix

if TYPE_CHECKING:
    from redis.client import Pipeline

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
#: the pick's answer to a worker an operator disabled
DISABLED = "disabled"
#: a worker's beat is skipped where the one before left its registration's expiry within this
#: many seconds of where the new one would set it (rq beats three times around every task)
BEAT_COALESCE_S = 1.0
#: how often a worker asks whether rq's workers are suspended (``rq suspend``; rq asks before
#: every take)
SUSPENSION_CHECK_S = 1.0
#: how long the pub/sub thread (rq's commands to a worker: stop a job, shut down) waits for a
#: message at a time, so also how long a stopping worker waits for that thread
PUBSUB_WAKE_S = 1.0


def connect(url: str) -> Redis:
    """A Redis client for rq (binary replies, as rq requires)."""
    return redisclient.connect(url, text=False)


class _FarmQueue(Queue):
    """rq's queue, refusing rq's dependencies between tasks: the farm's worker finishes a task
    without reading what depends on it (``_FarmWorker.handle_job_success``). A job's
    dependencies on other jobs are the farm's own (``farm.dependencies``), never rq's."""

    def create_job(self, *args: Any, **kwargs: Any) -> Job:
        if kwargs.get("depends_on") or (len(args) > 8 and args[8]):  # (rq: keyword or 9th)
            raise QueueError("the farm's queues take no rq dependencies between tasks "
                             "(a job waits for others through farm.dependencies)")  # fmt: skip
        return super().create_job(*args, **kwargs)


class RenderQueue:
    """The queue of one device class (``cpu``, ``gpu``, later ``t4``, ``l4``...)."""

    def __init__(self, conn: Redis, device_class: str) -> None:
        self.conn = conn
        self.device_class = device_class
        self.queue = _FarmQueue(keys.render_queue(device_class), connection=conn)
        self.bands_key = keys.render_bands(device_class)
        self._wake = conn.register_script(_WAKE)
        self._move = conn.register_script(_MOVE)

    def band(self, priority: int, tags: tuple[str, ...] = ()) -> Queue:
        """The rq queue holding the waiting tiles of one priority (0: the class's own queue)
        of the jobs with ``tags`` (a tag set's bands are its own: only workers with every tag
        of the set look into them, see ``_PICK``)."""
        if not priority and not tags:
            return self.queue
        return _FarmQueue(f"{self.queue.name}-p{priority}{band_suffix(tags)}", connection=self.conn)

    def stage_tiles(
        self,
        tasks: Iterable[TileTask],
        timeout_s: float,
        pipeline: Any = None,
        priority: int | None = None,
        tags: tuple[str, ...] = (),
    ) -> None:
        """Push tile attempts into their job's priority band (of its tags); with ``pipeline``
        the pushes join the caller's transaction. ``priority`` None: read each job's priority
        and tags (a retry, a requeue). An attempt named twice is pushed once: rq refuses an id
        twice in one push."""
        tasks = list({t.rq_id: t for t in tasks}.values())
        if priority is None:
            by_job: dict[tuple[int, tuple[str, ...]], list[TileTask]] = {}
            for t in tasks:
                by_job.setdefault(self._job_placement(t.job_id), []).append(t)
            for (p, job_tags), mine in by_job.items():
                self.stage_tiles(mine, timeout_s, pipeline, p, job_tags)
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
        band = self.band(priority, tags)
        pipe = pipeline if pipeline is not None else self.conn.pipeline()
        band.enqueue_many(datas, pipeline=pipe)
        if band is not self.queue:
            # workers waiting for work block on the class's own queue: ring it (for a tag set,
            # ring every live worker: one without the tags takes a wake and goes back to sleep;
            # a wake left over counts in the queue's depth, so no more than that)
            wanted = max(len(datas), live_workers(self.conn, self.device_class) if tags else 0)
            wakes = min(wanted, _MAX_WAKES)
            self._wake(
                keys=[self.queue.key, self.bands_key], args=[band.key, priority, wakes], client=pipe
            )
        if pipeline is None:
            guard(pipe.execute)

    def _job_placement(self, job_id: str) -> tuple[int, tuple[str, ...]]:
        """A job's priority and tags: which band its tiles wait in."""
        text = guard(self.conn.hget, keys.job(job_id), "spec")
        if text is None:
            return 0, ()
        spec = json.loads(text)
        return int(spec.get("priority", 0)), tuple(spec.get("tags", ()))

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
        self,
        source: BlendSource,
        reply_key: str,
        timeout_s: float,
        project: str,
        probe: bool = False,
    ) -> str:
        """Queue an inspection for ``project`` at the front; returns its rq id (for
        drop_waiting). The worker opens the file in a child of that project's only.
        ``probe``: it also renders the estimate's probe (farm.estimate)."""
        job: Job = guard(
            self.queue.enqueue_call,
            INSPECT_TASK,
            args=(source.to_dict(), reply_key, project, *((True,) if probe else ())),
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
        band = self.band(priority, self._job_placement(job_id)[1])
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
        for key, score in bands:
            if score == 0:  # a tag set's bands of priority 0
                out += [as_text(i) for i in guard(self.conn.lrange, key, 0, -1)]
        out += [i for i in ids[front:] if i != _WAKE_ID]
        for key, score in bands:
            if score < 0:
                out += [as_text(i) for i in guard(self.conn.lrange, key, 0, -1)]
        return out

    def ring(self) -> None:
        """Wake the class's idle workers (blocked on its own queue) to look at the bands
        again: a blocklist was cleared, so tiles they passed over may be theirs now."""
        if not guard(self.conn.llen, self.queue.key):
            guard(self.conn.rpush, self.queue.key, *([_WAKE_ID] * _MAX_WAKES))

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
_BAND_NAME = re.compile(r"-p-?\d+(~[^~]*)?$")
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

#: Lua: ``mark_taken(id, now, grace)`` notes in the job store that a worker took tile task
#: ``id`` (its attempt, still queued) and must start it by ``now + grace``: one that dies first
#: leaves it to the recovery sweep, which queues it again (farm.jobscripts.SWEEP). rq alone
#: would only mark the task failed, a minute or an hour later, and the tile would wait forever.
_MARK_TAKEN = """
local function mark_taken(id, now, grace)
  local jid, frame, index, attempt = string.match(id, '^tile%-(.+)%-(%d+)%-(%d+)%-(%d+)$')
  if not jid then return end
  local tk, name = keys.tiles(jid), frame .. ':' .. index
  if redis.call('HGET', tk, name) ~= 'queued' then return end
  if redis.call('HGET', tk, name .. ':a') ~= attempt then return end
  redis.call('HSET', tk, name .. ':t', attempt)
  redis.call('ZADD', keys.TILE_DEADLINES, now + grace, jid .. '|' .. name)
end
"""

#: The blocking take's mark (a BLMOVE cannot run a script): ARGV: task id, start grace (s).
_MARK = (
    keys.lua("tiles", "TILE_DEADLINES")
    + _MARK_TAKEN
    + """
local clock = redis.call('TIME')
mark_taken(ARGV[1], tonumber(clock[1]) + tonumber(clock[2]) / 1e6, tonumber(ARGV[2]))
return 1
"""
)

#: A worker's next task, moved (as rq's reliable dequeue does) onto its queue's intermediate
#: list: a task at the front of the class's own queue that is not a tile (an assembly, an
#: inspection, a wake), else the head of the highest band above 0, a tag set's band of 0, the
#: class's own queue, the bands below 0. Empty bands leave the index. A tile taken is marked so
#: (``mark_taken``).
#: A tag set's band (``...-p5~a+b``) is looked into only by a worker with every tag of it, and
#: only while each limited tag of it has a free slot (FARM_TAG_LIMITS: the slot is taken here,
#: in the same step, until the tile's lease would expire; renewed with it, freed at its end).
#: Tiles of jobs the worker is blocklisted for (KEYS[3]) are left where they are: the first
#: ARGV[4] of a band are looked at for one of another job.
#: A worker an operator disabled (its name in KEYS[4]) takes nothing: the flag is read here, in
#: the take's own round trip.
#: KEYS: the class's own queue, the bands index, the worker's blocklisted jobs, the disabled
#: workers.
#: ARGV: the worker's tags (comma-separated), the tag limits (JSON), slot lease (s), scan depth,
#: rq's prefix of a task's hash, the worker's name.
#: Returns {queue key, task id, the task's hash (HGETALL: rq's fetch, in the same step)}, nil,
#: or DISABLED.
_PICK = (
    keys.lua("tag_slots", "tiles", "TILE_DEADLINES")
    + _MARK_TAKEN
    + f"""
if ARGV[6] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[6]) == 1 then return '{DISABLED}' end
"""
    + """
local mine = {}
for t in string.gmatch(ARGV[1], '[^,]+') do mine[t] = true end
local limits = cjson.decode(ARGV[2])
local blocked = redis.call('SMEMBERS', KEYS[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local function tags_of(key)
  local out = {}
  local at = string.find(key, '~', 1, true)
  if at then
    for t in string.gmatch(string.sub(key, at + 1), '[^+]+') do table.insert(out, t) end
  end
  return out
end
local function open_to_me(key)
  for _, t in ipairs(tags_of(key)) do
    if not mine[t] then return false end
    if limits[t] then
      local slots = keys.tag_slots(t)
      redis.call('ZREMRANGEBYSCORE', slots, '-inf', '(' .. now)
      if redis.call('ZCARD', slots) >= tonumber(limits[t]) then return false end
    end
  end
  return true
end
local function is_blocked(id)
  for _, j in ipairs(blocked) do
    local prefix = 'tile-' .. j .. '-'
    if string.sub(id, 1, #prefix) == prefix then return true end
  end
  return false
end
local function take(key)
  local id = nil
  if #blocked == 0 then
    id = redis.call('LMOVE', key, key .. ':intermediate', 'LEFT', 'RIGHT')
  else
    for _, candidate in ipairs(redis.call('LRANGE', key, 0, tonumber(ARGV[4]) - 1)) do
      if not is_blocked(candidate) then
        redis.call('LREM', key, 1, candidate)
        redis.call('RPUSH', key .. ':intermediate', candidate)
        id = candidate
        break
      end
    end
  end
  if not id then return nil end
  mark_taken(id, now, tonumber(ARGV[3]))
  for _, t in ipairs(tags_of(key)) do
    if limits[t] then redis.call('ZADD', keys.tag_slots(t), now + tonumber(ARGV[3]), id) end
  end
  return {key, id, redis.call('HGETALL', ARGV[5] .. id)}
end
local head = redis.call('LINDEX', KEYS[1], 0)
if head and string.sub(head, 1, 5) ~= 'tile-' then return take(KEYS[1]) end
local function bands(lo, hi)
  for _, key in ipairs(redis.call('ZREVRANGEBYSCORE', KEYS[2], hi, lo)) do
    if open_to_me(key) then
      local got = take(key)
      if got then return got end
    end
    if redis.call('LLEN', key) == 0 then redis.call('ZREM', KEYS[2], key) end
  end
  return nil
end
return bands('(0', '+inf') or bands(0, 0) or take(KEYS[1]) or bands('-inf', '(0')
"""
)

#: how many waiting tiles of a band a blocklisted worker looks past for one it may take
BLOCKED_SCAN_DEPTH = 200
#: seconds a worker waits before it looks again, when the only waiting tiles of its own
#: queue are of jobs it is blocklisted for (it cannot block on the queue: it would take them)
BLOCKED_RETRY_S = 1.0


class WorkerDisabled(Exception):
    """The pick's answer to a worker an operator disabled: it takes nothing (``_FarmWorker``
    holds it, idle)."""


@dataclass(frozen=True)
class Picker:
    """What one worker's pick needs to know of it: its name (its blocklist, its disabled flag),
    its tags and the farm's tag limits, and how long a tag's slot lasts unless renewed (the
    tile lease)."""

    worker: str = ""
    tags: frozenset[str] = frozenset()
    limits: dict[str, int] = field(default_factory=dict)
    slot_lease_s: float = 15.0


class _BandedQueue(_FarmQueue):
    """rq's queue with the farm's dequeue: one worker listens to its class's queue only (so
    rq keeps its reliable dequeue and intermediate-list bookkeeping), and each take looks at
    the class's priority bands first (``_PICK``), in one step."""

    picker = Picker()

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
        pick, mark = connection.register_script(_PICK), connection.register_script(_MARK)
        bands_key = keys.render_bands(base.name.removeprefix(keys.render_queue("")))
        me = cls.picker
        blocked_key = keys.worker_blocked(me.worker)
        tags = ",".join(sorted(me.tags))
        args: list[str | float] = [tags, json.dumps(me.limits), me.slot_lease_s, BLOCKED_SCAN_DEPTH,
                                   Job.redis_job_namespace_prefix, me.worker]  # fmt: skip
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            blocking_take = False
            got = pick(keys=[base.key, bands_key, blocked_key, keys.WORKERS_DISABLED], args=args)
            if isinstance(got, bytes) and as_text(got) == DISABLED:
                raise WorkerDisabled(me.worker)
            if got is None:
                if deadline is None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DequeueTimeout(timeout, base.key)
                if connection.llen(base.key):
                    # only tiles this worker is blocklisted for wait on its own queue: a
                    # blocking take would take them, so look again a little later
                    time.sleep(min(BLOCKED_RETRY_S, left))
                    continue
                got = cls.lmove(connection, base.key, max(1, int(left)))  # raises DequeueTimeout
                blocking_take = True
            queue_key, job_id = as_text(got[0]), as_text(got[1])
            if job_id == _WAKE_ID:
                connection.lrem(IntermediateQueue.get_intermediate_queue_key(queue_key), 1, job_id)
                continue
            if blocking_take and job_id.startswith("tile-"):
                # what the pick does itself: pass over a tile of a job this worker is
                # blocklisted for (back to the front, untouched, no attempt counted), and
                # mark the take
                if connection.sismember(blocked_key, _job_of(job_id)):
                    pipe = connection.pipeline()
                    pipe.lrem(IntermediateQueue.get_intermediate_queue_key(queue_key), 1, job_id)
                    pipe.lpush(queue_key, job_id)
                    pipe.execute()
                    continue
                mark(args=[job_id, me.slot_lease_s])
            if blocking_take:
                fetched = cls._fetch_dequeued_job(
                    connection, queue_key, job_id, job_class=job_class, serializer=serializer,
                    death_penalty_class=death_penalty_class,
                )  # fmt: skip
            else:
                fetched = cls._restore_picked(
                    connection, queue_key, job_id, got[2], job_class, serializer,
                    death_penalty_class,
                )  # fmt: skip
            if fetched is not None:
                return fetched

    @classmethod
    def _restore_picked(
        cls,
        connection: Redis,
        queue_key: str,
        job_id: str,
        fields: list[bytes],
        job_class: Any,
        serializer: Any,
        death_penalty_class: Any,
    ) -> tuple[Job, Queue] | None:
        """rq's ``_fetch_dequeued_job`` from the hash the pick read with its take (one round
        trip a task less): None where the task's hash is gone, as rq's."""
        if not fields:
            return None
        job_cls: type[Job] = backend_class(cls, "job_class", override=job_class)
        queue = cls.from_queue_key(queue_key, connection=connection, job_class=job_cls,
                                   serializer=serializer,
                                   death_penalty_class=death_penalty_class)  # fmt: skip
        job = job_cls(job_id, connection=connection, serializer=serializer)
        job.restore(dict(zip(fields[::2], fields[1::2], strict=True)))
        return job, queue


def _job_of(task_id: str) -> str:
    """The job id of a tile's rq id (``tile-JOB-frame-index-attempt``); '' for other tasks."""
    if not task_id.startswith("tile-"):
        return ""
    return task_id.removeprefix("tile-").rsplit("-", 3)[0]


class _TaskJob(Job):
    """rq's job, deleted after its success in the worker's own transaction.

    The farm's tasks keep no result (``result_ttl=0``): rq then deletes a finished task with
    ``Job.delete``, which first reads the task's status and, twice, its executions (seven round
    trips, a third of a task's), to find what the worker already knows: the task ran once, in
    the execution the worker cleans up in the same transaction. Here the task's keys go in that
    transaction, with its execution index; anything else (a rate limit, a group, a delete
    outside the success path) is rq's."""

    def cleanup(
        self, ttl: int | None = None, pipeline: Pipeline | None = None,
        remove_from_queue: bool = True,
    ) -> None:  # fmt: skip
        rqs = ttl != 0 or remove_from_queue or self.has_rate_limit or bool(self.group_id)
        if pipeline is None or rqs:
            super().cleanup(ttl, pipeline, remove_from_queue)
            return
        result_key = Result.get_key(self.id)  # type: ignore[no-untyped-call]
        others = (self.dependents_key, self.dependencies_key, self.execution_registry.key)
        pipeline.delete(self.key, result_key, *others)


class _FarmWorker(SimpleWorker):
    """rq's in-process worker (no fork per job: the Blender child must outlive each tile).

    rq's second signal is a cold shutdown: SystemExit raised wherever the task happens to be,
    between a tile's upload and its commit for instance. Here every signal goes to the farm's
    ``on_signal``, which ends the current task cleanly; rq only stops taking work.
    """

    on_signal: Callable[[int], None] | None = None
    #: the clock of the beats' and the suspension check's spacing (seconds)
    clock = staticmethod(time.monotonic)
    #: when (``clock``) the registration's expiry, as the last beat set it, falls
    _alive_until = -math.inf
    #: the state this worker last wrote itself (None: unknown, a caller's pipeline wrote it)
    _state_written: str | None = None
    #: when (``clock``) it last asked whether rq's workers are suspended
    _suspension_checked = -math.inf
    #: the execution's record, written with the task's start (prepare_job_execution)
    _held: Pipeline | None = None

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """rq's, held while an operator has disabled the worker (the pick says so): it takes
        nothing, asks again every HOLD_POLL_S (each ask is a pick, one round trip, with rq's
        beat when due) and stays idle, so a stop signal meanwhile raises StopRequested
        (``_farm_stop``). In burst mode a disabled worker finds the queue as if empty."""
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except WorkerDisabled:
                if timeout is None:
                    return None
                self.procline("disabled by an operator: taking no tasks")  # type: ignore[no-untyped-call]
                time.sleep(HOLD_POLL_S)

    def heartbeat(self, timeout: int | None = None, pipeline: Pipeline | None = None) -> None:
        """rq's heartbeat (the registration's date and two expiries) in one round trip, not
        three, and none where the beat before left the registration's expiry within
        BEAT_COALESCE_S of where this one would set it: rq beats three times around a task."""
        ttl = timeout or self.worker_ttl + 60
        until = self.clock() + ttl
        if pipeline is not None:
            super().heartbeat(timeout, pipeline=pipeline)
            self._alive_until = until
            return
        if abs(until - self._alive_until) < BEAT_COALESCE_S:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipeline=pipe)
            pipe.execute()
        self._alive_until = until

    def set_state(self, state: str, pipeline: Pipeline | None = None) -> None:
        """rq's, with no write where it last wrote that state itself (rq sets ``idle`` after a
        task and again before the next take)."""
        if pipeline is None and state == self._state_written:
            self._state = state
            return
        super().set_state(state, pipeline)
        # a write in a caller's pipeline lands when the caller executes it, or never
        self._state_written = state if pipeline is None else None

    def prepare_execution(self, job: Job) -> Execution:
        """rq's (the task's execution record, the worker busy), held for the task's start
        (``prepare_job_execution``) to send in the same transaction: rq sends the two back to
        back, a round trip apart."""
        pipe = self.connection.pipeline()
        execution = Execution.create(job, self.get_heartbeat_ttl(job), pipeline=pipe,
                                     worker_name=self.name)  # fmt: skip
        self.executions[execution.id] = execution
        self.set_state(WorkerStatus.BUSY, pipeline=pipe)
        self._held = pipe
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """rq's (the beats, the task started, out of the intermediate list), with the
        execution's record ``prepare_execution`` held, in one transaction."""
        held, self._held = self._held, None
        if held is None:
            super().prepare_job_execution(job, remove_from_intermediate_queue)
            return
        with held as pipe:
            ttl = self.get_heartbeat_ttl(job)
            self.heartbeat(ttl, pipeline=pipe)
            job.heartbeat(now(), ttl, pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
            if remove_from_intermediate_queue:
                origin = Queue(job.origin, connection=self.connection)
                pipe.lrem(origin.intermediate_queue_key, 1, job.id)
            pipe.execute()
        self._state_written = WorkerStatus.BUSY
        self.procline(f"Processing {job.func_name} from {job.origin} since {time.time()}")  # type: ignore[no-untyped-call]

    def handle_job_success(
        self, job: Job, queue: Queue, started_job_registry: Any, execution: Execution
    ) -> None:
        """rq's, in one transaction with the worker's return to idle and its idle beat (rq
        writes each in a round trip of its own as it takes the next task), and without reading
        what depends on the task (rq's WATCH and SMEMBERS of its dependents, two round trips):
        the farm's queues refuse rq dependencies (``_FarmQueue``). A task whose result rq is to
        keep, that repeats or that is rate-limited is rq's."""
        if (job.get_result_ttl(self.default_result_ttl) != 0 or job.repeats_left is not None
                or job.has_rate_limit):  # fmt: skip
            super().handle_job_success(job, queue, started_job_registry, execution)
            return
        assert job.started_at is not None and job.ended_at is not None
        with self.connection.pipeline() as pipe:
            self.increment_successful_job_count(pipeline=pipe)
            self.increment_total_working_time(job.ended_at - job.started_at, pipe)
            job.cleanup(0, pipeline=pipe, remove_from_queue=False)
            job._status = JobStatus.FINISHED
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            self.set_state(WorkerStatus.IDLE, pipeline=pipe)
            self.heartbeat(pipeline=pipe)
            pipe.execute()
        self._state_written = WorkerStatus.IDLE
        self.log.info("Successfully completed job %s in %ss on worker %s", job.id,
                      job.ended_at - job.started_at, self.name)  # fmt: skip

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        """rq's, with the task's beat only where a callback is to run: the beat gives the
        callback its time before the task counts as abandoned, and without one the success's
        (or failure's) records follow at once. The farm's tasks have no callbacks."""
        if job.success_callback is not None or job.failure_callback is not None:
            super().handle_execution_ended(job, queue, heartbeat_ttl)
            return
        job.ended_at = now()

    def clean_registries(self) -> None:
        """rq's registry maintenance, by one worker of the farm per MAINTENANCE_INTERVAL_S.

        rq's own lock only keeps two cleanings apart: it is released when a cleaning ends, so
        every worker whose own interval has passed cleans again, and a cleaning reads every
        worker's registration. With N workers that is N/10 cleanings a second of O(N) reads
        each (a simulated farm of 10,000 devices never got through its warm-up). Here the
        interval's lock is held until it expires."""
        queues = ",".join(self.queue_names())
        if self.connection.set(keys.rq_maintenance(queues), self.name, nx=True,
                               ex=MAINTENANCE_INTERVAL_S):  # fmt: skip
            super().clean_registries()  # type: ignore[no-untyped-call]
        else:
            self.last_cleaned_at = now()  # type: ignore[assignment]

    def check_for_suspension(self, burst: bool) -> None:
        """rq's (``rq suspend`` holds the worker), asked at most every SUSPENSION_CHECK_S, not
        before every take."""
        at = self.clock()
        if at - self._suspension_checked < SUSPENSION_CHECK_S:
            return
        super().check_for_suspension(burst)
        self._suspension_checked = self.clock()

    def subscribe(self) -> None:
        """rq's, with a pub/sub thread that wakes every PUBSUB_WAKE_S instead of 60 s.

        rq unsubscribes, then stops the thread. Once the unsubscription's reply is read the
        thread waits for a new subscription, rq's sleep_time at a time, and redis-py from 8.2
        joins the thread in ``stop()`` without a timeout: a worker stopped right after a task
        hung up to 60 s (SIGTERM, ``--burst``; measured in test_scheduling_e2e)."""
        self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
        pubsub = self.connection.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
        pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
        self.pubsub = pubsub
        # (rq declares the attribute None)
        self.pubsub_thread = pubsub.run_in_thread(  # type: ignore[assignment]
            sleep_time=PUBSUB_WAKE_S, daemon=True,
            exception_handler=self._pubsub_exception_handler,
        )  # fmt: skip

    def _install_signal_handlers(self) -> None:
        signal.signal(signal.SIGINT, self._farm_stop)
        signal.signal(signal.SIGTERM, self._farm_stop)

    def _farm_stop(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: flags only. It runs between any two bytecodes of the main
        thread, which may hold the lock of the Redis pool's queue at that moment, so rq's own
        (`_shutdown`, which writes the request's date to Redis) could wait on itself for ever."""
        first = not self._stop_requested and self._shutdown_requested_date is None
        if self.on_signal is not None:
            self.on_signal(signum)
        if first:
            self._shutdown_requested_date = now()
            # the loop stops before its next take, even where an idle wait swallowed the raise
            self._stop_requested = True
            if self.get_state() != WorkerStatus.BUSY:
                raise StopRequested()  # out of an idle take now


def build_worker(
    conn: Redis,
    device_class: str,
    name: str,
    picker: Picker | None = None,
    worker_class: type[_FarmWorker] = _FarmWorker,
    job_class: type[Job] = _TaskJob,
    queue_base: type[_BandedQueue] = _BandedQueue,
) -> _FarmWorker:
    """The worker ``run_worker`` runs (bench/rq_task.py builds one with rq's own bookkeeping
    beside it)."""
    # the queue class carries the worker's pick (its blocklist, tags and the tag limits)
    queue_class = type("_WorkerQueue", (queue_base,), {"picker": picker or Picker(name)})
    return worker_class(
        [queue_class(keys.render_queue(device_class), connection=conn)],
        queue_class=queue_class,
        name=name,
        connection=conn,
        maintenance_interval=MAINTENANCE_INTERVAL_S,
        worker_ttl=WORKER_TTL_S,
        job_class=job_class,
        log_job_description=False,
    )


def run_worker(
    conn: Redis,
    device_class: str,
    name: str,
    *,
    burst: bool = False,
    log_level: str = "INFO",
    on_signal: Callable[[int], None] | None = None,
    picker: Picker | None = None,
) -> None:
    """Serve the device class's queue until stopped (SIGINT/SIGTERM) or, with ``burst``, empty.
    While an operator has disabled the worker (``farm workers disable``) it takes nothing (and
    stays registered).

    The first SIGINT/SIGTERM stops the worker taking work once the current task returns; every
    signal is also passed to ``on_signal``, which decides how long the current task may run.
    """
    worker = build_worker(conn, device_class, name, picker)
    worker.on_signal = on_signal
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


def live_worker_names(conn: Redis, device_class: str) -> list[str]:
    """The names of the render workers serving ``device_class``'s queue now."""
    registered = [as_text(k) for k in guard(conn.smembers, WORKERS_BY_QUEUE_KEY
                                            % keys.render_queue(device_class))]  # fmt: skip
    if not registered:
        return []
    pipe = conn.pipeline(transaction=False)
    for key in registered:
        pipe.exists(key)
    alive = guard(pipe.execute)
    return [k.removeprefix(Worker.redis_worker_namespace_prefix)
            for k, a in zip(registered, alive, strict=True) if a]  # fmt: skip


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
