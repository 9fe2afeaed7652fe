"""The stream service's HTTP API: its URL table, small handlers, middlewares and typed app keys
(the app itself is built by encoder/app.py)."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import quote

from aiohttp import web

from encoder.files import Home
from encoder.observe import StreamMetrics
from encoder.turn import ice_servers
from encoder.wsviewer import WsViewer
from farm import metrics, redisclock, streamauth
from farm.errors import BadParameter, FarmError, Forbidden, NotFound, TooLarge, Unauthorized
from farm.httperrors import http_error
from farm.settings import Settings
from farm.streamauth import StreamClaims, require_controller, require_session

if TYPE_CHECKING:
    from encoder.service import StreamService

STATIC = Path(__file__).resolve().parent / "static"
SETTINGS = web.AppKey("settings", Settings)
#: the device's service, opened and closed with the app (encoder/app.py)
SERVICE: web.AppKey[StreamService] = web.AppKey("stream_service")
CLAIMS: web.RequestKey[StreamClaims] = web.RequestKey("stream_claims", StreamClaims)
#: the player's page and files: the only routes answered without a stream token (no data)
PUBLIC = frozenset({"/player", "/player.js", "/player.css"})
STREAM_METRICS: web.AppKey[StreamMetrics] = web.AppKey("stream_metrics", StreamMetrics)
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css",
          ".svg": "image/svg+xml"}  # fmt: skip


@web.middleware
async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """A farm error answers in its one HTTP form (farm.httperrors), as the web's do."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except FarmError as exc:
        err = http_error(exc)
        return web.json_response(err.body, status=err.status, headers=err.headers)


@web.middleware
async def authenticate(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every route but the player's files needs a stream token: ``Authorization: Bearer``
    (the web's proxy, operators) or ``?token=`` (the player page opened on this service)."""
    if request.path in PUBLIC or request.path.startswith("/static/"):
        response: web.StreamResponse = await handler(request)
        return response
    header = request.headers.get("Authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    token = token or request.query.get("token", "")
    if not token:
        raise Unauthorized("a stream token is needed: Authorization: Bearer <token>")
    settings = request.app[SETTINGS]
    scrape = settings.metrics_token
    if request.path == "/metrics" and scrape and hmac.compare_digest(token, scrape):
        # Prometheus' static FARM_METRICS_TOKEN (as the web takes it): good for /metrics alone
        request[CLAIMS] = StreamClaims("operator", exp=math.inf)
    else:
        # on Redis's clock, as the web signed it (another host's clock may differ)
        conn = request.app[SERVICE].conn
        now = redisclock.now_nowait(conn) if conn is not None else None
        request[CLAIMS] = streamauth.verify(settings.stream_secret, token, now)
    response = await handler(request)
    return response


def _claims(request: web.Request) -> StreamClaims:
    return request[CLAIMS]


def _operator(request: web.Request) -> None:
    if not _claims(request).operator:
        raise Forbidden("this route is for operators (an operator stream token)")


def _session_of(request: web.Request, controller: bool = False) -> str:
    """The session id of the URL, which the token must be for (a controller's if asked)."""
    sid = request.match_info["sid"]
    claims = _claims(request)
    require_session(claims, sid)
    if controller:
        require_controller(claims)
    return sid


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        _bad("the body is not JSON")
    if not isinstance(body, dict):
        _bad("the body must be a JSON object")
    return body


def _bad(message: str) -> NoReturn:
    raise BadParameter(message)


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(f"{name} must be a whole number, not {value!r}")
    return int(value)


def _str(body: dict[str, Any], name: str, default: str = "") -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        _bad(f"{name} must be a string")
    return str(value)


async def apps(request: web.Request) -> web.Response:
    return web.json_response({"apps": request.app[SERVICE].catalog.to_json()})


async def device(request: web.Request) -> web.Response:
    _operator(request)
    return web.json_response(request.app[SERVICE].registration())


async def list_sessions(request: web.Request) -> web.Response:
    claims = _claims(request)
    sessions = [
        s
        for s in request.app[SERVICE].sessions.values()
        if claims.operator or s.project == claims.project
    ]
    return web.json_response({"sessions": [s.to_json() for s in sessions]})


async def create_session(request: web.Request) -> web.Response:
    claims = _claims(request)
    require_controller(claims)
    body = await _body(request)
    service = request.app[SERVICE]
    name = _str(body, "app")
    if service.catalog.get(name).desktop and not (claims.operator or claims.desktop):
        raise Forbidden(
            f"app {name} is a desktop app: the project's policy does not let your role launch "
            "it (by default only project admins may)",
            app=name,
        )
    project = _str(body, "project") if claims.operator else claims.project
    session = await service.create_session(
        name,
        width=_int(body, "width"),
        height=_int(body, "height"),
        fps=_int(body, "fps"),
        project=project,
        owner=_str(body, "owner"),
        # the lease obeys the project's device policy for the owner's role (an operator: none)
        role="" if claims.operator else claims.project_role,
    )
    return web.json_response(session.to_json(), status=201)


async def get_session(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].session_json(_session_of(request)))


async def end_session(request: web.Request) -> web.Response:
    await request.app[SERVICE].end_session(_session_of(request, controller=True))
    return web.Response(status=204)


async def add_viewer(request: web.Request) -> web.Response:
    session = request.app[SERVICE].session(_session_of(request))
    body = await _body(request)
    role = _str(body, "role", "player")
    if role != "spectator" and _claims(request).role == "spectator":
        raise Forbidden("a spectator's token joins as spectator only")
    if body.get("type", "offer") != "offer" or not isinstance(body.get("sdp"), str):
        _bad('a viewer joins with {"type": "offer", "sdp": "..."} (ICE gathering complete)')
    viewer, answer = await session.add_viewer(body["sdp"], role, _str(body, "name"))
    return web.json_response(
        {"viewer_id": viewer.id, "role": viewer.role, "type": "answer", "sdp": answer,
         "controlling": session.controller == viewer.id}
    )  # fmt: skip


async def ws_viewer(request: web.Request) -> web.StreamResponse:
    """A viewer on a WebSocket (the fallback where WebRTC cannot connect): binary messages
    carry the session's encoded video (encoder/wsviewer.py), text messages the same JSON as
    the data channel, both ways. Query: ``role``, ``name``."""
    service = request.app[SERVICE]
    session = service.session(_session_of(request))
    role = request.query.get("role", "player")
    if role != "spectator" and _claims(request).role == "spectator":
        raise Forbidden("a spectator's token joins as spectator only")
    if role not in ("player", "spectator"):
        _bad(f"role must be player or spectator, not {role!r}")
    # oversized messages are the session's to drop and count, not the socket's to close on
    ws = web.WebSocketResponse(
        max_msg_size=max(1 << 16, 16 * service.settings.stream_message_max_bytes),
        heartbeat=30.0,  # a dead peer is found within 45 s (pong within half of it)
    )
    await ws.prepare(request)
    WsViewer.limit_send_buffer(request.transport)
    try:
        viewer = session.add_ws_viewer(ws, role, request.query.get("name", ""))
    except FarmError as exc:  # the session ended meanwhile: the socket is open, say it there
        await ws.send_json({"t": "error", "code": exc.code, "message": exc.message})
        await ws.close()
        return ws
    state = session.to_json()
    await ws.send_json(
        {"t": "hello", "viewer_id": viewer.id, "role": viewer.role, "session_id": session.id,
         "controlling": session.controller == viewer.id,
         "width": state["width"], "height": state["height"]}
    )  # fmt: skip
    await viewer.run()
    return ws


async def remove_viewer(request: web.Request) -> web.Response:
    session = request.app[SERVICE].session(_session_of(request))
    await session.remove_viewer(request.match_info["vid"])
    return web.Response(status=204)


async def control(request: web.Request) -> web.Response:
    session = request.app[SERVICE].session(_session_of(request, controller=True))
    body = await _body(request)
    session.hand_control(_str(body, "viewer_id"))
    return web.json_response(session.to_json())


def _home(request: web.Request) -> Home:
    """The home folder of the URL's session: its controlling viewers' tokens only (H7)."""
    session = request.app[SERVICE].session(_session_of(request, controller=True))
    home = session.source.home
    if home is None:
        raise NotFound(f"session {session.id} has no home folder (its app is not sandboxed)")
    s = request.app[SETTINGS]
    return Home(home, s.sandbox_uid, s.sandbox_gid, s.stream_file_max_mib << 20)


async def list_files(request: web.Request) -> web.Response:
    return web.json_response({"files": await asyncio.to_thread(_home(request).list)})


async def download_file(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    fd, size = _home(request).open(name)
    with os.fdopen(fd, "rb") as f:
        response = web.StreamResponse(headers={
            "Content-Type": "application/octet-stream", "Content-Length": str(size),
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name)}",
        })  # fmt: skip
        await response.prepare(request)
        while chunk := await asyncio.to_thread(f.read, 1 << 16):
            await response.write(chunk)
        await response.write_eof()
    return response


async def upload_file(request: web.Request) -> web.Response:
    home, name = _home(request), request.match_info["name"]
    if (request.content_length or 0) > home.max_bytes:
        raise TooLarge(f"the file is over the session's upload limit of {home.max_bytes} bytes")
    size = await home.write(name, request.content.iter_chunked(1 << 16))
    return web.json_response({"name": name, "size": size}, status=201)


async def ice(request: web.Request) -> web.Response:
    user = request.query.get("user", "viewer")
    return web.json_response({"iceServers": ice_servers(request.app[SETTINGS], user)})


def _static(name: str) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        return _file(name)

    return handler


async def static_file(request: web.Request) -> web.StreamResponse:
    return _file(request.match_info["name"])


def _file(name: str) -> web.StreamResponse:
    path = (STATIC / name).resolve()
    if path.parent != STATIC or not path.is_file():
        raise NotFound(f"no file {name} in the player's files")
    return web.FileResponse(
        path,
        headers={
            "Content-Type": _TYPES.get(path.suffix, "application/octet-stream"),
            "Cache-Control": "no-cache",
        },
    )


async def metrics_view(request: web.Request) -> web.Response:
    """Prometheus metrics of this service (an operator token: scrapers send it as bearer)."""
    _operator(request)
    await request.app[STREAM_METRICS].update(request.app[SERVICE])
    body, content_type = metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": content_type})


#: the stream API of /tmp/plan/stream-contract.md, and the player's files
ROUTES = [
    web.get("/api/streams/apps", apps),
    web.get("/api/streams/device", device),
    web.get("/api/streams/ice", ice),
    web.get("/api/streams/sessions", list_sessions),
    web.post("/api/streams/sessions", create_session),
    web.get("/api/streams/sessions/{sid}", get_session),
    web.delete("/api/streams/sessions/{sid}", end_session),
    web.post("/api/streams/sessions/{sid}/viewers", add_viewer),
    web.delete("/api/streams/sessions/{sid}/viewers/{vid}", remove_viewer),
    web.get("/api/streams/sessions/{sid}/ws", ws_viewer),
    web.post("/api/streams/sessions/{sid}/control", control),
    web.get("/api/streams/sessions/{sid}/files", list_files),
    web.get("/api/streams/sessions/{sid}/files/{name}", download_file),
    web.put("/api/streams/sessions/{sid}/files/{name}", upload_file),
    web.get("/metrics", metrics_view),
    web.get("/player", _static("player.html")),
    web.get("/player.js", _static("player.js")),
    web.get("/player.css", _static("player.css")),
    web.get("/static/{name}", static_file),
]
