"""A job's task table: every tile (or sample part) with its worker, times, attempts, render
time and peak memory, filtered, sorted and paged; the job's ETA and per-frame times."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from farm import redisclock
from farm.errors import BadFrameList, BadParameter
from farm.frames import parse_frames
from farm.states import TileState
from farm.taskrecords import Attempt, TaskRecords, TaskRow, progress
from web.appkeys import CONN, blocking
from web.jobs import job_for

#: sort keys of ?sort= (a leading '-': descending); missing values sort last either way
SORTS: dict[str, Callable[[TaskRow], Any]] = {
    "frame": lambda r: (r.frame, r.index),
    "tile": lambda r: (r.index, r.frame),
    "state": lambda r: r.state,
    "attempts": lambda r: r.attempt,
    "worker": lambda r: r.last.worker if r.last and r.last.worker else None,
    "started": lambda r: r.last.started_s if r.last else None,
    "ended": lambda r: r.last.ended_s if r.last else None,
    "duration": lambda r: r.last.duration_s if r.last else None,
    "render": lambda r: r.last.render_s if r.last else None,
    "memory": lambda r: r.last.peak_memory_mib if r.last else None,
}
MAX_LIMIT = 1000


def _int(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise BadParameter(f"{name} must be a whole number from {low} to {high}, not {text!r}",
                           field=name)  # fmt: skip
    return int(text)


def _log_url(job_id: str, row: TaskRow, a: Attempt) -> str | None:
    if not a.logged:
        return None
    return f"/api/jobs/{job_id}/tiles/{row.frame}/{row.index}/attempts/{a.attempt}/log"


def _attempt_json(job_id: str, row: TaskRow, a: Attempt) -> dict[str, Any]:
    data = asdict(a)
    del data["logged"]
    # an attempt that never reported its end while the tile went on (its worker was lost), or
    # whose job was canceled under it
    if a.outcome == "rendering" and (a.attempt < row.attempt or row.state != "rendering"):
        current = a.attempt == row.attempt
        data["outcome"] = "canceled" if row.state == "canceled" and current else "lost"
    data["duration_s"] = a.duration_s
    data["log"] = _log_url(job_id, row, a)
    return data


def task_json(job_id: str, row: TaskRow) -> dict[str, Any]:
    last = row.last if row.last and row.last.attempt == row.attempt else None
    failed = [a for a in row.attempts if a.cause]
    return {
        "frame": row.frame,
        "tile": row.index,
        "state": row.state,
        "attempt": row.attempt,
        "worker": last.worker if last else None,
        "device": last.device if last else None,
        "started_s": last.started_s if last else None,
        "ended_s": last.ended_s if last else None,
        "duration_s": last.duration_s if last else None,
        "render_s": last.render_s if last else None,
        "peak_memory_mib": last.peak_memory_mib if last else None,
        # the current attempt's own log (once it ended)
        "log": _log_url(job_id, row, last) if last else None,
        # the latest failure's short cause, and its log
        "cause": failed[-1].cause if failed else "",
        "cause_log": _log_url(job_id, row, failed[-1]) if failed else None,
        "attempts": [_attempt_json(job_id, row, a) for a in row.attempts],
    }


def select(rows: list[TaskRow], query: Any) -> list[TaskRow]:
    """``rows`` filtered by ``state`` and ``frames`` (a frame list: 1-10,20) and sorted."""
    state = query.get("state")
    if state:
        wanted = set(state.split(","))
        unknown = wanted - {s.value for s in TileState}
        if unknown:
            known = ", ".join(s.value for s in TileState)
            raise BadParameter(f"state {sorted(unknown)[0]!r} is not one of {known}", field="state")
        rows = [r for r in rows if r.state in wanted]
    frames_text = query.get("frames")
    if frames_text:
        try:
            frames = set(parse_frames(frames_text))
        except BadFrameList as exc:
            raise BadParameter(f"frames: {exc.message}", field="frames") from None
        rows = [r for r in rows if r.frame in frames]
    sort = query.get("sort", "frame")
    key = SORTS.get(sort.removeprefix("-"))
    if key is None:
        raise BadParameter(f"sort {sort!r} is not one of {', '.join(SORTS)} (a leading '-' "
                           "sorts descending)", field="sort")  # fmt: skip
    present = [r for r in rows if key(r) is not None]
    absent = [r for r in rows if key(r) is None]
    present.sort(key=key, reverse=sort.startswith("-"))
    return present + absent


def failures_json(job_id: str, rows: list[TaskRow]) -> list[dict[str, Any]]:
    """Every failed attempt of the job grouped by its short cause, the most frequent first:
    how many, in which frames, and the latest one's log."""
    groups: dict[str, dict[str, Any]] = {}
    for row in rows:
        for a in row.attempts:
            if a.outcome != "failed" or not a.cause:
                continue
            g = groups.setdefault(a.cause, {"cause": a.cause, "attempts": 0, "frames": set(),
                                            "log": None, "ended_s": -1.0})  # fmt: skip
            g["attempts"] += 1
            g["frames"].add(row.frame)
            if (a.ended_s or 0.0) >= g["ended_s"]:
                g["ended_s"], g["log"] = a.ended_s or 0.0, _log_url(job_id, row, a)
    out = sorted(groups.values(), key=lambda g: (-g["attempts"], g["cause"]))
    for g in out:
        g["frames"] = sorted(g["frames"])
        del g["ended_s"]
    return out


async def job_tasks(request: web.Request) -> web.Response:
    """``GET /api/jobs/{job_id}/tasks?state=&frames=&sort=&offset=&limit=``."""
    status = await job_for(request)  # 404 for a job outside the user's projects
    offset = _int(request, "offset", 0, 0, 10**9)
    limit = _int(request, "limit", 100, 1, MAX_LIMIT)
    records = TaskRecords(request.app[CONN])
    rows = await blocking(request.app, records.rows, status.id)
    figures = progress(rows)
    chosen = select(rows, request.query)
    running = status.state not in ("done", "failed", "canceled")
    return web.json_response(
        {
            "job_id": status.id,
            "state": status.state,
            "total": len(chosen),
            "offset": offset,
            "limit": limit,
            "tasks": [task_json(status.id, r) for r in chosen[offset : offset + limit]],
            "progress": {
                "tasks_total": figures.tasks_total,
                "tasks_done": figures.tasks_done,
                "median_task_s": figures.median_task_s,
                "workers": figures.workers,
                "eta_s": figures.eta_s if running else None,
                # the clock the workers wrote the tasks' times with (farm.redisclock)
                "now_s": redisclock.now_nowait(request.app[CONN]),
                "frames": [asdict(f) for f in figures.frames],
            },
            "failures": failures_json(status.id, rows),
            # trimmed jobs keep their summary only (FARM_JOB_RETENTION_S)
            "trimmed": not rows and status.tiles_total > 0,
        }
    )
