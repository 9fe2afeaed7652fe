"""Project routes: members (listing, removing), the project's own limits and its policy."""

from __future__ import annotations

import logging

from aiohttp import web

from farm.accounts import check_name
from farm.errors import BadParameter, Forbidden
from web import jsonio
from web.appkeys import ACCOUNTS, ALLOCATOR, blocking, user_of
from web.auth import role_in
from web.limits import LIMITS, limits_of

log = logging.getLogger("tessera.web.projects")


def manage(request: web.Request, project: str) -> None:
    """Farm admins, and the project's own admins, manage its members (and its webhooks)."""
    if not user_of(request).admin:
        role_in(request, project, "admin")


async def list_members(request: web.Request) -> web.Response:
    project = request.match_info["project"]
    manage(request, project)
    members = await blocking(request.app, request.app[ACCOUNTS].members, project)
    return web.json_response(
        {
            "project": project,
            "members": [{"user": u, "role": r} for u, r in sorted(members.items())],
        }
    )


async def remove_member(request: web.Request) -> web.Response:
    """The user leaves the project: every token and session of theirs loses it at once."""
    project = request.match_info["project"]
    user = check_name("user", request.match_info["user"])
    manage(request, project)
    await blocking(request.app, request.app[ACCOUNTS].remove_member, user, project)
    log.info("event=member_removed project=%s user=%s by=%s", project, user,
             user_of(request).name)  # fmt: skip
    return web.Response(status=204)


async def get_limits(request: web.Request) -> web.Response:
    project = request.match_info["project"]
    if not user_of(request).admin:
        role_in(request, project)
    limits = limits_of(request)
    allowed = await blocking(request.app, limits.all_allowed, project)
    return web.json_response({"project": project, "limits": allowed})


async def set_limits(request: web.Request) -> web.Response:
    """A farm admin sets a project's own limits (over the farm's settings)."""
    project = request.match_info["project"]
    if not user_of(request).admin:
        raise Forbidden("only a farm admin may change a project's limits")
    body = await jsonio.read_object(request, dict.fromkeys(LIMITS, int))
    if not body:
        raise BadParameter(f"give one or more limits: {', '.join(LIMITS)}")
    limits = limits_of(request)
    await blocking(request.app, limits.set_allowed, project, dict(body))
    allowed = await blocking(request.app, limits.all_allowed, project)
    return web.json_response({"project": project, "limits": allowed})


async def set_policy(request: web.Request) -> web.Response:
    """The project's admins (and farm admins) set which device classes a role may lease (the
    allocator's policy: every later lease obeys it) and which role may launch desktop apps."""
    project = request.match_info["project"]
    manage(request, project)
    body = await jsonio.read_object(request, {"role": str, "devices": list, "desktop_apps": str})
    if "role" not in body and "desktop_apps" not in body:
        raise BadParameter("give a role with its devices, or desktop_apps, or both")
    app = request.app
    accounts, allocator = app[ACCOUNTS], app[ALLOCATOR]
    if "desktop_apps" in body:
        await blocking(app, accounts.set_desktop_role, project, body["desktop_apps"])
    if "role" in body:
        devices = body.get("devices", [])
        await blocking(app, allocator.set_policy, project, body["role"], devices)
        log.info("event=policy_set project=%s role=%s devices=%s by=%s", project, body["role"],
                 ",".join(devices), user_of(request).name)  # fmt: skip
    policy = await blocking(app, allocator.policy, project)
    desktop = await blocking(app, accounts.desktop_role, project)
    return web.json_response(
        {
            "project": project,
            "policy": {r: list(d) for r, d in policy.items()},
            "desktop_apps": desktop,
        }
    )
