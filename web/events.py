"""A job's progress as server-sent events, read from its Redis stream with XREAD BLOCK."""

from __future__ import annotations

import json
import logging
import re

from aiohttp import web

from farm.errors import BadParameter, NotFound
from farm.states import JOB_FINAL, JobState
from web.appkeys import STORE, blocking, waiting
from web.jobs import job_for

log = logging.getLogger("tessera.web.events")

#: longest one XREAD waits (well under redis-py 8's default 5 s socket timeout); a comment
#: line goes out after each empty wait, which keeps proxies from closing the stream
BLOCK_MS = 2000
#: events one XREAD returns at most (JobStore.events)
READ_COUNT = 1000


def sse(entry_id: str, data: str) -> bytes:
    return f"id: {entry_id}\ndata: {data}\n\n".encode()


async def sse_response(request: web.Request) -> web.StreamResponse:
    """A server-sent event stream, started: never cached, never buffered by a proxy."""
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    return resp


async def job_over(request: web.Request, job_id: str) -> bool:
    """Whether nothing more will come of the job: it ended, or was deleted meanwhile
    (web.jobcontrol)."""
    try:
        state = await blocking(request.app, request.app[STORE].state, job_id)
    except NotFound:
        return True
    return state in JOB_FINAL


async def job_events(request: web.Request) -> web.StreamResponse:
    """Every event of the job (from ``Last-Event-ID`` or ``?after=`` on), then the end."""
    status = await job_for(request)
    store = request.app[STORE]
    after = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    if not re.fullmatch(r"\d+(-\d+)?", after):
        raise BadParameter(f"event id {after!r} is not a stream id like 1700000000000-0")
    resp = await sse_response(request)
    ended = False
    try:
        while not ended:
            batch = await waiting(request.app, store.events, status.id, after, block_ms=BLOCK_MS)
            for event in batch:
                after = event.id
                await resp.write(sse(event.id, json.dumps(event.to_dict())))
                if event.type == "job_state":
                    # the latest move decides: a requeue runs an ended job again
                    ended = JobState(event.state) in JOB_FINAL
            if ended and len(batch) >= READ_COUNT:
                ended = False  # more of the history may follow (an end, then a requeue)
            if not batch:
                if await job_over(request, status.id):
                    break
                await resp.write(b": waiting\n\n")
    except (ConnectionResetError, ConnectionError):
        log.info("event=sse_client_gone job=%s", status.id)
        return resp
    await resp.write_eof()
    return resp
