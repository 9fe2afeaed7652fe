"""A live-preview job's frame converging, as server-sent events: each tile's current pass at
once (a viewer joining mid-frame), then every pass as it lands; the JPEG/SSE path the job page
uses (farm.livepreview keeps the passes)."""

from __future__ import annotations

import logging

from aiohttp import web

from farm import livepreview
from farm.livepreview import TilePass
from web.appkeys import STORE, blocking, waiting
from web.events import BLOCK_MS, job_over, sse_response
from web.jobs import job_for

log = logging.getLogger("tessera.web.live")


def _message(kind: str, entry_id: str, tile_pass: TilePass) -> bytes:
    return f"event: {kind}\nid: {entry_id}\ndata: {tile_pass.to_json()}\n\n".encode()


async def live_passes(request: web.Request) -> web.StreamResponse:
    """The frame's current state (``pass`` events, then ``ready``), then each new ``pass``
    until the job ends (``end``). Viewers of the job's project only (job_for)."""
    status = await job_for(request)
    conn = request.app[STORE].conn
    after, current = await blocking(request.app, livepreview.snapshot, conn, status.id)
    resp = await sse_response(request)
    try:
        for tile_pass in current:
            await resp.write(_message("pass", after, tile_pass))
        await resp.write(b"event: ready\ndata: {}\n\n")
        while True:
            batch = await waiting(request.app, livepreview.follow, conn, status.id, after, BLOCK_MS)
            for entry_id, tile_pass in batch:
                after = entry_id
                await resp.write(_message("pass", entry_id, tile_pass))
            if batch:
                continue
            if await job_over(request, status.id):
                break
            await resp.write(b": waiting\n\n")
    except (ConnectionResetError, ConnectionError):
        log.info("event=live_client_gone job=%s", status.id)
        return resp
    await resp.write(b"event: end\ndata: {}\n\n")
    await resp.write_eof()
    return resp
