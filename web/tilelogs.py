"""A tile attempt's own log (Blender's lines, error detail), for its project only."""

from __future__ import annotations

from aiohttp import web

from farm.errors import BadParameter, NotFound, StorageNotFound
from farm.storage.layout import tile_log_key
from web.appkeys import STORAGE, blocking
from web.jobs import job_for


def _number(request: web.Request, name: str) -> int:
    text = request.match_info[name]
    if not text.isdigit() or len(text) > 9:
        raise BadParameter(f"{name} must be a whole number, not {text!r}", field=name)
    return int(text)


async def tile_log(request: web.Request) -> web.Response:
    """``GET /api/jobs/{job_id}/tiles/{frame}/{tile}/attempts/{attempt}/log``: plain text."""
    status = await job_for(request)  # 404 for a job outside the user's projects
    frame, tile, attempt = (_number(request, n) for n in ("frame", "tile", "attempt"))
    key = tile_log_key(status.id, frame, tile, attempt)
    try:
        data = await blocking(request.app, request.app[STORAGE].read_bytes, key)
    except StorageNotFound:
        raise NotFound(
            f"job {status.id} has no log for frame {frame} tile {tile} attempt {attempt} "
            "(an attempt has one once it ended)",
            job_id=status.id,
        ) from None
    return web.Response(text=data.decode("utf-8", "replace"), content_type="text/plain")
