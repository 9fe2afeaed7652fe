"""Job routes: submit (the job options of farm.models.JOB_OPTIONS), list, detail with tile
grids, cancel, retry, priority."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from farm import budget, estimaterecords, redisclock, submission
from farm.accept import accept
from farm.errors import BadParameter, Conflict, NotFound
from farm.jobstore import JobStore
from farm.models import JOB_OPTIONS, Event, JobStatus
from farm.queue import RenderQueue
from farm.settings import Settings
from farm.states import JobState
from web import intake, jsonio
from web.appkeys import ALLOCATOR, CONN, RQ_CONN, SETTINGS, STORE, blocking, user_of
from web.auth import check_device, role_in
from web.limits import JOB_TILES, limits_of
from web.uploads import inspection

log = logging.getLogger("tessera.web.jobs")

#: fields of the job body beside the job options: which upload, and the page's name for
#: allow_missing
WHERE_FIELDS: dict[str, type | tuple[type, ...]] = {"upload_id": str, "accept_missing": bool}


def body_fields() -> dict[str, type | tuple[type, ...]]:
    """Every field the job body takes, with its JSON types: exactly the public job options
    and where the file is. Nothing is read off a dataclass, so a field added to a request or
    spec elsewhere never becomes public API unnoticed."""
    return {**{o.name: o.types for o in JOB_OPTIONS.values()}, **WHERE_FIELDS}


def job_json(status: JobStatus) -> dict[str, Any]:
    data = status.to_dict()
    spec = data["spec"]
    spec.pop("output", None)
    spec["source"].pop("location", None)
    data.update(
        {
            "job_id": status.id,
            "project": status.spec.project,
            "name": status.spec.name,
            "priority": status.spec.priority,
            "upload_id": status.spec.source.sha256,
        }
    )
    return data


async def job_for(request: web.Request, at_least: str = "viewer") -> JobStatus:
    """The job in the URL, if it belongs to one of the user's projects (404 otherwise)."""
    return await job_by_id(request, request.match_info["job_id"], at_least)


async def job_by_id(request: web.Request, job_id: str, at_least: str = "viewer") -> JobStatus:
    """The job, if it belongs to one of the user's projects (404 otherwise, as for a job that
    does not exist), and the user has at least the role ``at_least`` there (403)."""
    try:
        status = await blocking(request.app, request.app[STORE].status, job_id)
    except NotFound:
        status = None
    if status is None or user_of(request).role(status.spec.project) is None:
        raise NotFound(f"no job {job_id!r} in your projects", job_id=job_id)
    role_in(request, status.spec.project, at_least)
    return status


# --- submit -------------------------------------------------------------------------------


def job_output(settings: Settings, project: str) -> str:
    """Where a web-submitted job's frames go: under the farm's own storage, so that every
    worker and web instance reaches them (an S3 prefix, or the shared folder)."""
    name = f"outputs/{project}/{uuid.uuid4().hex}"
    if settings.storage_url:
        return f"{settings.storage_url.rstrip('/')}/{name}"
    return str(settings.storage_dir / name)


@dataclass(frozen=True)
class JobBody:
    """A job's body (``POST /api/jobs``, and its estimate) read and checked: the project, the
    caller's role there, the render request and the record of the upload it names."""

    project: str
    role: str
    upload_id: str
    req: submission.RenderRequest
    rec: dict[str, Any]


async def read_job_body(request: web.Request) -> JobBody:
    body = await jsonio.read_object(request, body_fields(), required=("project", "upload_id"))
    upload_id = body.pop("upload_id")
    if body.pop("accept_missing", False):
        body["allow_missing"] = True
    project = body["project"]
    role = role_in(request, project, "member")
    app = request.app
    settings = app[SETTINGS]
    req = submission.request_from(body, job_output(settings, project), settings)
    submission.check_request(req)
    await check_device(request, project, role, req.device)
    rec = await blocking(app, intake.find, app[CONN], [project], upload_id)
    return JobBody(project, role, upload_id, req, rec)


async def submit_job(request: web.Request) -> web.Response:
    job = await read_job_body(request)
    project, role, upload_id, req, rec = job.project, job.role, job.upload_id, job.req, job.rec
    app = request.app
    settings = app[SETTINGS]
    # a project with a budget has every job estimated: its inspection renders the probe
    limited = await blocking(app, budget.get, app[CONN], project) is not None
    report = await inspection(request, rec, req.device, probe=limited)
    limits = limits_of(request)
    max_tasks = await blocking(app, limits.allowed, project, JOB_TILES)
    render_queue = RenderQueue(app[RQ_CONN], req.device)
    # a flood of jobs meets the project's budget of queued tiles (429), not the farm's memory
    accepted = await blocking(
        app, accept, settings, app[STORE], render_queue, req, intake.source_of(rec), report,
        max_tasks=max_tasks, admit=partial(limits.within_tile_budget, project), role=role,
        allocator=app[ALLOCATOR],
    )  # fmt: skip
    log.info("event=job_submitted job=%s project=%s user=%s upload=%s device=%s priority=%d",
             accepted.job_id, project, user_of(request).name, upload_id, req.device,
             req.priority)  # fmt: skip
    status = await blocking(app, app[STORE].status, accepted.job_id)
    return web.json_response({**job_json(status), "warnings": accepted.warnings}, status=201)


# --- reading --------------------------------------------------------------------------------


#: how the jobs list may be sorted (?sort=), each with its key
SORTS = ("submitted", "state", "name", "progress")
#: which jobs the list shows by archival (?archived=): not archived (default), only, all
ARCHIVED = ("0", "1", "all")


def _sort_key(sort: str) -> Any:
    if sort == "state":
        return lambda j: (j["state"], -j["created_s"])
    if sort == "name":
        return lambda j: (j["name"].lower(), -j["created_s"])
    if sort == "progress":
        return lambda j: (j["tiles_done"] / max(1, j["tiles_total"]), -j["created_s"])
    return lambda j: j["created_s"]


def _listing(query: Any) -> tuple[str, str, int]:
    """The list's sort, order and length asked for in ``query`` (400 for what is not one)."""
    sort = query.get("sort", "submitted")
    if sort not in SORTS:
        raise BadParameter(f"sort {sort!r} is not one of {', '.join(SORTS)}")
    order = query.get("order", "desc" if sort in ("submitted", "progress") else "asc")
    if order not in ("asc", "desc"):
        raise BadParameter(f"order {order!r} is not asc or desc")
    try:
        limit = min(500, max(1, int(query.get("limit", "100"))))
    except ValueError:
        raise BadParameter("limit must be a whole number") from None
    return sort, order, limit


def merged_jobs(jobs: list[dict[str, Any]], query: Any) -> list[dict[str, Any]]:
    """Lists of several cells as one cell's list would be: the latest ``limit`` jobs, in the
    order asked for (web/frontdoor.py)."""
    sort, order, limit = _listing(query)
    latest = sorted(jobs, key=lambda j: -j["created_s"])[:limit]
    latest.sort(key=_sort_key(sort), reverse=order == "desc")
    return latest


async def list_jobs(request: web.Request) -> web.Response:
    user = user_of(request)
    project = request.query.get("project")
    state = request.query.get("state")
    if state is not None and state not in {s.value for s in JobState}:
        raise BadParameter(f"state {state!r} is not one of {', '.join(s.value for s in JobState)}")
    sort, order, limit = _listing(request.query)
    archived = request.query.get("archived", "0")
    if archived not in ARCHIVED:
        raise BadParameter(f"archived {archived!r} is not one of {', '.join(ARCHIVED)}")
    projects = [project] if project else user.projects_in(request.app[SETTINGS].cell)
    for p in projects:
        role_in(request, p)
    app = request.app

    def wanted(status: JobStatus) -> bool:
        if state is not None and status.state != state:
            return False
        return archived == "all" or (status.archived_s is not None) == (archived == "1")

    def read() -> list[dict[str, Any]]:
        ids: list[tuple[str, float]] = []
        for p in projects:
            ids.extend(app[STORE].project_job_ids(p, limit))
        ids.sort(key=lambda pair: -pair[1])
        out = []
        # every status in one round trip, not one per job
        for status in app[STORE].statuses([job_id for job_id, _created in ids]):
            if status is None:
                continue
            if wanted(status):
                out.append(job_json(status))
            if len(out) >= limit:
                break
        # the latest jobs (limit), in the order asked for
        out.sort(key=_sort_key(sort), reverse=order == "desc")
        return out

    return web.json_response({"jobs": await blocking(app, read)})


def all_events(store: JobStore, job_id: str) -> list[Event]:
    out: list[Event] = []
    after = "0"
    while True:
        batch = store.events(job_id, after)
        out.extend(batch)
        if len(batch) < 1000:
            return out
        after = batch[-1].id


def frames_view(store: JobStore, status: JobStatus) -> dict[str, Any]:
    """Per frame: its state and the state of each tile (index = row * cols + col)."""
    count = status.spec.tasks_per_frame
    tiles = {f: ["queued"] * count for f in status.spec.frames}
    for name, st in store.tile_states(status.id).items():
        frame, index = (int(x) for x in name.split(":"))
        if frame in tiles and 0 <= index < count:
            tiles[frame][index] = st.value
    done: set[int | None] = set()
    for e in all_events(store, status.id):
        if e.type == "frame_done":
            done.add(e.frame)
        elif e.type == "tile_state" and e.state == "queued":
            done.discard(e.frame)  # requeued: the frame renders again

    out: dict[str, Any] = {}
    for frame, states in tiles.items():
        if frame in done:
            state = "done"
        elif "failed" in states:
            state = "failed"
        elif all(s == "done" for s in states):
            state = "assembling"
        elif any(s in ("rendering", "done") for s in states):
            state = "rendering"
        elif all(s == "canceled" for s in states):
            state = "canceled"
        else:
            state = "queued"
        out[str(frame)] = {"state": state, "tiles": states}
    return out


async def get_job(request: web.Request) -> web.Response:
    status = await job_for(request)
    app = request.app
    conn, keep = app[STORE].conn, app[SETTINGS].estimate_errors_max
    status = await blocking(
        app, lambda: estimaterecords.settled(conn, status, redisclock.now(conn), keep)
    )
    frames = await blocking(request.app, frames_view, request.app[STORE], status)
    return web.json_response({**job_json(status), "frames": frames})


async def job_logs(request: web.Request) -> web.Response:
    status = await job_for(request)
    events = await blocking(request.app, all_events, request.app[STORE], status.id)
    lines = [log_line(e) for e in events]
    if status.reason:
        lines.append(f"job {status.state}: {status.reason}")
    return web.json_response({"job_id": status.id, "lines": lines, "reason": status.reason})


def log_line(e: Event) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.ts))
    where = ""
    if e.frame is not None:
        where += f" frame {e.frame}"
    if e.tile is not None:
        where += f" tile {e.tile}"
    if e.attempt is not None:
        where += f" attempt {e.attempt}"
    what = e.state or e.type
    tail = f": {e.message}" if e.message else ""
    return f"{when} {e.type}{where} {what}{tail}"


# --- changing -------------------------------------------------------------------------------


async def cancel_job(request: web.Request) -> web.Response:
    status = await job_for(request, "member")
    store = request.app[STORE]
    outcome = await blocking(
        request.app, store.end_job, status.id, JobState.CANCELED,
        f"canceled by {user_of(request).name}",
    )  # fmt: skip
    if outcome != "ok":
        state = outcome.removeprefix("job_")
        raise Conflict(f"job {status.id} has already ended: {state}", state=state)
    log.info("event=job_canceled job=%s user=%s", status.id, user_of(request).name)
    return web.json_response(job_json(await blocking(request.app, store.status, status.id)))


async def retry_job(request: web.Request) -> web.Response:
    status = await job_for(request, "member")
    app = request.app
    store = app[STORE]
    outcome, tasks = await blocking(app, store.retry_failed, status.id)
    if outcome == "nothing":
        raise Conflict(f"job {status.id} has no unfinished tiles to retry")
    if outcome != "ok":
        raise Conflict(
            f"only a failed job can be retried; job {status.id} is {outcome.removeprefix('job_')}"
        )
    render_queue = RenderQueue(app[RQ_CONN], status.spec.device)
    await blocking(app, render_queue.stage_tiles, tasks, status.spec.tile_timeout_s)
    log.info("event=job_retried job=%s tiles=%d user=%s", status.id, len(tasks),
             user_of(request).name)  # fmt: skip
    new = await blocking(app, store.status, status.id)
    return web.json_response({**job_json(new), "retried_tiles": len(tasks)})


async def patch_job(request: web.Request) -> web.Response:
    status = await job_for(request, "member")
    body = await jsonio.read_object(request, {"priority": int}, required=("priority",))
    priority = body["priority"]
    JOB_OPTIONS["priority"].check(priority)
    app = request.app
    await blocking(app, app[STORE].set_priority, status.id, priority)
    # the job's waiting tiles move before (or after) other jobs' now, not only its label
    render_queue = RenderQueue(app[RQ_CONN], status.spec.device)
    await blocking(app, render_queue.set_priority, status.id, priority)
    new = await blocking(app, app[STORE].status, status.id)
    return web.json_response(job_json(new))
