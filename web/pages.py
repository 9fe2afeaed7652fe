"""The HTML pages and their static files (web/static/), and the stream player (encoder/static/)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from farm.errors import NotFound

STATIC = Path(__file__).resolve().parent / "static"
PLAYER = Path(__file__).resolve().parent.parent / "encoder" / "static"
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}


def _file(folder: Path, name: str) -> web.FileResponse:
    path = (folder / name).resolve()
    if not path.is_relative_to(folder) or not path.is_file():
        raise NotFound(f"no file {name!r}")
    return web.FileResponse(
        path,
        headers={
            "Content-Type": TYPES.get(path.suffix, "application/octet-stream"),
            "Cache-Control": "no-cache",
        },
    )


async def index(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "index.html")


async def login_page(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "login.html")


async def upload_page(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "upload.html")


async def job_page(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "job.html")


async def streams_page(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "streams.html")


async def static_file(request: web.Request) -> web.FileResponse:
    return _file(STATIC, request.match_info["path"])


async def player(request: web.Request) -> web.FileResponse:
    return _file(PLAYER, "player.html")


async def player_asset(request: web.Request) -> web.FileResponse:
    return _file(PLAYER, f"player.{request.match_info['ext']}")
