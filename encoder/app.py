"""create_app(settings): the stream service's aiohttp app, whose StreamService opens and closes in
cleanup_ctx; serving it on its port and announcing it (`farm stream`, tests, benches).

From async code::

    async with serving(settings) as svc:   # FARM_STREAM_PORT (0: a free port)
        svc.url                            # http://127.0.0.1:PORT

from synchronous code, ``with running(settings) as svc:`` (its own thread and loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from aiohttp import web

from encoder.observe import StreamMetrics
from encoder.routes import ROUTES, SERVICE, SETTINGS, STREAM_METRICS, authenticate, errors
from encoder.service import FROM_SETTINGS, StreamService
from farm import browserrules, streamauth
from farm.gpu.types import Nvml
from farm.settings import Settings


def create_app(
    settings: Settings,
    *,
    nvml: Nvml | None = FROM_SETTINGS,
    name: str | None = None,
    hostname: str | None = None,
) -> web.Application:
    """The stream API of the device ``settings`` name; its StreamService (``nvml``, ``name``,
    ``hostname``: see StreamService) starts with the app and stops with it."""
    # every route but the player's files checks tokens signed with it: no secret, no service
    streamauth.check_secret(settings.stream_secret)
    app = web.Application(middlewares=[errors, authenticate])
    app[SETTINGS] = settings
    app[STREAM_METRICS] = StreamMetrics()
    app.add_routes(ROUTES)
    app.on_response_prepare.append(_browser_rules)

    async def service(app: web.Application) -> AsyncIterator[None]:
        async with StreamService(settings, nvml=nvml, name=name, hostname=hostname) as svc:
            app[SERVICE] = svc
            yield

    app.cleanup_ctx.append(service)
    app.on_shutdown.append(_end_sessions)
    return app


async def _browser_rules(request: web.Request, response: web.StreamResponse) -> None:
    # the player page is served here too: the same CSP and headers as the web's pages
    browserrules.apply(response.headers, request.path, request.secure)


async def _end_sessions(app: web.Application) -> None:
    # before the server waits for its handlers: a viewer's WebSocket ends with its session
    service = app.get(SERVICE)
    if service is not None:
        await service.end_sessions()


@contextlib.asynccontextmanager
async def serving(
    settings: Settings,
    *,
    nvml: Nvml | None = FROM_SETTINGS,
    name: str | None = None,
    hostname: str | None = None,
) -> AsyncIterator[StreamService]:
    """The app serving on FARM_STREAM_HOST:FARM_STREAM_PORT, its service announced in Redis
    (at FARM_STREAM_URL, else the address it listens on) until the block ends."""
    runner = web.AppRunner(
        create_app(settings, nvml=nvml, name=name, hostname=hostname), access_log=None
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.stream_host, settings.stream_port)
        await site.start()
        host, port = runner.addresses[0][:2]
        service = runner.app[SERVICE]
        await service.announce(settings.stream_url or f"http://{_url_host(str(host))}:{port}")
        yield service
    finally:
        await runner.cleanup()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


@contextlib.contextmanager
def running(settings: Settings, **options: Any) -> Iterator[StreamService]:
    """``serving`` from a thread of its own (sync tests, benches, browser tests)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}
    stop = asyncio.Event()

    async def main() -> None:
        try:
            async with serving(settings, **options) as service:
                box["service"] = service
                ready.set()
                await stop.wait()
        except BaseException as exc:
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), name="stream")
    thread.start()
    ready.wait()
    try:
        if "error" in box:
            raise box["error"]
        yield box["service"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()


async def serve_forever(settings: Settings, stop: asyncio.Event) -> None:
    """`farm stream`: serve until ``stop`` is set; prints one JSON line once serving."""
    async with serving(settings) as service:
        print(json.dumps({"url": service.url, "device_id": service.device.id}), flush=True)
        await stop.wait()
