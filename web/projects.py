"""Project routes: members (listing, removing) and the project's own limits."""

from __future__ import annotations

import logging

from aiohttp import web

from farm.accounts import check_name
from farm.errors import BadParameter, Forbidden
from web import jsonio
from web.appkeys import ACCOUNTS, blocking, user_of
from web.auth import role_in
from web.limits import LIMITS, limits_of

log = logging.getLogger("tessera.web.projects")


def _manage(request: web.Request, project: str) -> None:
    """Farm admins, and the project's own admins, manage its members."""
    if not user_of(request).admin:
        role_in(request, project, "admin")


async def list_members(request: web.Request) -> web.Response:
    project = request.match_info["project"]
    _manage(request, project)
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
    _manage(request, project)
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
