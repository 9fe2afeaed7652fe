"""A job's blocklist: the workers that failed its tiles, those that no longer take them, and
clearing it (farm.blocklist)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from farm import blocklist
from farm.queue import RenderQueue
from web.appkeys import CONN, RQ_CONN, SETTINGS, blocking, user_of
from web.jobs import job_for


def _body(job_id: str, threshold: int, entries: list[blocklist.Entry]) -> dict[str, Any]:
    return {
        "job_id": job_id,
        # a worker that fails this many of the job's tiles takes no more of them
        "failures_to_block": threshold,
        "workers": [e.to_dict() for e in entries],
    }


async def get_blocklist(request: web.Request) -> web.Response:
    status = await job_for(request)
    app = request.app
    entries = await blocking(app, blocklist.entries, app[CONN], status.id)
    return web.json_response(_body(status.id, app[SETTINGS].blocklist_failures, entries))


async def clear_blocklist(request: web.Request) -> web.Response:
    status = await job_for(request, "member")
    app = request.app
    # ?worker=NAME clears only that worker's entry
    worker = request.query.get("worker", "")
    cleared = await blocking(app, blocklist.clear, app[CONN], status.id, user_of(request).name,
                             worker)  # fmt: skip
    if cleared:
        # idle workers look at the queue again: the tiles they passed over may be theirs now
        await blocking(app, RenderQueue(app[RQ_CONN], status.spec.device).ring)
    entries = await blocking(app, blocklist.entries, app[CONN], status.id)
    body = _body(status.id, app[SETTINGS].blocklist_failures, entries)
    return web.json_response({**body, "cleared": cleared})
