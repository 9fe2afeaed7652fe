"""The HTML pages and their static files (web/static/), and the stream player (encoder/static/)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from aiohttp import web

from farm.errors import NotFound

STATIC = Path(__file__).resolve().parent / "static"
#: the stream player's files, as the encoder package ships them (its package data)
PLAYER = files("encoder") / "static"
#: the player's files the web's own pages import too, at /static/<name>: one request helper
#: for both (the stream service serves only the player's folder)
SHARED = frozenset({"request.js"})

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


async def workers_page(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "workers.html")


async def project_page(request: web.Request) -> web.FileResponse:
    return _file(STATIC, "project.html")


async def static_file(request: web.Request) -> web.StreamResponse:
    name = request.match_info["path"]
    if name in SHARED:
        return _player_file(name)
    return _file(STATIC, name)


def _player_file(name: str) -> web.Response:
    """One of the player's files, by its exact name (never a path into or out of the folder)."""
    resource = next((r for r in PLAYER.iterdir() if r.name == name), None)
    if resource is None or not resource.is_file():
        raise NotFound(f"no file {name!r} in the player's files")
    return web.Response(
        body=resource.read_bytes(),
        headers={
            "Content-Type": TYPES.get(Path(name).suffix, "application/octet-stream"),
            "Cache-Control": "no-cache",
        },
    )


async def player(request: web.Request) -> web.Response:
    return _player_file("player.html")


async def player_asset(request: web.Request) -> web.Response:
    return _player_file(f"player.{request.match_info['ext']}")
