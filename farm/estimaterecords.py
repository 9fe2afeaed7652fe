"""What the farm keeps of its estimates: each job's estimate and, once it is done, its actual
render time and error; the farm-wide stream of those errors; the speed ratios between device
classes that finished jobs measure.

A job's estimate and its check are fields of the job's hash (``estimate``,
``estimate_actual``), so they live as long as its summary does (farm.jobstore's retention).
The error stream is capped at FARM_ESTIMATE_ERRORS_MAX entries; the ratios are two numbers per
pair of classes. The records inform: a failure to write one is logged by the caller and the
job goes on.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from farm import keys
from farm.estimate import Estimate
from farm.models import JobStatus
from farm.redisclient import Redis, guard
from farm.taskrecords import Attempt, TaskRecords, TaskRow, progress

#: the fields of a job's hash
ESTIMATE_FIELD = "estimate"
ACTUAL_FIELD = "estimate_actual"


@dataclass(frozen=True)
class Check:
    """A done job's estimate against what its tasks took."""

    device_class: str
    """The class most of its tasks rendered on."""
    estimated_s: float
    """The estimate's render device-seconds on that class."""
    actual_s: float
    """Blender's render time of the committed tasks on that class, summed."""
    error: float
    """(estimated - actual) / actual: +0.1 is an estimate 10 % too long."""
    frames: int
    probe_class: str
    ratio_source: str
    ts: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def save(conn: Redis, job_id: str, est: Estimate) -> None:
    """Keep the estimate shown at submission with the job."""
    guard(conn.hset, keys.job(job_id), ESTIMATE_FIELD, json.dumps(est.to_dict()))


def of_job(conn: Redis, job_id: str) -> tuple[Estimate | None, Check | None]:
    """The job's estimate and its check (None where there is none)."""
    est_text, check_text = guard(conn.hmget, keys.job(job_id), [ESTIMATE_FIELD, ACTUAL_FIELD])
    est = Estimate.from_dict(json.loads(est_text)) if est_text else None
    check = Check(**json.loads(check_text)) if check_text else None
    return est, check


def committed(row: TaskRow) -> Attempt | None:
    """The attempt whose output the done task committed."""
    if row.state != "done":
        return None
    return next((a for a in row.attempts if a.attempt == row.attempt and a.outcome == "done"), None)


def actual_by_class(rows: Iterable[TaskRow]) -> dict[str, float]:
    """Render seconds of the committed tasks by the class they rendered on."""
    out: dict[str, float] = {}
    for row in rows:
        a = committed(row)
        if a is not None and a.render_s is not None:
            out[a.device_class or "?"] = out.get(a.device_class or "?", 0.0) + a.render_s
    return out


def check(est: Estimate, rows: list[TaskRow], now: float) -> Check | None:
    """The estimate against the job's done tasks; None when no class of it rendered them."""
    by_class = actual_by_class(rows)
    if not by_class:
        return None
    device_class, actual = max(by_class.items(), key=lambda kv: kv[1])
    shown = est.on(device_class)
    if shown is None or actual <= 0:
        return None
    frames = len(progress(rows).frames)
    return Check(
        device_class=device_class,
        estimated_s=shown.render_s,
        actual_s=round(actual, 4),
        error=round((shown.render_s - actual) / actual, 4),
        frames=frames,
        probe_class=est.probe_class,
        ratio_source=shown.ratio_source,
        ts=now,
    )


def record(
    conn: Redis, job_id: str, project: str, rows: list[TaskRow], now: float, keep: int
) -> Check | None:
    """Check a done job's estimate once: keep the check with the job, add it to the error
    stream (the newest ``keep``), and, where it rendered on another class than the probe's,
    add its ratio to the farm's. None when the job had no estimate (or was checked)."""
    est, done = of_job(conn, job_id)
    if est is None or done is not None:
        return None
    found = check(est, rows, now)
    if found is None:
        return None
    if not guard(conn.hsetnx, keys.job(job_id), ACTUAL_FIELD, json.dumps(found.to_dict())):
        return None  # another assembler checked it first
    pipe = conn.pipeline(transaction=False)
    entry = {"job": job_id, "project": project, **found.to_dict()}
    pipe.xadd(keys.ESTIMATE_ERRORS, {k: str(v) for k, v in entry.items()}, maxlen=keep)
    probed = est.on(est.probe_class)
    if found.device_class != est.probe_class and probed is not None and probed.render_s > 0:
        pair = f"{est.probe_class}>{found.device_class}"
        pipe.hincrbyfloat(keys.ESTIMATE_RATIOS, f"{pair}|log",
                          math.log(found.actual_s / probed.render_s))  # fmt: skip
        pipe.hincrby(keys.ESTIMATE_RATIOS, f"{pair}|n", 1)
    guard(pipe.execute)
    return found


def settled(conn: Redis, status: JobStatus, now: float, keep: int) -> JobStatus:
    """``status`` with its estimate checked: a done job's reader does not wait for the worker
    that finished it to write the check (whoever is first writes it, once)."""
    if status.state != "done" or status.estimate is None or status.estimate_actual is not None:
        return status
    record(conn, status.id, status.spec.project, TaskRecords(conn).rows(status.id), now, keep)
    _est, found = of_job(conn, status.id)
    if found is None:
        return status
    return dataclasses.replace(status, estimate_actual=found.to_dict())


def ratios(conn: Redis) -> dict[str, tuple[float, int]]:
    """The farm's measured ratios: ``"from>to"`` -> (mean log of time on to / on from, jobs)."""
    raw = {_text(k): float(v) for k, v in guard(conn.hgetall, keys.ESTIMATE_RATIOS).items()}
    out = {}
    for name, jobs in raw.items():
        pair, _, part = name.rpartition("|")
        if part == "n" and jobs > 0:
            out[pair] = (raw.get(f"{pair}|log", 0.0) / jobs, int(jobs))
    return out


def errors(conn: Redis, count: int = 1000) -> list[dict[str, str]]:
    """The newest checks of the farm's estimates, newest first."""
    rows = guard(conn.xrevrange, keys.ESTIMATE_ERRORS, "+", "-", count)
    return [{_text(k): _text(v) for k, v in fields.items()} for _id, fields in rows]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
