"""Security headers on every response of the web, and no server version (farm.browserrules)."""

from __future__ import annotations

from aiohttp import web

from farm import browserrules
from web.appkeys import SETTINGS


def _tls(request: web.Request) -> bool:
    return request.secure or request.app[SETTINGS].tls_cert is not None


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, the router's 404s and file responses included, gets the headers."""
    browserrules.apply(response.headers, request.path, _tls(request))
