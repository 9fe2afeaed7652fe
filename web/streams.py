"""Stream routes: the app catalog and sessions, proxied to the stream services, project-checked."""

from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web

from farm import keys, redisclock, streamauth
from farm.errors import BadParameter, FarmError, Forbidden, NoCapacity, NotFound, error_class
from farm.redisclient import guard
from web import jsonio, wsrelay
from web.appkeys import ACCOUNTS, CONN, HTTP, SETTINGS, blocking, user_of
from web.auth import check_device, check_origin, role_in

log = logging.getLogger("tessera.web.streams")

#: how long an ended session's owner record outlives it (a stale record only ever 404s)
OWNER_TTL_S = 7 * 24 * 3600
TIMEOUT = aiohttp.ClientTimeout(total=30)


def device_class(service: dict[str, Any]) -> str:
    return str(service.get("device_class") or (
        "cpu" if str(service.get("device_id", "")).startswith("cpu") else "gpu"))  # fmt: skip


def _services(conn: Any) -> list[dict[str, Any]]:
    now = redisclock.now(conn)  # the services write their deadlines on Redis's clock
    out = []
    for raw in guard(conn.hgetall, keys.STREAM_SERVICES).values():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if float(entry.get("alive_until", now + 1)) >= now and entry.get("url"):
            out.append(entry)
    return sorted(out, key=lambda e: str(e.get("device_id", "")))


async def services(request: web.Request) -> list[dict[str, Any]]:
    found = await blocking(request.app, _services, request.app[CONN])
    if not found:
        raise NoCapacity("no stream service is running; start one with `farm stream`")
    return found


def token(
    request: web.Request,
    project: str,
    session: str = "",
    role: str = "spectator",
    desktop: bool = False,
) -> str:
    """A stream token for one call: this project, this session ("" = a new one), as this
    viewer role; ``desktop`` when the project's policy lets the user launch desktop apps. It
    carries the user's role in the project: a session's lease obeys the device policy for it."""
    settings = request.app[SETTINGS]
    streamauth.check_secret(settings.stream_secret)
    return streamauth.viewer_token(
        settings.stream_secret,
        project,
        session,
        role,
        settings.stream_token_ttl_s,
        desktop,
        project_role=user_of(request).role(project) or "",
        # the stream service checks it on Redis's clock: the hosts' clocks may differ
        now=redisclock.now_nowait(request.app[CONN]),
    )


def operator(request: web.Request) -> str:
    """An operator token: for the calls that are not one project's (the app catalog, ICE)."""
    settings = request.app[SETTINGS]
    streamauth.check_secret(settings.stream_secret)
    now = redisclock.now_nowait(request.app[CONN])
    return streamauth.operator_token(settings.stream_secret, settings.stream_token_ttl_s, now)


def _viewer_role(request: web.Request, project: str) -> str:
    """A project's viewers watch; members and admins may control."""
    return "spectator" if user_of(request).role(project) == "viewer" else "controller"


async def call(
    request: web.Request, method: str, url: str, body: Any = None, *, auth: str
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {auth}"}
    try:
        async with request.app[HTTP].request(
            method, url, json=body, timeout=TIMEOUT, headers=headers
        ) as resp:
            if resp.status == 204:
                return 204, None
            data = await resp.json(content_type=None)
            return resp.status, data
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise NoCapacity(f"the stream service at {url} did not answer: {exc}") from None


def _answer(status: int, data: Any) -> web.Response:
    """The stream service's answer; an error it names is raised again as that farm error, so
    the web answers it in the one HTTP form (farm.httperrors) with its headers (Retry-After)."""
    if status == 204:
        return web.Response(status=204)
    error = data.get("error") if status >= 400 and isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        cls = error_class(str(error.get("code")))
        if cls.code == error.get("code"):
            fields = {k: v for k, v in error.items() if k not in ("code", "message")}
            raise cls(error["message"], **fields)
    return web.json_response(data, status=status)


async def apps(request: web.Request) -> web.Response:
    """The app catalog; with ``?project=``, only the apps the user may launch there (desktop
    apps only where the project's policy lets the user's role launch them)."""
    project = request.query.get("project")
    if project:
        role_in(request, project)
    service = (await services(request))[0]
    url = service["url"] + "/api/streams/apps"
    status, data = await call(request, "GET", url, auth=operator(request))
    if project and status == 200 and isinstance(data, dict):
        desktop = await blocking(
            request.app, request.app[ACCOUNTS].may_launch_desktop, user_of(request), project
        )
        if not desktop:
            data = {**data, "apps": [a for a in data.get("apps", []) if not a.get("desktop")]}
    return _answer(status, data)


async def ice(request: web.Request) -> web.Response:
    service = (await services(request))[0]
    url = service["url"] + "/api/streams/ice"
    return _answer(*await call(request, "GET", url, auth=operator(request)))


async def _owners(request: web.Request, sids: list[str]) -> list[dict[str, Any] | None]:
    conn = request.app[CONN]

    def read() -> list[dict[str, Any] | None]:
        pipe = conn.pipeline()
        for sid in sids:
            pipe.get(keys.stream_owner(sid))
        return [json.loads(t) if t else None for t in (guard(pipe.execute) if sids else [])]

    return await blocking(request.app, read)


async def list_sessions(request: web.Request) -> web.Response:
    user = user_of(request)
    project = request.query.get("project")
    if project:
        role_in(request, project)
    found: list[dict[str, Any]] = []
    projects = [project] if project else user.projects_in(request.app[SETTINGS].cell)
    for service in await blocking(request.app, _services, request.app[CONN]):
        # one call per project: a token lists its own project's sessions only
        for listed in projects:
            status, data = await call(
                request, "GET", service["url"] + "/api/streams/sessions",
                auth=token(request, listed),
            )  # fmt: skip
            if status == 200 and isinstance(data, dict):
                found.extend(data.get("sessions", []))
    owners = await _owners(request, [str(s.get("session_id")) for s in found])
    out = []
    for session, owner in zip(found, owners, strict=True):
        if owner is None or user.role(owner["project"]) is None:
            continue
        if project and owner["project"] != project:
            continue
        out.append({**session, "project": owner["project"], "owner": owner["user"]})
    return web.json_response({"sessions": out})


async def create_session(request: web.Request) -> web.Response:
    body = await jsonio.read_object(
        request,
        {"app": str, "width": int, "height": int, "fps": int, "project": str, "device": str},
        required=("app", "project"),
    )
    project = body["project"]
    role = role_in(request, project, "member")
    wanted = body.pop("device", None)
    candidates = await services(request)
    if wanted is not None:
        candidates = [s for s in candidates if device_class(s) == wanted]
        if not candidates:
            raise BadParameter(f"no stream service runs on device class {wanted!r}")
    allowed = []
    for service in candidates:
        try:
            await check_device(request, project, role, device_class(service))
            allowed.append(service)
        except FarmError as exc:
            last_denied: FarmError = exc
    if not allowed:
        raise last_denied
    user = user_of(request).name
    payload = {**body, "owner": user}
    desktop = await blocking(
        request.app, request.app[ACCOUNTS].may_launch_desktop, user_of(request), project
    )
    status, data = 503, None
    for service in allowed:
        status, data = await call(
            request, "POST", service["url"] + "/api/streams/sessions", payload,
            auth=token(request, project, role="controller", desktop=desktop),
        )  # fmt: skip
        if status == 201:
            owner = {"project": project, "user": user, "url": service["url"]}
            await blocking(request.app, guard, request.app[CONN].set,
                           keys.stream_owner(data["session_id"]), json.dumps(owner),
                           ex=OWNER_TTL_S)  # fmt: skip
            log.info("event=stream_started session=%s project=%s user=%s device=%s",
                     data["session_id"], project, user, service.get("device_id"))  # fmt: skip
            return web.json_response({**data, "project": project, "owner": user}, status=201)
        # full now (503) or never on that device (422): another service may take it
        if status not in (422, 503):
            break
    return _answer(status, data)


async def _owned(request: web.Request, at_least: str = "viewer") -> tuple[str, dict[str, Any]]:
    sid = request.match_info["session_id"]
    (owner,) = await _owners(request, [sid])
    if owner is None or user_of(request).role(owner["project"]) is None:
        raise NotFound(f"no stream session {sid!r} in your projects", session_id=sid)
    role_in(request, owner["project"], at_least)
    return sid, owner


async def get_session(request: web.Request) -> web.Response:
    sid, owner = await _owned(request)
    status, data = await call(request, "GET", f"{owner['url']}/api/streams/sessions/{sid}",
                              auth=token(request, owner["project"], sid))  # fmt: skip
    if status == 200:
        data = {**data, "project": owner["project"], "owner": owner["user"]}
    return _answer(status, data)


async def end_session(request: web.Request) -> web.Response:
    sid, owner = await _owned(request, "member")
    status, data = await call(request, "DELETE", f"{owner['url']}/api/streams/sessions/{sid}",
                              auth=token(request, owner["project"], sid, "controller"))  # fmt: skip
    if status in (204, 404):
        await blocking(request.app, guard, request.app[CONN].delete, keys.stream_owner(sid))
    return _answer(status, data)


async def join(request: web.Request) -> web.Response:
    """Add a viewer; a project's viewers always join as spectators."""
    sid, owner = await _owned(request)
    body = await jsonio.read_object(
        request, {"type": str, "sdp": str, "role": str, "name": str}, required=("sdp",)
    )
    if user_of(request).role(owner["project"]) == "viewer":
        body["role"] = "spectator"
    body.setdefault("name", user_of(request).name)
    url = f"{owner['url']}/api/streams/sessions/{sid}/viewers"
    auth = token(request, owner["project"], sid, _viewer_role(request, owner["project"]))
    return _answer(*await call(request, "POST", url, body, auth=auth))


async def leave(request: web.Request) -> web.Response:
    sid, owner = await _owned(request)
    vid = request.match_info["viewer_id"]
    url = f"{owner['url']}/api/streams/sessions/{sid}/viewers/{vid}"
    return _answer(*await call(request, "DELETE", url, auth=token(request, owner["project"], sid)))


async def control(request: web.Request) -> web.Response:
    sid, owner = await _owned(request, "member")
    body = await jsonio.read_object(request, {"viewer_id": str}, required=("viewer_id",))
    url = f"{owner['url']}/api/streams/sessions/{sid}/control"
    auth = token(request, owner["project"], sid, "controller")
    return _answer(*await call(request, "POST", url, body, auth=auth))


async def watch(request: web.Request) -> web.StreamResponse:
    """A viewer over a WebSocket (the player's fallback where WebRTC cannot connect), proxied
    to the session's stream service: video one way, input JSON both ways, frame for frame."""
    sid, owner = await _owned(request)
    if "Authorization" not in request.headers:
        # a browser sends the cookie with a WebSocket opened by any site: only our pages may
        check_origin(request, strict=True)
    project = owner["project"]
    role = request.query.get("role", "player")
    if user_of(request).role(project) == "viewer":
        role = "spectator"
    query = {"role": role, "name": request.query.get("name") or user_of(request).name}
    url = f"{owner['url']}/api/streams/sessions/{sid}/ws"
    auth = token(request, project, sid, _viewer_role(request, project))
    try:
        upstream = await request.app[HTTP].ws_connect(
            url, params=query, headers={"Authorization": f"Bearer {auth}"}, max_msg_size=0,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
        )  # fmt: skip
    except aiohttp.WSServerHandshakeError as exc:
        if exc.status == 404:
            raise NotFound(f"stream session {sid} has ended", session_id=sid) from None
        if exc.status == 403:
            raise Forbidden(f"the stream service refused to join session {sid}") from None
        raise NoCapacity(f"the stream service at {url} refused the WebSocket: {exc}") from None
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise NoCapacity(f"the stream service at {url} did not answer: {exc}") from None
    return await wsrelay.answer(request, upstream)


# --- H7: the files of a session's home, for the members of its project -------------------

#: a file's transfer through the web may take this long
FILE_TIMEOUT = aiohttp.ClientTimeout(total=3600, sock_connect=10)
#: the answer headers of a download passed on to the user
_FILE_HEADERS = ("Content-Type", "Content-Length", "Content-Disposition")


async def _files_url(request: web.Request, name: str | None = None) -> tuple[str, str]:
    """The stream service's URL of the session's files (or one file) and a controller token
    for it; the project's members and admins only (its viewers watch, they take no files)."""
    sid, owner = await _owned(request, "member")
    url = f"{owner['url']}/api/streams/sessions/{sid}/files"
    if name is not None:
        url += "/" + quote(name, safe="")
    return url, token(request, owner["project"], sid, "controller")


async def list_files(request: web.Request) -> web.Response:
    url, auth = await _files_url(request)
    return _answer(*await call(request, "GET", url, auth=auth))


async def download_file(request: web.Request) -> web.StreamResponse:
    url, auth = await _files_url(request, request.match_info["name"])
    headers = {"Authorization": f"Bearer {auth}"}
    try:
        async with request.app[HTTP].get(url, headers=headers, timeout=FILE_TIMEOUT) as resp:
            if resp.status != 200:
                return web.json_response(await resp.json(content_type=None), status=resp.status)
            out = web.StreamResponse(
                headers={k: resp.headers[k] for k in _FILE_HEADERS if k in resp.headers}
            )
            await out.prepare(request)
            async for chunk in resp.content.iter_chunked(1 << 16):
                await out.write(chunk)
            await out.write_eof()
            return out
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise NoCapacity(f"the stream service at {url} did not answer: {exc}") from None


async def upload_file(request: web.Request) -> web.Response:
    url, auth = await _files_url(request, request.match_info["name"])
    headers = {"Authorization": f"Bearer {auth}"}
    if request.content_length is not None:
        headers["Content-Length"] = str(request.content_length)
    try:
        async with request.app[HTTP].put(
            url, data=request.content, headers=headers, timeout=FILE_TIMEOUT
        ) as resp:
            return web.json_response(await resp.json(content_type=None), status=resp.status)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise NoCapacity(f"the stream service at {url} did not answer: {exc}") from None
