"""Who is asking and what they may do: tokens, session cookies, roles, the device policy's check."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from farm.accounts import ROLE_RANK, User, check_name, check_role, digest
from farm.errors import BadParameter, Forbidden, NotFound, Unauthorized, WrongCell
from web import jsonio
from web.appkeys import ACCOUNTS, ALLOCATOR, ROUTES, SETTINGS, USER, blocking, user_of
from web.headers import forwarded_tls, over_tls

if TYPE_CHECKING:
    from web.routes import Route

log = logging.getLogger("tessera.web.auth")

COOKIE = "tessera_session"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: methods that change nothing: no origin or content-type rule applies to them
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: content types a plain HTML form can send from any site without asking (no CORS preflight)
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data", "text/plain")


def own_origins(request: web.Request) -> set[str]:
    """The origins the pages are served at: the request's own, and FARM_WEB_ORIGINS."""
    extra = request.app[SETTINGS].web_origins.split(",")
    # behind a TLS front door the pages were served over https, whatever this hop is
    schemes = {request.scheme, "https"} if forwarded_tls(request) else {request.scheme}
    return {f"{s}://{request.host}".lower() for s in schemes} | {
        o.strip().rstrip("/").lower() for o in extra if o.strip()
    }


def check_origin(request: web.Request, *, strict: bool) -> None:
    """Refuse a write sent from another origin (cross-site or same-site: another subdomain or
    port is another origin). ``strict`` (a cookie session) also asks for positive evidence:
    an ``Origin`` of our own or ``Sec-Fetch-Site: same-origin``, which every browser sends."""
    origin = request.headers.get("Origin")
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if origin is not None and origin.lower() not in own_origins(request):
        raise Forbidden(
            f"a write from the origin {origin!r} is refused: the API takes writes with a "
            "session cookie only from its own pages (or send an API token as "
            "`Authorization: Bearer <token>`)",
            origin=origin,
        )
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        raise Forbidden(
            f"a write from a {fetch_site} page is refused (Sec-Fetch-Site); use the farm's own "
            "pages, or an API token",
        )
    if strict and origin is None and fetch_site != "same-origin":
        raise Forbidden(
            "a write with a session cookie must come from the farm's pages (an Origin or "
            "Sec-Fetch-Site: same-origin header); scripts send an API token as "
            "`Authorization: Bearer <token>`"
        )


def check_content_type(request: web.Request, route: Route | None) -> None:
    """A body sent with a cookie is JSON, or the upload type the route declares: never a type a
    cross-site HTML form could send unasked (form types, text/plain)."""
    if not request.body_exists:
        return
    ctype = request.content_type
    declared = route.body_type if route is not None else None
    json_route = route is not None and route.body is not None
    if (ctype in FORM_TYPES and ctype != declared) or (json_route and ctype != "application/json"):
        raise Forbidden(
            f"a request body of type {ctype!r} is refused here; send "
            + (declared or "application/json"),
            content_type=ctype,
        )


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
    writes = request.method not in SAFE_METHODS
    if route is not None and route.path == "/api/login" and writes:
        # no one is logged in yet, but a forged login (into the attacker's account) is still
        # a cross-site write: the same origin rule, and a JSON body
        check_origin(request, strict=False)
        if not request.content_type == "application/json":
            raise Forbidden('log in with a JSON body: {"token": "..."} as application/json')
    if route is None or route.public:
        return await handler(request)
    creds = _credentials(request)
    if creds is not None and creds[0] == "session" and writes:
        check_origin(request, strict=True)
        check_content_type(request, route)
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
    cell = request.app[SETTINGS].cell
    if cell and user.cells.get(project, cell) != cell:
        raise WrongCell(
            f"project {project!r} lives in cell {user.cells[project]}, not in this one ({cell}): "
            "ask the farm's front door",
            project=project,
            cell=user.cells[project],
        )
    if ROLE_RANK[role] < ROLE_RANK[at_least]:
        raise Forbidden(
            f"your role in project {project!r} is {role}; this needs {at_least} or higher",
            project=project,
            role=role,
        )
    return role


async def check_device(request: web.Request, project: str, role: str, device: str) -> None:
    """Raise Forbidden unless the project's device policy (the allocator's) lets ``role`` use
    the device class ``device`` (``gpu``: some GPU class), before anything is queued or asked
    of a stream service; the allocator holds every lease to the same policy."""
    allocator = request.app[ALLOCATOR]
    await blocking(request.app, allocator.check_policy, project, role, device)


# --- routes ---------------------------------------------------------------------------------


async def login(request: web.Request) -> web.Response:
    body = await jsonio.read_object(request, {"token": str})
    accounts = request.app[ACCOUNTS]
    name = await blocking(request.app, accounts.user_for_token, body["token"])
    user = await blocking(request.app, accounts.user, name) if name else None
    if user is None:
        raise Unauthorized("that token is not valid (revoked, or mistyped)")
    settings = request.app[SETTINGS]
    token_id = await blocking(request.app, accounts.token_id_for, body["token"])
    session = await blocking(
        request.app, accounts.create_session, user.name, settings.session_ttl_s, token_id or ""
    )
    resp = web.json_response(await _me(request, user), status=200)
    resp.set_cookie(
        COOKIE,
        session,
        max_age=int(settings.session_ttl_s),
        httponly=True,
        samesite="Strict",
        secure=over_tls(request),
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
    # a cell lists the projects it serves (their device policy is its own); the front door
    # puts every cell's together
    cell = request.app[SETTINGS].cell
    projects = user.projects_in(cell)
    names = await blocking(request.app, accounts.project_names, projects)
    out = []
    for p in projects:
        policy = await blocking(request.app, request.app[ALLOCATOR].policy, p)
        role = user.roles[p]
        entry = {"id": p, "name": names[p], "role": role, "devices": list(policy[role])}
        out.append({**entry, "cell": cell} if cell else entry)
    return {"user": user.name, "admin": user.admin, "projects": out}


async def me(request: web.Request) -> web.Response:
    return web.json_response(await _me(request, user_of(request)))


def _require_admin(request: web.Request) -> None:
    if not user_of(request).admin:
        raise Forbidden("only a farm admin may manage tokens (`farm token create --admin`)")


async def create_token(request: web.Request) -> web.Response:
    _require_admin(request)
    body = await jsonio.read_object(
        request,
        {"user": str, "project": str, "role": str, "admin": bool, "cell": str},
        required=("user",),
    )
    user = check_name("user", body["user"])
    accounts = request.app[ACCOUNTS]
    await blocking(request.app, accounts.ensure_user, user, admin=bool(body.get("admin")))
    if "project" in body:
        role = check_role(body.get("role", "member"))
        # a new project's cell, in a farm of cells (the front door picks one if none is named)
        cell = body.get("cell", "")
        await blocking(request.app, accounts.set_role, user, body["project"], role, cell)
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


# --- browser sessions -------------------------------------------------------------------------


async def list_sessions(request: web.Request) -> web.Response:
    """The user's browser sessions; a farm admin may ask for anyone's (``?user=``)."""
    me_ = user_of(request)
    who = request.query.get("user") or me_.name
    if who != me_.name and not me_.admin:
        raise Forbidden("only a farm admin may list another user's sessions")
    sessions = await blocking(request.app, request.app[ACCOUNTS].sessions, who)
    current = request.cookies.get(COOKIE)
    mine = digest(current) if current else None
    for s in sessions:
        s["current"] = s["session_id"] == mine
    return web.json_response({"user": who, "sessions": sessions})


async def end_session(request: web.Request) -> web.Response:
    """End one browser session: one's own, or anyone's for a farm admin (404 otherwise)."""
    session_id = request.match_info["session_id"]
    accounts = request.app[ACCOUNTS]
    owner = await blocking(request.app, accounts.session_owner, session_id)
    me_ = user_of(request)
    if owner is None or (owner != me_.name and not me_.admin):
        raise NotFound(f"no session {session_id!r} of yours", session_id=session_id)
    await blocking(request.app, accounts.end_session_by_id, session_id)
    log.info("event=session_ended user=%s by=%s", owner, me_.name)
    return web.Response(status=204)
