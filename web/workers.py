"""Worker routes: the workers page's list, an operator's disable (drain) and enable, and why a
job is still waiting for one."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from farm import workerstate
from farm.accounts import User
from farm.errors import Forbidden
from farm.queue import RenderQueue
from farm.queuewhy import Why, explain
from farm.states import JobState
from farm.workerstate import WorkerInfo
from web.appkeys import ALLOCATOR, CONN, RQ_CONN, SETTINGS, blocking, user_of
from web.jobs import job_for

log = logging.getLogger("tessera.web.workers")

#: what a project member sees of a worker busy with another project's task
OTHER_PROJECT = "busy (another project)"
#: job states whose job may be waiting for a worker (tiles, or its frames' assembly)
WAITING_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.ASSEMBLING)


def _registry(request: web.Request) -> workerstate.WorkerRegistry:
    return workerstate.registry_for(request.app[CONN], request.app[SETTINGS])


def visible(worker: WorkerInfo, user: User) -> dict[str, Any]:
    """A worker as ``user`` may see it: a farm admin everything; a member the current task only
    when it is one of their projects' (else "busy (another project)", no job, no lease)."""
    data = worker.to_dict()
    theirs = not worker.project or user.role(worker.project) is not None
    if user.admin or theirs:
        return data
    data.update({"task": OTHER_PROJECT, "job": "", "project": "", "frame": None,
                 "tile": None, "lease": ""})  # fmt: skip
    return data


def _viewer(request: web.Request) -> User:
    user = user_of(request)
    if not user.admin and not user.roles:
        raise Forbidden("the workers list is for members of a project and farm admins")
    return user


async def list_workers(request: web.Request) -> web.Response:
    user = _viewer(request)
    workers = await blocking(request.app, _registry(request).list)
    settings = request.app[SETTINGS]
    return web.json_response(
        {
            "workers": [visible(w, user) for w in workers],
            "silent_after_s": settings.worker_silent_s,
            "may_disable": user.admin,
        }
    )


async def _set_disabled(request: web.Request, disabled: bool) -> web.Response:
    user = user_of(request)
    if not user.admin:
        raise Forbidden("only a farm admin may disable or enable a worker")
    name = request.match_info["name"]
    worker = await blocking(request.app, _registry(request).set_disabled, name, disabled,
                            user.name)  # fmt: skip
    log.info("event=worker_%s worker=%s user=%s", "disabled" if disabled else "enabled", name,
             user.name)  # fmt: skip
    return web.json_response(visible(worker, user))


async def disable_worker(request: web.Request) -> web.Response:
    return await _set_disabled(request, True)


async def enable_worker(request: web.Request) -> web.Response:
    return await _set_disabled(request, False)


# --- why a job waits ---------------------------------------------------------------------------


def _why(request: web.Request, job_id: str, state: JobState, device: str, project: str,
         role: str) -> Why:  # fmt: skip
    if state not in WAITING_STATES:
        return Why("not_queued", f"the job is {state.value}, not waiting for a worker", device)
    workers = _registry(request).list()
    allowed = request.app[ALLOCATOR].policy(project).get(role) if role else None
    why = explain(device, workers, allowed)
    if why.reason != "busy":
        return why
    # its queue position only when it is the reason: reading it costs the queue's length
    waiting = RenderQueue(request.app[RQ_CONN], device).waiting_ids()
    mine = f"tile-{job_id}-"
    ahead = next((i for i, rq_id in enumerate(waiting) if rq_id.startswith(mine)), None)
    return explain(device, workers, allowed, ahead)


async def job_why(request: web.Request) -> web.Response:
    status = await job_for(request)
    spec = status.spec
    state = JobState(status.state)
    why = await blocking(request.app, _why, request, status.id, state, spec.device,
                         spec.project, spec.role)  # fmt: skip
    return web.json_response({"job_id": status.id, "state": state.value, **why.to_dict()})
