"""The typed keys of the web app's shared resources, and running blocking calls off the loop."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from aiohttp import web

from farm.accounts import Accounts, User
from farm.alloc.allocator import SlotAllocator
from farm.jobstore import JobStore
from farm.redisclient import Redis
from farm.settings import Settings
from farm.storage.base import Storage

if TYPE_CHECKING:
    from web.routes import Route

T = TypeVar("T")

SETTINGS = web.AppKey("settings", Settings)
#: text-mode Redis client (job store, accounts, upload records)
CONN = web.AppKey("conn", Redis)
#: bytes-mode Redis client, as rq requires
RQ_CONN = web.AppKey("rq_conn", Redis)
STORE = web.AppKey("store", JobStore)
STORAGE = web.AppKey("storage", Storage)
ACCOUNTS = web.AppKey("accounts", Accounts)
#: the slot allocator, for the projects' device policy it owns
ALLOCATOR = web.AppKey("allocator", SlotAllocator)
#: threads for Redis calls and file work (short calls)
EXECUTOR = web.AppKey("executor", ThreadPoolExecutor)
#: threads for calls that block for long: XREAD BLOCK of event streams, inspections
WAITERS = web.AppKey("waiters", ThreadPoolExecutor)
#: threads for decompression and zip checks of uploads (FARM_UPLOAD_CHECKS of them): a flood
#: of checks waits for these, never for the threads other requests are answered on
CHECKS = web.AppKey("checks", ThreadPoolExecutor)
#: client for the stream services this web proxies to
HTTP = web.AppKey("http", aiohttp.ClientSession)
#: (method, canonical path) -> the route table entry, for auth and OpenAPI
ROUTES = web.AppKey("routes", dict[tuple[str, str], "Route"])

#: the logged-in user of a request (set by the auth middleware)
USER = web.RequestKey("user", User)


async def blocking(app: web.Application, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run a short blocking call (Redis, file work) on the app's threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(app[EXECUTOR], functools.partial(fn, *args, **kw))


async def waiting(app: web.Application, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run a call that may block for seconds (XREAD BLOCK, an inspection) on its own threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(app[WAITERS], functools.partial(fn, *args, **kw))


async def checking(app: web.Application, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run an upload's check (hashing, unpacking, decompressing) on the checks' threads."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(app[CHECKS], functools.partial(fn, *args, **kw))


def user_of(request: web.Request) -> User:
    return request[USER]
