"""Job control routes: suspend, resume, requeue, archive, delete (one job or a batch), and the
projects' live feed of job changes the jobs list follows."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from aiohttp import web

from farm import keys
from farm.errors import BadParameter, FarmError
from farm.httperrors import status_of
from farm.jobcontrol import ACTIONS, JobControl
from farm.models import Event
from farm.redisclient import guard
from farm.states import JobState
from web import jsonio
from web.appkeys import CONN, RQ_CONN, SETTINGS, STORAGE, STORE, blocking, user_of, waiting
from web.auth import role_in
from web.events import BLOCK_MS, sse, sse_response
from web.jobs import job_by_id, job_json

log = logging.getLogger("tessera.web.jobcontrol")

#: jobs one batch request may name
MAX_BATCH = 500
#: the role an action needs in the job's project (viewers only look)
ACTION_ROLE = "member"
#: fields of a requeue body (the batch's too): whole frames, and single tasks "frame:index"
REQUEUE_FIELDS: dict[str, type | tuple[type, ...]] = {"frames": list, "tasks": list}
_TASK = re.compile(r"(-?\d+):(\d+)")


def control(app: web.Application) -> JobControl:
    return JobControl(app[STORE], app[SETTINGS], app[STORAGE], app[RQ_CONN])


def requeue_choice(body: dict[str, Any]) -> tuple[list[int], list[tuple[int, int]]]:
    """The frames and tasks of a requeue body, checked for shape (the job checks the values)."""
    frames = body.get("frames") or []
    if not all(isinstance(f, int) and not isinstance(f, bool) for f in frames):
        raise BadParameter("frames must be a list of frame numbers", field="frames")
    tasks: list[tuple[int, int]] = []
    for t in body.get("tasks") or []:
        m = _TASK.fullmatch(t) if isinstance(t, str) else None
        if m is None:
            raise BadParameter(f'tasks must be a list of "frame:index" strings, not {t!r}',
                               field="tasks")  # fmt: skip
        tasks.append((int(m[1]), int(m[2])))
    return frames, tasks


async def act(
    request: web.Request, action: str, job_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Do ``action`` to one job as the request's user; the job's JSON after it (with what the
    action did), or for a delete what was removed."""
    status = await job_by_id(request, job_id, ACTION_ROLE)
    app, who = request.app, user_of(request).name
    ctl = control(app)
    if action == "suspend":
        return job_json(await blocking(app, ctl.suspend, status.id, who))
    if action == "resume":
        new, pushed = await blocking(app, ctl.resume, status.id, who)
        return {**job_json(new), "resumed_tiles": pushed}
    if action == "requeue":
        frames, tasks = requeue_choice(body)
        done = await blocking(app, ctl.requeue, status.id, who, frames, tasks)
        return {**job_json(done.status), "requeued_tiles": len(done.tiles),
                "redelivered_frames": done.redelivered}  # fmt: skip
    if action in ("archive", "unarchive"):
        return job_json(await blocking(app, ctl.archive, status.id, who, action == "archive"))
    if action == "cancel":
        store = app[STORE]
        outcome = await blocking(app, store.end_job, status.id, JobState.CANCELED,
                                 f"canceled by {who}")  # fmt: skip
        ctl.check_outcome(status.id, outcome, "only a queued, running or suspended job can be "
                     "canceled")  # fmt: skip
        return job_json(await blocking(app, store.status, status.id))
    if action == "delete":
        gone = await blocking(app, ctl.delete, status.id, who, body.get("confirm") is True)
        return {"job_id": gone.job_id, "deleted": True, "objects": gone.objects,
                "canceled": gone.canceled}  # fmt: skip
    raise BadParameter(f"action {action!r} is not one of {', '.join(ACTIONS)}", field="action")


def _single(action: str, fields: dict[str, type | tuple[type, ...]]) -> Any:
    async def handler(request: web.Request) -> web.Response:
        body = await jsonio.read_object(request, fields)
        return web.json_response(await act(request, action, request.match_info["job_id"], body))

    handler.__name__ = f"{action}_job"
    return handler


suspend_job = _single("suspend", {})
resume_job = _single("resume", {})
requeue_job = _single("requeue", REQUEUE_FIELDS)
archive_job = _single("archive", {})
unarchive_job = _single("unarchive", {})
delete_job = _single("delete", {"confirm": bool})


async def batch(request: web.Request) -> web.Response:
    """One action on many jobs; each job answers for itself: {results: [{job_id, ok, ...}]}."""
    body = await jsonio.read_object(
        request, {"action": str, "ids": list, "confirm": bool, **REQUEUE_FIELDS},
        required=("action", "ids"),
    )  # fmt: skip
    action, ids = body.pop("action"), body.pop("ids")
    if action not in ACTIONS:
        raise BadParameter(f"action {action!r} is not one of {', '.join(ACTIONS)}",
                           field="action")  # fmt: skip
    if not ids or len(ids) > MAX_BATCH or not all(isinstance(i, str) and i for i in ids):
        raise BadParameter(f"ids must be a list of 1 to {MAX_BATCH} job ids", field="ids")
    if action == "requeue":
        requeue_choice(body)  # a bad shape is the request's fault, not each job's
    results = []
    for job_id in dict.fromkeys(ids):
        try:
            results.append({"job_id": job_id, "ok": True, **await act(request, action, job_id,
                                                                       body)})  # fmt: skip
        except FarmError as exc:
            results.append({"job_id": job_id, "ok": False, "status": status_of(exc),
                            "error": exc.code, "message": exc.message})  # fmt: skip
    log.info("event=jobs_batch action=%s jobs=%d ok=%d user=%s", action, len(results),
             sum(r["ok"] for r in results), user_of(request).name)  # fmt: skip
    return web.json_response({"action": action, "results": results})


# --- the projects' live feed -------------------------------------------------------------------


def read_feed(
    conn: Any, after: dict[str, str], block_ms: int
) -> list[tuple[str, str, dict[str, str]]]:
    """New entries of the given project feeds: (stream key, entry id, fields), oldest first."""
    reply = guard(conn.xread, after, count=500, block=block_ms)
    return [(str(k), str(eid), fields) for k, entries in reply or [] for eid, fields in entries]


async def project_events(request: web.Request) -> web.StreamResponse:
    """What changes in the jobs of the user's projects (or ``?project=``), as server-sent
    events from now on: job state moves, frames done, users' actions. A client reads the
    jobs list when it connects, then again as events say what changed."""
    project = request.query.get("project")
    projects = [project] if project else user_of(request).projects_in(request.app[SETTINGS].cell)
    for p in projects:
        role_in(request, p)
    conn = request.app[CONN]
    streams = {keys.project_events(p): "$" for p in projects}
    if not streams:
        raise BadParameter("you are in no project: there is nothing to follow")
    resp = await sse_response(request)
    try:
        # a page that left at once is gone by this first write: the same end as a later one
        await resp.write(b": connected\n\n")
        # "$" means: what comes after the feed's last entry now (one id per project from here)
        for key in streams:
            last = await blocking(request.app, guard, conn.xrevrange, key, count=1)
            streams[key] = str(last[0][0]) if last else "0"
        while True:
            batch_ = await waiting(request.app, read_feed, conn, dict(streams), BLOCK_MS)
            for key, eid, fields in batch_:
                streams[key] = eid
                event = Event.from_fields(eid, fields)
                await resp.write(sse(eid, json.dumps(event.to_dict())))
            if not batch_:
                await resp.write(b": waiting\n\n")
    except (ConnectionResetError, ConnectionError):
        log.info("event=feed_client_gone user=%s", user_of(request).name)
    return resp
