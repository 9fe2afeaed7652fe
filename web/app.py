"""create_app(settings): the aiohttp application, its resources (cleanup_ctx) and middlewares."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from aiohttp import web

from farm import jobstore, queue
from farm import metrics as farm_metrics
from farm.accounts import Accounts
from farm.alloc.allocator import SlotAllocator
from farm.settings import Settings
from farm.storage.factory import farm_storage
from web.appkeys import (
    ACCOUNTS,
    ALLOCATOR,
    CHECKS,
    CONN,
    EXECUTOR,
    HTTP,
    ROUTES,
    RQ_CONN,
    SETTINGS,
    STORAGE,
    STORE,
    WAITERS,
)
from web.auth import auth_middleware
from web.headers import on_prepare
from web.jsonio import error_middleware
from web.livewebrtc import live_peers_ctx
from web.routes import add_routes, table
from web.webhooks import dispatcher_ctx

log = logging.getLogger("tessera.web")

#: threads for short blocking calls (Redis round trips, file writes, hashing)
EXECUTOR_THREADS = 16
#: threads for calls that wait: one per open event stream or inspection in progress
WAITER_THREADS = 256


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    conn = jobstore.connect(settings.redis_url)
    rq_conn = queue.connect(settings.redis_url)
    app[CONN] = conn
    app[RQ_CONN] = rq_conn
    app[STORE] = jobstore.JobStore(conn, cell=settings.cell)
    # in a farm of cells, accounts live in the control Redis every cell shares
    control = jobstore.connect(settings.accounts_redis_url) if settings.control_redis_url else conn
    app[ACCOUNTS] = Accounts(control, cell=settings.cell)
    app[ALLOCATOR] = SlotAllocator(conn, ttl_s=settings.lease_ttl_s)
    app[STORAGE] = farm_storage(settings)
    app[EXECUTOR] = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="web")
    app[WAITERS] = ThreadPoolExecutor(WAITER_THREADS, thread_name_prefix="web-wait")
    app[CHECKS] = ThreadPoolExecutor(settings.upload_checks, thread_name_prefix="web-check")
    app[HTTP] = aiohttp.ClientSession()
    # the web is the one scrape target for farm-wide state (queues, devices, leases, usage)
    collector = farm_metrics.register_farm_collector(settings)
    log.info("event=web_started redis=%s storage=%s", settings.redis_url, app[STORAGE].url)
    try:
        yield
    finally:
        farm_metrics.unregister_farm_collector()
        collector.conn.close()
        collector.rq_conn.close()
        await app[HTTP].close()
        app[WAITERS].shutdown(wait=True, cancel_futures=True)
        app[CHECKS].shutdown(wait=True, cancel_futures=True)
        app[EXECUTOR].shutdown(wait=True, cancel_futures=True)
        app[STORAGE].close()
        rq_conn.close()
        if control is not conn:
            control.close()
        conn.close()


def create_app(settings: Settings) -> web.Application:
    """The web UI and API for the farm that ``settings`` describe (Redis, storage, limits)."""
    # uploads stream their bodies themselves; other bodies are read with their own limits
    app = web.Application(
        middlewares=[error_middleware, auth_middleware],
        client_max_size=1 << 20,
    )
    app.on_response_prepare.append(on_prepare)
    app[SETTINGS] = settings
    app[ROUTES] = add_routes(app, table())
    app.cleanup_ctx.append(_resources)
    app.cleanup_ctx.append(dispatcher_ctx)
    app.cleanup_ctx.append(live_peers_ctx)
    return app
