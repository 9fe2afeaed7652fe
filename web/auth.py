"""Who is asking and what they may do: tokens, session cookies, roles and device policy."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from farm.errors import BadParameter, Forbidden, NotFound, Unauthorized
from web import jsonio
from web.accounts import ROLE_RANK, User, check_name, check_role
from web.appkeys import ACCOUNTS, ROUTES, SETTINGS, USER, blocking, user_of

log = logging.getLogger("tessera.web.auth")

COOKIE = "tessera_session"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _credentials(request: web.Request) -> tuple[str, str] | None:
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise Unauthorized("the Authorization header must be `Bearer <token>`")
        return "token", value.strip()
    cookie = request.cookies.get(COOKIE)
    if cookie:
        return "session", cookie
    return None


def _lookup(request: web.Request, kind: str, secret: str) -> User | None:
    accounts = request.app[ACCOUNTS]
    lookup = accounts.user_for_token if kind == "token" else accounts.user_for_session
    name = lookup(secret)
    return accounts.user(name) if name else None


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route in the table needs a user unless it is marked public."""
    resource = request.match_info.route.resource
    route = None
    if resource is not None:
        route = request.app[ROUTES].get((request.method, resource.canonical))
    if route is None or route.public:
        return await handler(request)
    creds = _credentials(request)
    if creds is None:
        raise Unauthorized(
            "log in first, or send an API token as `Authorization: Bearer <token>` "
            "(`farm token create` makes one)"
        )
    user = await blocking(request.app, _lookup, request, *creds)
    if user is None:
        what = "API token" if creds[0] == "token" else "login session"
        raise Unauthorized(f"the {what} is not valid (revoked or expired); log in again")
    request[USER] = user
    return await handler(request)


def role_in(request: web.Request, project: str, at_least: str = "viewer") -> str:
    """The user's role in ``project``; 404 for a project they are not in (it stays hidden)."""
    user = user_of(request)
    if not isinstance(project, str) or not project:
        raise BadParameter('say which project: ?project=<id> or a "project" field')
    role = user.role(project)
    if role is None:
        raise NotFound(f"no project {project!r} among yours", project=project)
    if ROLE_RANK[role] < ROLE_RANK[at_least]:
        raise Forbidden(
            f"your role in project {project!r} is {role}; this needs {at_least} or higher",
            project=project,
            role=role,
        )
    return role


async def check_device(request: web.Request, project: str, role: str, device: str) -> None:
    """Raise Forbidden unless the project's policy lets ``role`` use ``device``."""
    policy = await blocking(request.app, request.app[ACCOUNTS].policy, project)
    allowed = policy.get(role, ())
    if device not in allowed:
        shown = ", ".join(allowed) or "none"
        raise Forbidden(
            f"in project {project!r} the {role} role may use device classes: {shown}; "
            f"not {device!r}",
            project=project,
            device=device,
        )


# --- routes ---------------------------------------------------------------------------------


async def login(request: web.Request) -> web.Response:
    body = await jsonio.read_object(request, {"token": str})
    accounts = request.app[ACCOUNTS]
    name = await blocking(request.app, accounts.user_for_token, body["token"])
    user = await blocking(request.app, accounts.user, name) if name else None
    if user is None:
        raise Unauthorized("that token is not valid (revoked, or mistyped)")
    settings = request.app[SETTINGS]
    session = await blocking(
        request.app, accounts.create_session, user.name, settings.session_ttl_s
    )
    resp = web.json_response(await _me(request, user), status=200)
    resp.set_cookie(
        COOKIE,
        session,
        max_age=int(settings.session_ttl_s),
        httponly=True,
        samesite="Strict",
        secure=request.secure or settings.tls_cert is not None,
        path="/",
    )
    log.info("event=login user=%s", user.name)
    return resp


async def logout(request: web.Request) -> web.Response:
    cookie = request.cookies.get(COOKIE)
    if cookie:
        await blocking(request.app, request.app[ACCOUNTS].end_session, cookie)
    resp = web.json_response({"ok": True})
    resp.del_cookie(COOKIE, path="/")
    return resp


async def _me(request: web.Request, user: User) -> dict[str, Any]:
    accounts = request.app[ACCOUNTS]
    projects = sorted(user.roles)
    names = await blocking(request.app, accounts.project_names, projects)
    out = []
    for p in projects:
        policy = await blocking(request.app, accounts.policy, p)
        role = user.roles[p]
        out.append({"id": p, "name": names[p], "role": role, "devices": list(policy[role])})
    return {"user": user.name, "admin": user.admin, "projects": out}


async def me(request: web.Request) -> web.Response:
    return web.json_response(await _me(request, user_of(request)))


def _require_admin(request: web.Request) -> None:
    if not user_of(request).admin:
        raise Forbidden("only a farm admin may manage tokens (`farm token create --admin`)")


async def create_token(request: web.Request) -> web.Response:
    _require_admin(request)
    body = await jsonio.read_object(
        request, {"user": str, "project": str, "role": str, "admin": bool}, required=("user",)
    )
    user = check_name("user", body["user"])
    accounts = request.app[ACCOUNTS]
    await blocking(request.app, accounts.ensure_user, user, admin=bool(body.get("admin")))
    if "project" in body:
        role = check_role(body.get("role", "member"))
        await blocking(request.app, accounts.set_role, user, body["project"], role)
    issued = await blocking(request.app, accounts.create_token, user)
    log.info("event=token_created user=%s token_id=%s by=%s", user, issued.token_id,
             user_of(request).name)  # fmt: skip
    return web.json_response(
        {"token": issued.token, "token_id": issued.token_id, "user": user}, status=201
    )


async def revoke_token(request: web.Request) -> web.Response:
    _require_admin(request)
    token_id = request.match_info["token_id"]
    await blocking(request.app, request.app[ACCOUNTS].revoke_token, token_id)
    log.info("event=token_revoked token_id=%s by=%s", token_id, user_of(request).name)
    return web.Response(status=204)


async def set_policy(request: web.Request) -> web.Response:
    project = request.match_info["project"]
    role_in(request, project, "admin")
    body = await jsonio.read_object(request, {"role": str, "devices": list}, required=("role",))
    devices = body.get("devices", [])
    if not all(isinstance(d, str) for d in devices):
        raise BadParameter("devices must be a list of device class names")
    accounts = request.app[ACCOUNTS]
    await blocking(request.app, accounts.set_policy, project, body["role"], devices)
    policy = await blocking(request.app, accounts.policy, project)
    return web.json_response(
        {"project": project, "policy": {r: list(d) for r, d in policy.items()}}
    )
