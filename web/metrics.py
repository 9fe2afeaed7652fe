"""GET /metrics: this web's Prometheus metrics, with the farm-wide ones read from Redis."""

from __future__ import annotations

from aiohttp import web

from farm import metrics as farm_metrics
from web.appkeys import blocking


async def metrics(request: web.Request) -> web.Response:
    # exposition reads Redis (the farm collector): off the event loop
    body, content_type = await blocking(request.app, farm_metrics.exposition)
    return web.Response(body=body, headers={"Content-Type": content_type})
