"""Security headers on every response of the web, and no server version (farm.browserrules)."""

from __future__ import annotations

from aiohttp import web

from farm import browserrules
from web.appkeys import SETTINGS


def forwarded_tls(request: web.Request) -> bool:
    """A front door (farm frontdoor, which sets the header itself) says the client reached it
    over TLS. A client that claims it falsely gains only stricter answers (HSTS, a Secure
    cookie), which its browser ignores or keeps to itself over plain HTTP."""
    return request.headers.get("X-Forwarded-Proto", "").lower() == "https"


def over_tls(request: web.Request) -> bool:
    """The client reached the farm over TLS: here, or at the front door."""
    return request.secure or forwarded_tls(request) or request.app[SETTINGS].tls_cert is not None


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, the router's 404s and file responses included, gets the headers."""
    browserrules.apply(response.headers, request.path, over_tls(request))
