"""`farm frontdoor`: one address for a farm split in cells (farm.cells).

Each cell is a whole farm with its own web; every web shares the control Redis for accounts.
The front door holds no state of its own: it sends each request to the cell that holds what
the request names, and streams the answer back (bodies, server-sent events and WebSockets
alike), with the client's own headers, so each cell's web checks the login, the origin and
the role as it would answer the client itself.

Where a request goes, first rule that applies:

1. a job (``/api/jobs/<id>``, ``/jobs/<id>``), an upload session
   (``/api/uploads/sessions/<id>``) or a stream session (``/api/streams/sessions/<id>``, made
   by a stream service run with FARM_CELL): the cell its id begins with (the default cell for
   a job made before the farm had cells);
2. a project (``/api/projects/<project>/...``, ``?project=``, or the ``project`` field of a JSON
   body): the cell the project is pinned to, read from the control Redis (the default cell for
   a project not pinned yet, which that cell then pins). A new project (``POST /api/tokens``
   naming one that does not exist) goes to the cell the body names, else to one picked by a
   hash of its name, so that new projects spread over the cells;
3. a list over all the user's projects or the farm (``GET /api/me``, ``/api/jobs``,
   ``/api/uploads``, ``/api/streams/sessions``, ``/api/workers``, ``/api/estimates/errors``
   without a project): every cell, the lists put together (a cell that does not answer is
   left out and named in ``cells_unreachable``); a batch action on jobs of several
   cells (``POST /api/jobs/batch``) is split by cell and its results joined. A live feed of
   every project (``/api/events``) and ``/metrics`` are not: the answer (400) says what to ask
   instead;
4. anything else (logging in, tokens, pages, a stream session whose id names no cell): each
   cell in turn, the default first, until one does not answer 404 (a cell answers 404 for
   what it does not hold, so the answer is the holder's; what every cell holds, accounts, the
   default answers).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from farm import cells as farm_cells
from farm import jobstore, metrics
from farm.accounts import Accounts
from farm.httperrors import error_body
from farm.settings import Settings
from web import wsrelay
from web.jobs import merged_jobs

log = logging.getLogger("tessera.frontdoor")

SETTINGS = web.AppKey("settings", Settings)
CELLS = web.AppKey("cells", dict[str, str])
#: the accounts in the control Redis: projects' pins (kept once read) and whether one exists
ACCOUNTS = web.AppKey("accounts", Accounts)
CLIENT = web.AppKey("client", aiohttp.ClientSession)

#: headers of one hop only (RFC 9110 7.6.1), never passed on
HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length",
    )
)  # fmt: skip
#: the largest body read whole to find its project, or to send to more than one cell; a
#: larger one (an upload) names its project in the query
BUFFERED_BYTES = 1 << 20
#: paths whose next segment is an id that begins with its cell's name
_CELL_ID = re.compile(
    r"^/(?:api/)?jobs/([^/]+)|^/api/uploads/sessions/([^/]+)|^/api/streams/sessions/([^/]+)"
)
_PROJECT_PATH = re.compile(r"^/api/projects/([^/]+)")
#: lists over all the user's projects, put together from every cell: path -> the list's key
MERGED = {
    "/api/me": "projects",
    "/api/jobs": "jobs",
    "/api/uploads": "uploads",
    "/api/streams/sessions": "sessions",
    "/api/workers": "workers",
    "/api/estimates/errors": "errors",
}
#: what one cell answers for itself only, and the front door does not put together: path ->
#: what to ask instead
PER_CELL = {
    "/api/events": "a live feed follows one project in a farm of cells: ?project=<id>",
    "/metrics": "scrape each cell's /metrics (Prometheus sums them across its targets)",
}
#: a cell's answer that says "not here": the next cell is asked
NOT_HERE = frozenset({404, 421})


def _default(cells: dict[str, str]) -> str:
    """The first cell listed: it holds what was made before the farm had cells."""
    return next(iter(cells))


def _passed(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}


def _handshake_free(request: web.Request) -> dict[str, str]:
    """The client's headers for a WebSocket to a cell, less its own handshake's (the door's
    client makes its own key; the probe asks with a plain GET)."""
    return {k: v for k, v in _passed(request.headers).items()
            if not k.lower().startswith("sec-websocket")}  # fmt: skip


async def _project_cell(app: web.Application, project: str) -> str:
    cells = app[CELLS]
    pinned = await asyncio.to_thread(app[ACCOUNTS].project_cell, project)
    return pinned if pinned in cells else _default(cells)


def _body_project(body: bytes | None, content_type: str) -> str | None:
    if not body or content_type != "application/json":
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    project = data.get("project") if isinstance(data, dict) else None
    return project if isinstance(project, str) and project else None


async def _chosen(request: web.Request, body: bytes | None) -> str | None:
    """The one cell the request names (rules 1 and 2), or None."""
    cells = request.app[CELLS]
    if match := _CELL_ID.match(request.path):
        ident = match.group(1) or match.group(2) or match.group(3)
        named = farm_cells.cell_in(ident)
        if named in cells:
            return named
        if match.group(1) and farm_cells.JOB_ID_RE.fullmatch(ident):
            return _default(cells)  # a job made before the farm had cells
    project = None
    if match := _PROJECT_PATH.match(request.path):
        project = match.group(1)
    project = project or request.query.get("project") or _body_project(body, request.content_type)
    return await _project_cell(request.app, project) if project else None


async def _read_small(request: web.Request) -> tuple[bytes | None, bytes]:
    """The whole body where it is at most BUFFERED_BYTES (None: larger), and what of it was
    read already (a body without a length is read until it proves larger: then streamed on)."""
    if not request.body_exists:
        return b"", b""
    if request.content_length is not None:
        if request.content_length > BUFFERED_BYTES:
            return None, b""
        return await request.read(), b""
    head = bytearray()
    while len(head) <= BUFFERED_BYTES:
        chunk = await request.content.readany()
        if not chunk:
            return bytes(head), b""
        head += chunk
    return None, bytes(head)


async def _streamed(head: bytes, request: web.Request) -> AsyncIterator[bytes]:
    """The body as it arrives, after the part of it read already."""
    if head:
        yield head
    async for chunk in request.content.iter_any():
        yield chunk


async def _send(
    request: web.Request, cell: str, body: bytes | AsyncIterator[bytes] | None
) -> aiohttp.ClientResponse:
    url = request.app[CELLS][cell] + request.path_qs
    headers = _passed(request.headers)
    if body is not None and not isinstance(body, bytes) and request.content_length is not None:
        # a streamed body keeps its length: the cell refuses one too large before reading it
        headers["Content-Length"] = str(request.content_length)
    headers["X-Forwarded-For"] = request.remote or ""
    headers["X-Forwarded-Proto"] = request.scheme
    started = time.perf_counter()
    try:
        answer = await request.app[CLIENT].request(
            request.method, url, headers=headers, data=body, allow_redirects=False
        )
    except aiohttp.ClientError as exc:
        log.warning("event=cell_unreachable cell=%s error=%r", cell, exc)
        metrics.FRONTDOOR_REQUESTS.labels(cell, "unreachable").inc()
        raise _unreachable(cell) from None
    metrics.FRONTDOOR_SECONDS.labels(cell).observe(time.perf_counter() - started)
    metrics.FRONTDOOR_REQUESTS.labels(cell, f"{answer.status // 100}xx").inc()
    return answer


def _unreachable(cell: str) -> web.HTTPBadGateway:
    message = f"cell {cell} of the farm does not answer; try again in a moment"
    return web.HTTPBadGateway(
        text=json.dumps(error_body("cell_unreachable", message, cell=cell)),
        content_type="application/json",
    )


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """The cell's answer, streamed to the client as it comes (events, downloads)."""
    resp = web.StreamResponse(status=upstream.status, reason=upstream.reason)
    for k, v in upstream.headers.items():
        if k.lower() not in HOP_HEADERS:
            resp.headers.add(k, v)
    if upstream.headers.get("Content-Length") is not None:
        resp.content_length = int(upstream.headers["Content-Length"])
    await resp.prepare(request)
    try:
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
    finally:
        upstream.release()
    return resp


async def _merged(request: web.Request, key: str) -> web.StreamResponse:
    """Rule 3: every cell's list, put together (newest job first, as one cell's list is). A
    cell that does not answer leaves its part out, named in ``cells_unreachable``: one cell
    down must not take the others' lists (and the pages that read them) down with it."""
    cells: dict[str, str] = request.app[CELLS]
    sent = await asyncio.gather(
        *(_send(request, cell, b"") for cell in cells), return_exceptions=True
    )
    answers = [a for a in sent if isinstance(a, aiohttp.ClientResponse)]
    missing = [cell for cell, a in zip(cells, sent, strict=True) if isinstance(a, BaseException)]
    out: dict[str, Any] | None = None
    try:
        for failed in sent:
            if isinstance(failed, BaseException) and not isinstance(failed, web.HTTPBadGateway):
                raise failed
        if not answers:
            raise _unreachable(missing[0])
        for upstream in answers:
            if upstream.status != 200:
                return await _relay(request, upstream)
            data = await upstream.json()
            if out is None:
                out = data
            else:
                out[key].extend(data.get(key, []))
    finally:
        for upstream in answers:
            upstream.release()
    assert out is not None
    if key == "jobs":
        out["jobs"] = merged_jobs(out["jobs"], request.query)
    if missing:
        out["cells_unreachable"] = missing
    return web.json_response(out)


async def _batch(request: web.Request, body: bytes) -> web.StreamResponse:
    """``POST /api/jobs/batch``: each cell acts on its own jobs; the results in the order
    asked for, as one cell's would be."""
    try:
        data = json.loads(body)
        ids = list(dict.fromkeys(data["ids"]))
        by_cell: dict[str, list[str]] = {}
        for job_id in ids:
            named = farm_cells.cell_in(job_id) if isinstance(job_id, str) else None
            by_cell.setdefault(
                named if named in request.app[CELLS] else _default(request.app[CELLS]), []
            ).append(job_id)
    except (ValueError, KeyError, TypeError):
        by_cell = {}
    if len(by_cell) < 2:
        # one cell (or a body that cell will refuse with its own 400)
        cell = next(iter(by_cell), _default(request.app[CELLS]))
        return await _relay(request, await _send(request, cell, body))
    results: dict[str, Any] = {}
    answer: dict[str, Any] = {"action": data.get("action")}
    for cell, part in by_cell.items():
        try:
            upstream = await _send(request, cell, json.dumps({**data, "ids": part}).encode())
        except web.HTTPBadGateway:
            # the other cells acted on theirs: each of this cell's jobs says why it did not
            message = f"cell {cell} of the farm does not answer; try again in a moment"
            for i in part:
                results[i] = {"job_id": i, "ok": False, "status": 502,
                              "error": "cell_unreachable", "message": message}  # fmt: skip
            continue
        if upstream.status != 200:
            return await _relay(request, upstream)
        try:
            answer = await upstream.json()
        finally:
            upstream.release()
        results.update((r["job_id"], r) for r in answer["results"])
    return web.json_response({**answer, "results": [results[i] for i in ids if i in results]})


async def _new_project(request: web.Request, body: bytes) -> web.StreamResponse | None:
    """``POST /api/tokens`` that makes a project: the project goes to the cell its body names,
    else to a cell picked by a hash of its name, so new projects spread over the cells. None:
    not such a request (or the project exists: it keeps its cell)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    project = data.get("project") if isinstance(data, dict) else None
    if not isinstance(project, str) or not project:
        return None
    cells: dict[str, str] = request.app[CELLS]
    named = data.get("cell")
    if named is not None and named not in cells:
        message = f"cell {named!r} is not one of this farm's: {', '.join(cells)}"
        return web.json_response(error_body("bad_parameter", message, field="cell"), status=400)
    if await asyncio.to_thread(request.app[ACCOUNTS].project_exists, project):
        return None
    cell = named or list(cells)[zlib.crc32(project.encode()) % len(cells)]
    sent = json.dumps({**data, "cell": cell}).encode()
    return await _relay(request, await _send(request, cell, sent))


async def _websocket(request: web.Request, cell: str) -> web.StreamResponse:
    url = request.app[CELLS][cell].replace("http", "ws", 1) + request.path_qs
    headers = _handshake_free(request)
    try:
        far = await request.app[CLIENT].ws_connect(
            url, headers=headers, max_msg_size=0,
            timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
        )  # fmt: skip
    except aiohttp.WSServerHandshakeError as exc:
        # the cell refused (no login, not the user's session): its status, as it said it
        return web.json_response(error_body("refused", exc.message, cell=cell), status=exc.status)
    return await wsrelay.answer(request, far)


async def _probe_cell(request: web.Request) -> str:
    """The cell that holds a WebSocket's path: the first to answer a plain GET of it with
    anything but 404 (the cell that holds it answers 400, no upgrade asked)."""
    for cell in request.app[CELLS]:
        url = request.app[CELLS][cell] + request.path_qs
        headers = _handshake_free(request)
        async with request.app[CLIENT].get(url, headers=headers, allow_redirects=False) as r:
            if r.status not in NOT_HERE:
                return cell
    return _default(request.app[CELLS])


async def forward(request: web.Request) -> web.StreamResponse:
    upgrade = request.headers.get("Upgrade", "").lower() == "websocket"
    # a body too large to read whole is streamed, to a cell the request names
    body, head = (None, b"") if upgrade else await _read_small(request)
    making = request.method == "POST" and request.path == "/api/tokens" and body
    if making and (made := await _new_project(request, body or b"")) is not None:
        return made
    cell = await _chosen(request, body)
    if upgrade:
        return await _websocket(request, cell or await _probe_cell(request))
    if request.method == "POST" and request.path == "/api/jobs/batch" and body is not None:
        return await _batch(request, body)
    if cell is None and request.path in PER_CELL:
        return web.json_response(error_body("per_cell", PER_CELL[request.path]), status=400)
    if cell is None and request.method == "GET" and request.path in MERGED:
        return await _merged(request, MERGED[request.path])
    if cell is not None:
        data: bytes | AsyncIterator[bytes] | None = body
        if body is None:
            data = _streamed(head, request)
        return await _relay(request, await _send(request, cell, data))
    if body is None:
        raise web.HTTPRequestEntityTooLarge(
            max_size=BUFFERED_BYTES,
            actual_size=request.content_length or 0,
            text="a body this large must name its project: ?project=<id>",
        )
    cells: dict[str, str] = request.app[CELLS]
    names = list(cells)
    for i, cell in enumerate(names):
        upstream = await _send(request, cell, body)
        if upstream.status in NOT_HERE and i < len(names) - 1:
            upstream.release()
            continue
        return await _relay(request, upstream)
    raise AssertionError("unreachable: the last cell's answer is relayed")


async def health(request: web.Request) -> web.Response:
    cells: dict[str, str] = request.app[CELLS]
    return web.json_response({"ok": True, "cells": list(cells)})


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    control = jobstore.connect(settings.accounts_redis_url)
    app[ACCOUNTS] = Accounts(control)
    app[CLIENT] = aiohttp.ClientSession(
        auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=10)
    )
    try:
        yield
    finally:
        await app[CLIENT].close()
        control.close()


def create_frontdoor(settings: Settings) -> web.Application:
    """The front door of the cells FARM_CELLS lists (accounts in FARM_CONTROL_REDIS_URL)."""
    if not settings.cells:
        from farm.errors import BadParameter

        raise BadParameter("farm frontdoor needs FARM_CELLS: name=url of each cell's web")
    app = web.Application(client_max_size=BUFFERED_BYTES)
    app[SETTINGS] = settings
    app[CELLS] = farm_cells.parse_cells(settings.cells)
    app.cleanup_ctx.append(_resources)
    app.router.add_get("/frontdoor/healthz", health)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app
