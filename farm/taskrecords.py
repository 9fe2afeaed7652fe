"""Per-task records of a job: which worker rendered each attempt of a tile (or sample part),
when, for how long, with how much memory, and why it failed; the job's ETA from them.

A record is one field of the job's tiles hash, ``frame:index:r<attempt>`` (JSON), beside the
tile's state: it lives and is trimmed with the job's tiles, and every reader of tile states
skips it (they take the ``frame:index`` fields only). Records are what a worker says about its
own attempt, written by the job store's compare-and-set that starts the tile (in the same step,
``TaskRecords.start``) or after the one that moved it: they inform, they never decide
anything.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from farm import keys
from farm.luafunctions import Library
from farm.models import TileTask
from farm.redisclient import Redis, guard

#: written only while the tile still has a state: a late record never recreates a trimmed job
_WRITE = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
  return 1
end
return 0
"""


#: the write as a Redis function (farm.luafunctions), so that it goes in one pipeline with a
#: worker's other writes as its task starts or ends
LIBRARY = Library("taskrecords", "", {"write": _WRITE})


def _write_call(task: TileTask, record: Attempt) -> tuple[list[str], list[str]]:
    """The keys and arguments of the write of ``record``."""
    return [keys.tiles(task.job_id)], [task.key, _field(task), json.dumps(asdict(record))]


@dataclass(frozen=True)
class Attempt:
    """One attempt of one task, as its worker reported it."""

    attempt: int
    worker: str
    #: the device it rendered on, as the worker names it ("GPU 0 (NVIDIA A100)", "CPU")
    device: str
    started_s: float
    ended_s: float | None = None
    #: Blender's render time of the tile (without loading, storing), s
    render_s: float | None = None
    #: Blender's reported peak memory of the render, MiB
    peak_memory_mib: float | None = None
    #: rendering, done, failed (counted against the tile), requeued (not counted)
    outcome: str = "rendering"
    #: the short cause of a failure (farm.failures), "" otherwise
    cause: str = ""
    #: the attempt left a log (web: /api/jobs/{job}/tiles/{frame}/{tile}/attempts/{n}/log)
    logged: bool = False
    #: the allocator's class of the device ("cpu", "t4", "a100"): the estimate's actual
    device_class: str = ""
    #: CPU time the Blender child spent in the render, s (all its threads; on a CPU device
    #: what the render cost whatever else the host ran, the benchmark's load-free figure)
    cpu_s: float | None = None

    @property
    def duration_s(self) -> float | None:
        return None if self.ended_s is None else max(0.0, self.ended_s - self.started_s)


@dataclass(frozen=True)
class TaskRow:
    """A task of the job (a tile of a frame, or a sample part) and its attempts, oldest first."""

    frame: int
    index: int
    state: str
    attempt: int
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


def _field(task: TileTask) -> str:
    return f"{task.key}:r{task.attempt}"


class TaskRecords:
    """Reads and writes the records of one farm's jobs."""

    def __init__(self, conn: Redis) -> None:
        self.conn = conn
        self._write = LIBRARY.bind(conn, "write")

    def started(
        self, task: TileTask, worker: str, device: str, now: float, device_class: str = ""
    ) -> Attempt:
        """The attempt began; returns its record (give it to ``ended``: no read then)."""
        record = Attempt(task.attempt, worker, device, now, device_class=device_class)
        self._put(task, record)
        return record

    def start(
        self, task: TileTask, worker: str, device: str, now: float, device_class: str = ""
    ) -> tuple[Attempt, tuple[str, str]]:
        """The attempt's start record, and the field and value that store it, for the job
        store to write as it starts the tile (``JobStore.start_tile``: in the same step)."""
        record = Attempt(task.attempt, worker, device, now, device_class=device_class)
        return record, (_field(task), json.dumps(asdict(record)))

    def ended(
        self,
        task: TileTask,
        now: float,
        outcome: str,
        *,
        started: Attempt | None = None,
        **fields: Any,
    ) -> None:
        """The attempt ended: ``render_s``, ``peak_memory_mib``, ``cause``, ``logged``.

        ``started``: the record ``started`` returned for this attempt, where the caller kept
        it; without it the record is read back (one more round trip a task)."""
        self._put(task, self._ended(task, now, outcome, started, fields))

    def ended_in(
        self,
        pipe: Any,
        task: TileTask,
        now: float,
        outcome: str,
        *,
        started: Attempt | None = None,
        **fields: Any,
    ) -> Callable[[Any], None]:
        """``ended`` sent with ``pipe``; the function returned reads the reply for it. Without
        ``started`` the record is read back first, in a round trip of its own."""
        return self._put_in(pipe, task, self._ended(task, now, outcome, started, fields))

    def _ended(
        self, task: TileTask, now: float, outcome: str, started: Attempt | None,
        fields: dict[str, Any],
    ) -> Attempt:  # fmt: skip
        if started is None:
            text = guard(self.conn.hget, keys.tiles(task.job_id), _field(task))
            started = _attempt(json.loads(text)) if text else None
        if started is not None:
            return replace(started, ended_s=now, outcome=outcome, **fields)
        # started before records were kept, or its start was not written
        return Attempt(task.attempt, "", "", now, now, outcome=outcome, **fields)

    def _put(self, task: TileTask, record: Attempt) -> None:
        guard(self._write, *_write_call(task, record))

    def _put_in(self, pipe: Any, task: TileTask, record: Attempt) -> Callable[[Any], None]:
        call = _write_call(task, record)
        self._write.queue(pipe, *call)
        return lambda reply: guard(self._write.reply, reply, *call)

    def rows(self, job_id: str) -> list[TaskRow]:
        """Every task of the job with its attempts, by frame and index (empty once trimmed)."""
        raw: dict[str, str] = guard(self.conn.hgetall, keys.tiles(job_id))
        return rows_of(raw)


def _attempt(data: dict[str, Any]) -> Attempt:
    names = Attempt.__dataclass_fields__
    return Attempt(**{k: v for k, v in data.items() if k in names})


def rows_of(raw: dict[str, str]) -> list[TaskRow]:
    """The task rows of a tiles hash's fields."""
    records: dict[str, list[Attempt]] = {}
    for name, value in raw.items():
        head, sep, tail = name.rpartition(":r")
        if sep and head.count(":") == 1 and tail.isdigit():
            records.setdefault(head, []).append(_attempt(json.loads(value)))
    out = []
    for name, state in raw.items():
        if name.count(":") != 1:
            continue
        frame, index = name.split(":")
        attempts = sorted(records.get(name, []), key=lambda a: a.attempt)
        out.append(TaskRow(int(frame), int(index), state, int(raw.get(name + ":a", 1)), attempts))
    out.sort(key=lambda r: (r.frame, r.index))
    return out


# --- figures from the records (pure) ------------------------------------------------------------


@dataclass(frozen=True)
class FrameTime:
    frame: int
    #: Blender's render time of the frame's committed tasks, summed (s of device time)
    render_s: float
    #: first start to last end of the frame's committed tasks (s of wall time)
    wall_s: float


@dataclass(frozen=True)
class Progress:
    tasks_total: int
    tasks_done: int
    #: median wall time of a done task's committed attempt (start to end), s
    median_task_s: float | None
    #: workers rendering the job's tasks now (at least 1 while tasks remain and one was seen)
    workers: int
    #: median_task_s x tasks left / workers; None until a task is done or once none is left
    eta_s: float | None
    frames: list[FrameTime]


def progress(rows: Iterable[TaskRow]) -> Progress:
    """The job's ETA and per-frame times from its done tasks.

    ETA = median task time x tasks not done / workers on the job now: a rendering task counts
    as a whole task left (simple and slightly pessimistic). Workers are the distinct workers
    with a task of the job rendering; with none rendering (all waiting for a device), the
    workers that rendered a task of the job before, at least 1.
    """
    rows = list(rows)
    done = [r for r in rows if r.state == "done"]
    durations = [
        d for r in done if (a := _committed(r)) is not None and (d := a.duration_s) is not None
    ]
    median = statistics.median(durations) if durations else None
    rendering = {a.worker for r in rows if r.state == "rendering" and (a := r.last) and a.worker}
    ever = {a.worker for r in rows for a in r.attempts if a.worker}
    workers = len(rendering) or max(1, len(ever))
    left = len(rows) - len(done)
    eta = median * left / workers if median is not None and left > 0 else None
    by_frame: dict[int, list[Attempt]] = {}
    complete: dict[int, bool] = {}
    for r in rows:
        a = _committed(r) if r.state == "done" else None
        complete[r.frame] = complete.get(r.frame, True) and a is not None
        if a is not None:
            by_frame.setdefault(r.frame, []).append(a)
    frames = []
    for frame, attempts in sorted(by_frame.items()):
        ended = [a.ended_s for a in attempts if a.ended_s is not None]
        if not complete[frame] or not ended:
            continue
        frames.append(
            FrameTime(
                frame,
                round(sum(a.render_s or 0.0 for a in attempts), 3),
                round(max(ended) - min(a.started_s for a in attempts), 3),
            )
        )
    return Progress(len(rows), len(done), median, workers, eta, frames)


def _committed(row: TaskRow) -> Attempt | None:
    """The attempt whose output the tile committed (its current one, once done)."""
    for a in reversed(row.attempts):
        if a.attempt == row.attempt and a.outcome == "done":
            return a
    return None
