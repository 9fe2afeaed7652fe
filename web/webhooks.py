"""A project's webhooks over the API: add (its secret shown once), list, delete, deliveries."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from farm import jobstore
from farm.webhooks.dispatcher import Dispatcher
from farm.webhooks.hooks import Hooks, check_events, check_url
from web import jsonio
from web.appkeys import CONN, SETTINGS, blocking, user_of
from web.projects import manage

log = logging.getLogger("tessera.web.webhooks")


def _hooks(request: web.Request) -> Hooks:
    return Hooks(request.app[CONN])


async def list_hooks(request: web.Request) -> web.Response:
    project = request.match_info["project"]
    manage(request, project)
    hooks = await blocking(request.app, _hooks(request).of_project, project)
    return web.json_response({"project": project, "webhooks": [h.public() for h in hooks]})


async def create_hook(request: web.Request) -> web.Response:
    """A new hook; the answer holds its secret, which is never shown again."""
    project = request.match_info["project"]
    manage(request, project)
    settings = request.app[SETTINGS]
    body = await jsonio.read_object(request, {"url": str, "events": list}, required=("url",))
    url = check_url(body["url"], bool(settings.webhook_allow_private))
    events = check_events(body.get("events"))
    user = user_of(request).name
    hook = await blocking(request.app, _hooks(request).create, project, url, events, user,
                          settings.webhook_max_per_project)  # fmt: skip
    log.info("event=webhook_created project=%s hook=%s events=%s by=%s", project, hook.id,
             ",".join(events), user)  # fmt: skip
    return web.json_response({**hook.public(), "secret": hook.secret}, status=201)


async def delete_hook(request: web.Request) -> web.Response:
    project, hook_id = request.match_info["project"], request.match_info["hook_id"]
    manage(request, project)
    await blocking(request.app, _hooks(request).delete, project, hook_id)
    log.info("event=webhook_deleted project=%s hook=%s by=%s", project, hook_id,
             user_of(request).name)  # fmt: skip
    return web.Response(status=204)


async def rotate_secret(request: web.Request) -> web.Response:
    """A new signing secret, shown once; the old one signs too for FARM_WEBHOOK_SECRET_GRACE_S."""
    project, hook_id = request.match_info["project"], request.match_info["hook_id"]
    manage(request, project)
    grace_s = request.app[SETTINGS].webhook_secret_grace_s
    hook = await blocking(request.app, _hooks(request).rotate, project, hook_id, grace_s)
    log.info("event=webhook_secret_rotated project=%s hook=%s grace_s=%.0f by=%s", project,
             hook_id, grace_s, user_of(request).name)  # fmt: skip
    return web.json_response({**hook.public(), "secret": hook.secret})


async def enable_hook(request: web.Request) -> web.Response:
    """Deliver to a disabled hook again (one its receiver disabled with a 410 Gone)."""
    project, hook_id = request.match_info["project"], request.match_info["hook_id"]
    manage(request, project)
    hook = await blocking(request.app, _hooks(request).enable, project, hook_id)
    log.info("event=webhook_enabled project=%s hook=%s by=%s", project, hook_id,
             user_of(request).name)  # fmt: skip
    return web.json_response(hook.public())


async def list_deliveries(request: web.Request) -> web.Response:
    project, hook_id = request.match_info["project"], request.match_info["hook_id"]
    manage(request, project)
    rows = await blocking(request.app, _hooks(request).deliveries, project, hook_id)
    return web.json_response({"project": project, "webhook": hook_id, "deliveries": rows})


#: how long the app's shutdown waits for the dispatcher to put down what it is doing
DISPATCHER_STOP_S = 10.0


async def dispatcher_ctx(app: web.Application) -> AsyncIterator[None]:
    """Every web process runs a webhook dispatcher; the one holding the dispatcher lease sends
    (farm.webhooks.dispatcher), the others stand by to take over."""
    conn = jobstore.connect(app[SETTINGS].redis_url)
    stop = asyncio.Event()
    task = asyncio.create_task(Dispatcher(app[SETTINGS], conn).run(stop))
    try:
        yield
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, DISPATCHER_STOP_S)
        except (TimeoutError, asyncio.CancelledError):
            log.warning("event=webhook_dispatcher_stop_timeout")
        finally:
            conn.close()
