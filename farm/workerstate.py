"""The workers' registry in Redis: what each render worker and stream service is doing, its last
heartbeat, its tiles today, and whether an operator disabled it (drain)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from farm import keys, redisclock
from farm.errors import FarmError, NotFound
from farm.luafunctions import Library
from farm.redisclient import Redis, guard

if TYPE_CHECKING:
    from redis.client import Pipeline

log = logging.getLogger("tessera.workerstate")

#: the fields of a worker's current task, cleared together when it ends
TASK_FIELDS = ("task", "job", "project", "frame", "tile", "lease", "task_since")
#: how long a day's tile counters are kept (today's and yesterday's are read)
DAY_COUNTERS_TTL_S = 3 * 86400
#: names trimmed per beat at most: a beat's cost does not grow with the farm's history
TRIM_PER_BEAT = 10


class WorkerState(StrEnum):
    """What the workers page shows; derived at read time from the stored activity, the disabled
    flag and the age of the last beat (never stored, so it has no transitions of its own)."""

    IDLE = "idle"
    RENDERING = "rendering"
    ASSEMBLING = "assembling"
    INSPECTING = "inspecting"
    STREAMING = "streaming"
    DRAINING = "draining"  # disabled, finishing its current task
    DISABLED = "disabled"  # disabled and idle: takes no tasks until enabled
    SILENT = "silent"  # no heartbeat for FARM_WORKER_SILENT_S


#: activities a worker reports (the rest of WorkerState is derived)
ACTIVITIES = frozenset({"idle", "rendering", "assembling", "inspecting", "streaming"})


def state_of(activity: str, disabled: bool, age_s: float, silent_s: float) -> WorkerState:
    """The state shown for a worker: silence first, then the operator's flag, then its work."""
    if age_s > silent_s:
        return WorkerState.SILENT
    busy = activity not in ("", "idle")
    if disabled:
        return WorkerState.DRAINING if busy else WorkerState.DISABLED
    return WorkerState(activity) if activity in ACTIVITIES else WorkerState.IDLE


def utc_day(now_s: float) -> str:
    return str(int(now_s // 86400))


@dataclass(frozen=True)
class WorkerInfo:
    """One registry entry as read back (the API and the CLI show these fields)."""

    name: str
    kind: str  # render | stream
    host: str
    pid: int
    queue: str  # the render queue it serves (cpu, gpu); a stream service's device kind
    device_id: str
    device_class: str
    model: str
    state: WorkerState
    last_beat: float
    started: float
    task: str = ""  # tile | assembly | inspection | "N sessions"
    job: str = ""
    project: str = ""
    frame: int | None = None
    tile: int | None = None
    lease: str = ""
    task_since: float | None = None
    utilization_pct: int | None = None
    tiles_done_today: int = 0
    tiles_failed_today: int = 0
    disabled: bool = False
    disabled_by: str = ""

    @property
    def alive(self) -> bool:
        return self.state is not WorkerState.SILENT

    @property
    def takes_work(self) -> bool:
        """Alive and not disabled: would take a task of its queue."""
        return self.alive and not self.disabled

    @property
    def busy(self) -> bool:
        return self.state in (WorkerState.RENDERING, WorkerState.ASSEMBLING,
                              WorkerState.INSPECTING, WorkerState.DRAINING)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value}


#: Beat: KEYS[1] the worker's hash, KEYS[2] the registry, KEYS[3] the disabled hash.
#: ARGV: name, now (s), retention (s), then field/value pairs. Trims at most TRIM_PER_BEAT
#: names whose last beat is older than the retention, with their hashes and flags.
_BEAT = f"""
local fields = {{}}
for i = 4, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', KEYS[1], 'beat', ARGV[2], unpack(fields))
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3])))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
local before = '(' .. (tonumber(ARGV[2]) - tonumber(ARGV[3]))
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', before, 'LIMIT', 0, {TRIM_PER_BEAT})
for _, name in ipairs(old) do
  redis.call('ZREM', KEYS[2], name)
  redis.call('DEL', keys.worker(name))
  redis.call('HDEL', KEYS[3], name)
end
return #old
"""

#: A task's start where a key exists: KEYS[1] the worker's hash, KEYS[2] the key (the lease the
#: task runs under, granted by an earlier call of the same round trip). ARGV: field/value
#: pairs. 1 when written, 0 when the key is absent (the lease was not granted).
_START_TASK = f"""
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HDEL', KEYS[1], {", ".join(repr(f) for f in TASK_FIELDS)})
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

#: the beat as a Redis function (farm.luafunctions), so that a worker's beat can go in one
#: pipeline with its device agent's heartbeat without redis-py's SCRIPT EXISTS round trip (and
#: a task's start with the grant of its lease)
LIBRARY = Library("workerbeat", keys.lua("worker"), {"beat": _BEAT, "start_task": _START_TASK})


class WorkerRegistry:
    """Reads and writes the registry; one per process (a text-mode Redis client)."""

    def __init__(self, conn: Redis, *, silent_s: float, retention_s: float) -> None:
        self.conn = conn
        self.silent_s = silent_s
        self.retention_s = retention_s
        self._beat = LIBRARY.bind(conn, "beat")
        self._start_task = LIBRARY.bind(conn, "start_task")

    # --- a worker's own writes ------------------------------------------------------------------

    def beat(self, name: str, fields: dict[str, Any], now: float | None = None) -> None:
        """Publish ``name``'s identity and gauges (host, pid, device, utilisation...) as alive
        now: one function call, O(1) whatever the farm's size."""
        call = self._beat_call(name, fields, now)
        guard(self._beat, keys=call[0], args=call[1])

    def beat_in(
        self, pipe: Pipeline, name: str, fields: dict[str, Any], now: float | None = None
    ) -> Callable[[Any], None]:
        """``beat`` sent with ``pipe``; the function returned reads its reply (raises as
        ``beat`` does)."""
        call = self._beat_call(name, fields, now)
        self._beat.queue(pipe, keys=call[0], args=call[1])
        return lambda value: guard(self._beat.reply, value, keys=call[0], args=call[1])

    def _beat_call(
        self, name: str, fields: dict[str, Any], now: float | None
    ) -> tuple[list[str], list[Any]]:
        now = redisclock.now(self.conn) if now is None else now
        flat: list[str] = []
        for key, value in fields.items():
            flat += [key, "" if value is None else str(value)]
        return ([keys.worker(name), keys.WORKERS, keys.WORKERS_DISABLED],
                [name, now, self.retention_s, *flat])  # fmt: skip

    def start_task(self, name: str, activity: str, **task: Any) -> None:
        """``name`` began a task: ``activity`` (rendering...) and what (job, frame, tile...)."""
        pipe = self.conn.pipeline()
        pipe.hdel(keys.worker(name), *TASK_FIELDS)
        pipe.hset(keys.worker(name), mapping=self._task_fields(activity, task))
        guard(pipe.execute)

    def start_task_in(
        self, pipe: Pipeline, name: str, after: str, activity: str, **task: Any
    ) -> Callable[[Any], bool]:
        """``start_task`` sent with ``pipe``, done only where the key ``after`` exists when it
        runs (the lease the task runs under, granted by an earlier call of the pipeline); the
        function returned reads its reply: whether it was written (raises as ``beat``)."""
        flat = [v for pair in self._task_fields(activity, task).items() for v in pair]
        call = ([keys.worker(name), after], flat)
        self._start_task.queue(pipe, keys=call[0], args=call[1])
        return lambda value: bool(guard(self._start_task.reply, value, keys=call[0], args=call[1]))

    def _task_fields(self, activity: str, task: dict[str, Any]) -> dict[Any, Any]:
        fields = {"activity": activity, "task_since": str(redisclock.now(self.conn))}
        fields.update({k: "" if v is None else str(v) for k, v in task.items()})
        return fields

    def end_task(self, name: str, counts: Sequence[str] = ()) -> None:
        """``name`` is idle again; ``counts``: its task's outcomes for today's counters (see
        ``count``), in the same round trip."""
        pipe = self.conn.pipeline(transaction=False)
        self.end_task_in(pipe, name, counts)
        guard(pipe.execute)

    def end_task_in(self, pipe: Pipeline, name: str, counts: Sequence[str] = ()) -> None:
        """``end_task`` sent with ``pipe``: the worker's entry in one command (idle, its task's
        fields emptied, which readers take as absent), the counters after it."""
        idle: dict[Any, Any] = {"activity": "idle", **dict.fromkeys(TASK_FIELDS, "")}
        pipe.hset(keys.worker(name), mapping=idle)
        self._count(pipe, name, counts)

    def count(self, name: str, outcome: str) -> None:
        """One tile ``done`` or ``failed`` (a failure that counts) today."""
        pipe = self.conn.pipeline()
        self._count(pipe, name, [outcome])
        guard(pipe.execute)

    def _count(self, pipe: Pipeline, name: str, outcomes: Sequence[str]) -> None:
        if not outcomes:
            return
        day_key = keys.worker_tiles(name, utc_day(redisclock.now(self.conn)))
        for outcome in outcomes:
            pipe.hincrby(day_key, outcome, 1)
        pipe.expire(day_key, DAY_COUNTERS_TTL_S)

    def is_disabled(self, name: str) -> bool:
        return bool(guard(self.conn.hexists, keys.WORKERS_DISABLED, name))

    def is_disabled_in(self, pipe: Pipeline, name: str) -> None:
        """``is_disabled`` sent with ``pipe``; its reply is the flag (true when set)."""
        pipe.hexists(keys.WORKERS_DISABLED, name)

    def forget(self, name: str) -> None:
        """A worker that stops cleanly leaves the registry, with its disabled flag (names are
        unique per process: a later worker never inherits it)."""
        pipe = self.conn.pipeline()
        pipe.zrem(keys.WORKERS, name)
        pipe.delete(keys.worker(name))
        pipe.hdel(keys.WORKERS_DISABLED, name)
        guard(pipe.execute)

    # --- an operator's ----------------------------------------------------------------------

    def set_disabled(self, name: str, disabled: bool, by: str = "") -> WorkerInfo:
        """Disable (drain) or enable a listed worker; NotFound for a name not in the registry.
        A render worker finishes its task and takes no new one; a stream service starts no
        new session and its running ones continue (encoder.service)."""
        if guard(self.conn.zscore, keys.WORKERS, name) is None:
            raise NotFound(f"no worker {name!r} (`farm workers` lists them)", worker=name)
        if disabled:
            flag = json.dumps({"by": by, "at": redisclock.now(self.conn)})
            guard(self.conn.hset, keys.WORKERS_DISABLED, name, flag)
        else:
            guard(self.conn.hdel, keys.WORKERS_DISABLED, name)
        log.info("event=worker_%s worker=%s by=%s", "disabled" if disabled else "enabled",
                 name, by)  # fmt: skip
        found = self.get(name)
        assert found is not None
        return found

    # --- reading ------------------------------------------------------------------------------

    def get(self, name: str) -> WorkerInfo | None:
        return next((w for w in self.list([name]) if w.name == name), None)

    def list(self, names: list[str] | None = None) -> list[WorkerInfo]:
        """Every listed worker (or ``names``), by kind, queue and name."""
        now = redisclock.now(self.conn)  # the clock the beats were written with
        if names is None:
            names = list(guard(self.conn.zrange, keys.WORKERS, 0, -1))
        if not names:
            return []
        today = utc_day(now)
        pipe = self.conn.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(keys.worker(name))
            pipe.hmget(keys.worker_tiles(name, today), "done", "failed")
            pipe.hget(keys.WORKERS_DISABLED, name)
        replies = guard(pipe.execute)
        out = []
        for i, name in enumerate(names):
            raw, (done, failed), flag = replies[3 * i : 3 * i + 3]
            if not raw:
                continue  # trimmed, or gone between the two reads
            out.append(self._info(name, raw, done, failed, flag, now))
        return sorted(out, key=lambda w: (w.kind, w.queue, w.name))

    def _info(
        self, name: str, raw: dict[str, str], done: str | None, failed: str | None,
        flag: str | None, now: float,
    ) -> WorkerInfo:  # fmt: skip
        beat = float(raw.get("beat") or 0)
        disabled = flag is not None
        by = str(json.loads(flag).get("by", "")) if flag else ""
        return WorkerInfo(
            name=name,
            kind=raw.get("kind", "render"),
            host=raw.get("host", ""),
            pid=int(raw.get("pid") or 0),
            queue=raw.get("queue", ""),
            device_id=raw.get("device_id", ""),
            device_class=raw.get("device_class", ""),
            model=raw.get("model", ""),
            state=state_of(raw.get("activity", "idle"), disabled, now - beat, self.silent_s),
            last_beat=beat,
            started=float(raw.get("started") or 0),
            task=raw.get("task", ""),
            job=raw.get("job", ""),
            project=raw.get("project", ""),
            frame=_int(raw.get("frame")),
            tile=_int(raw.get("tile")),
            lease=raw.get("lease", ""),
            task_since=float(raw["task_since"]) if raw.get("task_since") else None,
            utilization_pct=_int(raw.get("utilization_pct")),
            tiles_done_today=int(done or 0),
            tiles_failed_today=int(failed or 0),
            disabled=disabled,
            disabled_by=by,
        )


def _int(text: str | None) -> int | None:
    return int(text) if text not in (None, "") else None


class Reporter:
    """One worker's writes to the registry as its tasks see them: never fails a task (a
    registry write that Redis refuses is logged; the next beat or task repairs the entry).
    Without a registry (tests building a worker's context by hand) it does nothing."""

    def __init__(self, registry: WorkerRegistry | None = None, name: str = "") -> None:
        self.registry, self.name = registry, name
        #: outcomes counted during the current activity, written with its end
        self._counts: list[str] | None = None

    def disabled_in(self, pipe: Pipeline) -> Callable[[Any], bool]:
        """Whether an operator disabled this worker, sent with ``pipe``; the function returned
        reads its reply: False when Redis cannot say (the task that asks has just been taken
        from Redis: it goes on)."""
        if self.registry is None:
            return lambda _reply: False
        self.registry.is_disabled_in(pipe, self.name)
        return lambda reply: not isinstance(reply, Exception) and bool(reply)

    @contextlib.contextmanager
    def activity(self, activity: str, **task: Any) -> Iterator[None]:
        """The block runs as the worker's current task (rendering a tile, assembling...)."""
        outer = self.begin(activity, **task)
        try:
            yield
        finally:
            counts, self._counts = self._counts or [], outer
            self._write(lambda r: r.end_task(self.name, counts))

    def begin(self, activity: str, **task: Any) -> list[str] | None:
        """The worker's current task from now on (end it with ``end_in``); returns the counts
        of an activity it runs within, which ``activity`` restores at its end."""
        self._write(lambda r: r.start_task(self.name, activity, **task))
        outer, self._counts = self._counts, []
        return outer

    def begin_in(
        self, pipe: Pipeline, after: str, activity: str, **task: Any
    ) -> Callable[[Sequence[Any]], None]:
        """``begin`` sent with ``pipe``, begun only where the key ``after`` exists when it runs
        (the lease the task runs under, granted by an earlier call of the pipeline); the
        function returned reads its replies, logging a refusal."""
        if self.registry is None:
            return lambda _replies: self._begun()
        written = self.registry.start_task_in(pipe, self.name, after, activity, **task)

        def read(replies: Sequence[Any]) -> None:
            try:
                if written(replies[0]):
                    self._begun()
            except FarmError as exc:
                # the task's outcomes are then counted on their own
                log.warning("event=registry_write_failed worker=%s error=%r", self.name,
                            exc.message)  # fmt: skip

        return read

    def _begun(self) -> None:
        self._counts = []

    def end_in(self, pipe: Pipeline) -> Callable[[list[Any]], None]:
        """The end of the activity ``begin`` started (not within another), with the outcomes
        counted during it, sent with ``pipe``; the function returned reads its replies (those
        from ``len(pipe)`` before this call to after it), logging a refusal."""
        counts, self._counts = self._counts or [], None
        if self.registry is None:
            return lambda _replies: None
        self.registry.end_task_in(pipe, self.name, counts)

        def read(replies: list[Any]) -> None:
            for reply in replies:
                if isinstance(reply, Exception):
                    log.warning("event=registry_write_failed worker=%s error=%r", self.name,
                                str(reply))  # fmt: skip
                    return

        return read

    def count(self, outcome: str) -> None:
        """One task's outcome in today's counters: with the activity's end where one runs (one
        round trip for both), else at once."""
        if self._counts is not None:
            self._counts.append(outcome)
            return
        self._write(lambda r: r.count(self.name, outcome))

    def _write(self, action: Callable[[WorkerRegistry], None]) -> None:
        if self.registry is None:
            return
        try:
            action(self.registry)
        except FarmError as exc:
            log.warning("event=registry_write_failed worker=%s error=%r", self.name, exc.message)


class Beacon:
    """A render worker's or a stream service's entry on the workers page, written with each
    beat of its device agent (``DeviceAgent.beside``: one round trip for both): identity and
    gauges (``gauges()``, e.g. the GPU's utilisation). The agent beats three times per
    timeout, so the page sees the process silent when the pool stops seeing its device."""

    def __init__(
        self,
        registry: WorkerRegistry,
        name: str,
        identity: dict[str, Any],
        gauges: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.registry, self.name, self.gauges = registry, name, gauges
        # on the clock its beats and their readers use: its age is their difference (a
        # ``started`` in ``identity`` is the process's own, read the same way)
        self.identity = {"started": redisclock.now(registry.conn), **identity}

    def beat_in(self, pipe: Pipeline) -> Callable[[Sequence[Any]], None]:
        """The beat sent with ``pipe``; the function returned reads its replies and logs a
        beat Redis refused (the page shows the worker silent meanwhile)."""
        try:
            gauges = self.gauges()
        except Exception as exc:  # a gauge (NVML) failing must not silence the worker
            log.warning("event=gauge_failed worker=%s error=%r", self.name, exc)
            gauges = {}
        wrote = self.registry.beat_in(pipe, self.name, {**self.identity, **gauges})

        def read(replies: Sequence[Any]) -> None:
            try:
                wrote(replies[0])
            except FarmError as exc:
                log.warning("event=beacon_failed worker=%s error=%r", self.name, exc.message)

        return read

    def forget(self) -> None:
        """The worker stops cleanly: its entry leaves the page."""
        try:
            self.registry.forget(self.name)
        except FarmError as exc:
            log.warning("event=beacon_forget_failed worker=%s error=%r", self.name, exc.message)


def _task_text(w: WorkerInfo) -> str:
    if not w.job:
        return w.task or "-"
    where = "".join(f" {k} {v}" for k, v in (("frame", w.frame), ("tile", w.tile)) if v is not None)
    return f"{w.task} {w.job}{where}"


def render_text(workers: list[WorkerInfo], now: float | None = None) -> list[str]:
    """The `farm workers` table: one line per worker."""
    now = time.time() if now is None else now
    lines = [
        f"{'WORKER':<32} {'KIND':<10} {'HOST':<16} {'DEVICE':<10} {'STATE':<10} {'BEAT':>6} "
        f"{'DONE':>5} {'FAIL':>5} {'GPU%':>5}  TASK"
    ]
    for w in workers:
        kind = f"{w.kind}/{w.queue}"
        util = "-" if w.utilization_pct is None else str(w.utilization_pct)
        lines.append(
            f"{w.name[:32]:<32} {kind:<10} {w.host[:16]:<16} {w.device_class[:10]:<10} "
            f"{w.state.value:<10} {max(0.0, now - w.last_beat):>5.0f}s {w.tiles_done_today:>5} "
            f"{w.tiles_failed_today:>5} {util:>5}  {_task_text(w)}"
        )
    return lines


def registry_for(conn: Redis, settings: Any) -> WorkerRegistry:
    """The registry with the settings' silence threshold and retention."""
    return WorkerRegistry(
        conn, silent_s=settings.worker_silent_s, retention_s=settings.worker_retention_s
    )
