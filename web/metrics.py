"""GET /metrics: this web's Prometheus metrics, with the farm-wide ones read from Redis.

On the web's own port it asks for FARM_METRICS_TOKEN (or a farm admin's API token); with
FARM_WEB_METRICS_PORT it is served on a scrape-only address instead, and not on the web's.
"""

from __future__ import annotations

import asyncio
import hmac

from aiohttp import web

from farm import metrics as farm_metrics
from farm.errors import Forbidden, NotFound, Unauthorized
from web.appkeys import ACCOUNTS, SETTINGS, blocking


def _bearer(request: web.Request) -> str:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized(
            "/metrics needs `Authorization: Bearer <FARM_METRICS_TOKEN>` (or a farm admin's "
            "API token)"
        )
    return value.strip()


async def _check(request: web.Request) -> None:
    token = _bearer(request)
    expected = request.app[SETTINGS].metrics_token
    if expected and hmac.compare_digest(token.encode(), expected.encode()):
        return
    accounts = request.app[ACCOUNTS]
    name = await blocking(request.app, accounts.user_for_token, token)
    user = await blocking(request.app, accounts.user, name) if name else None
    if user is None:
        raise Unauthorized("that token is not valid for /metrics")
    if not user.admin:
        raise Forbidden("/metrics is for the farm's operators: FARM_METRICS_TOKEN or an admin")


async def metrics(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    if settings.web_metrics_port:
        raise NotFound("metrics are served on their own address (FARM_WEB_METRICS_PORT)")
    await _check(request)
    # exposition reads Redis (the farm collector): off the event loop
    body, content_type = await blocking(request.app, farm_metrics.exposition)
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _scrape(request: web.Request) -> web.Response:
    body, content_type = await asyncio.get_running_loop().run_in_executor(
        None, farm_metrics.exposition
    )
    return web.Response(body=body, headers={"Content-Type": content_type})


def scrape_app() -> web.Application:
    """The scrape-only app of FARM_WEB_METRICS_PORT: GET /metrics and nothing else."""
    app = web.Application()
    app.router.add_get("/metrics", _scrape)
    return app
