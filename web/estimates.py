"""Estimate routes: a job's estimate before it is submitted (the same body as a submission,
nothing queued), the farm's estimate-vs-actual records, and a project's budget."""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from farm import budget, estimaterecords
from farm.accept import estimate_job
from farm.errors import BadParameter
from farm.queue import RenderQueue
from web import intake, jsonio
from web.appkeys import ALLOCATOR, CONN, RQ_CONN, SETTINGS, STORE, blocking, user_of
from web.auth import role_in
from web.jobs import read_job_body
from web.limits import JOB_TILES, limits_of
from web.projects import manage
from web.uploads import inspection

log = logging.getLogger("tessera.web.estimates")


async def estimate(request: web.Request) -> web.Response:
    """What the job of this body would take on each device class the user may use: time per
    frame, wall time with the devices free now, device-hours, cost, kWh, CO2e; and what the
    project's budget has left. The inspection renders the probe (once per upload: cached)."""
    job = await read_job_body(request)
    project, role, upload_id, req, rec = job.project, job.role, job.upload_id, job.req, job.rec
    app = request.app
    settings = app[SETTINGS]
    report = await inspection(request, rec, req.device, probe=True)
    max_tasks = await blocking(app, limits_of(request).allowed, project, JOB_TILES)
    quoted = await blocking(
        app, estimate_job, settings, app[STORE], RenderQueue(app[RQ_CONN], req.device), req,
        intake.source_of(rec), app[ALLOCATOR], report, role=role, max_tasks=max_tasks,
    )  # fmt: skip
    log.info("event=job_estimated project=%s user=%s upload=%s probe_class=%s",
             project, user_of(request).name, upload_id, quoted.estimate.probe_class)  # fmt: skip
    return web.json_response(
        {
            "project": project,
            "upload_id": upload_id,
            "device": req.device,
            "estimate": quoted.estimate.to_dict(),
            "budget": None if quoted.budget is None else quoted.budget.to_dict(),
            "warnings": quoted.warnings,
        }
    )


async def estimate_errors(request: web.Request) -> web.Response:
    """The newest estimate-vs-actual checks of the farm's jobs (farm admins: every project's;
    others: their projects')."""
    user = user_of(request)
    try:
        limit = min(1000, max(1, int(request.query.get("limit", "100"))))
    except ValueError:
        raise BadParameter("limit must be a whole number") from None
    rows = await blocking(request.app, estimaterecords.errors, request.app[CONN], 1000)
    mine = [r for r in rows if user.admin or user.role(r.get("project", "")) is not None]
    return web.json_response({"errors": mine[:limit]})


async def get_budget(request: web.Request) -> web.Response:
    project = request.match_info["project"]
    if not user_of(request).admin:
        role_in(request, project)
    app = request.app
    found = await blocking(app, budget.standing, app[STORE], app[SETTINGS], project)
    return web.json_response(
        {"project": project, "budget": None if found is None else found.to_dict()}
    )


async def set_budget(request: web.Request) -> web.Response:
    """The project's admins (and farm admins) set its budget per period; null removes it."""
    project = request.match_info["project"]
    manage(request, project)
    body = await jsonio.read_object(request, {"amount": (int, float), "period": str})
    app = request.app
    amount: Any = body.get("amount")  # null (or none given): the project has no budget
    await blocking(app, budget.set_budget, app[CONN], project, amount, body.get("period", "30d"))
    log.info("event=budget_set project=%s amount=%s period=%s by=%s", project, amount,
             body.get("period", "30d"), user_of(request).name)  # fmt: skip
    return await get_budget(request)
