"""`farm web`: serve the app on its address, over TLS 1.3 when given a certificate."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TextIO

from aiohttp import web

from farm.errors import BadParameter, SetupError
from farm.settings import Settings
from web.app import create_app
from web.metrics import scrape_app
from web.tls import bind_host, server_context

log = logging.getLogger("tessera.web")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def run(
    settings: Settings,
    out: TextIO = sys.stderr,
    until: Callable[[str], Awaitable[None]] | None = None,
    app: Callable[[Settings], web.Application] = create_app,
    name: str = "farm web",
) -> None:
    """Serve ``app`` (the web, or the front door of cells) until SIGINT/SIGTERM, or until
    ``until(url)`` returns; says where, on ``out``."""
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise BadParameter("give both FARM_TLS_CERT and FARM_TLS_KEY, or neither")
    ssl_context = None
    if settings.tls_cert is not None and settings.tls_key is not None:
        ssl_context = server_context(settings.tls_cert, settings.tls_key)
    host = bind_host(settings.web_host, ssl_context is not None)
    runner = web.AppRunner(app(settings), access_log=logging.getLogger("tessera.access"))
    await runner.setup()
    scrape: web.AppRunner | None = None
    # handlers go in before the URL is printed: whoever reads the URL may signal at once
    stop = _stop_on_signals() if until is None else None
    try:
        if settings.web_metrics_port:
            scrape = web.AppRunner(scrape_app(), access_log=None)
            await scrape.setup()
            try:
                await web.TCPSite(scrape, settings.metrics_host, settings.web_metrics_port).start()
            except OSError as exc:
                raise SetupError(
                    f"cannot serve /metrics on {settings.metrics_host}:"
                    f"{settings.web_metrics_port}: {exc.strerror or exc}; choose another "
                    "FARM_WEB_METRICS_PORT / FARM_METRICS_HOST"
                ) from None
            print(
                f"farm web: /metrics on http://{settings.metrics_host}:"
                f"{scrape.addresses[0][1]}/metrics (scrape-only, no token)",
                file=out,
            )
        site = web.TCPSite(runner, host, settings.web_port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError as exc:
            raise SetupError(
                f"cannot listen on {host}:{settings.web_port}: {exc.strerror or exc}; choose "
                "another FARM_WEB_PORT / FARM_WEB_HOST (or stop what uses it)"
            ) from None
        bound_port = runner.addresses[0][1]
        scheme = "https" if ssl_context else "http"
        shown = f"[{host}]" if ":" in host else host
        url = f"{scheme}://{shown}:{bound_port}"
        if ssl_context is None:
            where = (
                "loopback only, other machines cannot reach it"
                if _is_loopback(host)
                else "WITHOUT TLS: tokens and cookies cross the network in the clear"
            )
            print(
                f"{name}: serving {url} ({where}); give FARM_TLS_CERT and FARM_TLS_KEY to "
                "serve HTTPS (TLS 1.3) on every interface",
                file=out,
            )
        else:
            print(f"{name}: serving {url} (TLS 1.3 or newer)", file=out)
        print(json.dumps({"url": url}), file=sys.stdout, flush=True)
        if until is not None:
            await until(url)
        elif stop is not None:
            await stop.wait()
    finally:
        if stop is not None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if scrape is not None:
            await scrape.cleanup()
        await runner.cleanup()


def _stop_on_signals() -> asyncio.Event:
    """An event SIGINT or SIGTERM sets; the caller removes the handlers when done."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def serve(settings: Settings, out: TextIO = sys.stderr) -> None:
    asyncio.run(run(settings, out))


def serve_frontdoor(settings: Settings, out: TextIO = sys.stderr) -> None:
    from web.frontdoor import create_frontdoor

    asyncio.run(run(settings, out, app=create_frontdoor, name="farm frontdoor"))
