"""Redis clients for the farm, and the one place redis-py's errors become the farm's own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import redis
from redis import Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from farm.errors import QueueError

__all__ = ["Redis", "connect", "guard", "locked"]


#: how a client rides out Redis being away (a restart, a failover): reconnect with backoff for
#: about 15 s before a command fails. Retried scripts are compare-and-set: a commit whose reply
#: was lost and is sent again finds its tile already done and changes nothing.
RETRIES = 20
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0


#: a reply slower than this is a dead connection (reconnect and retry). Every blocking call
#: of the farm (XREAD BLOCK, BLPOP) blocks for less: they poll in steps of 0.5 to 2 s. rq sets
#: its own, longer timeout on its connection for its dequeue.
SOCKET_TIMEOUT_S = 10.0


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), RETRIES)


#: connections one client opens at most. Beyond it a caller waits for a free connection
#: (a blocking pool) instead of opening more: a flood of requests queues in the process, it
#: does not exhaust Redis' client limit or the host's sockets.
MAX_CONNECTIONS = 64
#: how long a caller waits for a free connection before the call fails (QueueError)
POOL_WAIT_S = 30.0


def connect(url: str, *, text: bool = True, max_connections: int = MAX_CONNECTIONS) -> Redis:
    """A client for ``url`` (``redis://`` or ``unix://``); ``text=False`` for rq's bytes.

    Its pool holds at most ``max_connections``; callers beyond that wait (POOL_WAIT_S).
    """
    errors = [redis.ConnectionError, redis.TimeoutError]
    options: dict[str, Any] = {"socket_timeout": SOCKET_TIMEOUT_S, "retry": _retry(),
                               "retry_on_error": errors}  # fmt: skip
    if text:
        options.update(decode_responses=True, health_check_interval=30)
    try:
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_WAIT_S, **options
        )
    except ValueError as exc:
        raise QueueError(f"FARM_REDIS_URL {url!r} is not a Redis URL: {exc}") from exc
    return Redis(connection_pool=pool)


def guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; Redis being away or refusing becomes QueueError with the reason."""
    try:
        return fn(*args, **kwargs)
    except redis.ConnectionError as exc:
        raise QueueError(f"cannot reach Redis: {exc}") from exc
    except redis.ResponseError as exc:
        raise QueueError(f"Redis refused the command: {exc}") from exc


@contextlib.contextmanager
def locked(conn: Redis, key: str, hold_s: float, wait_s: float, busy: str) -> Iterator[None]:
    """Hold the Redis lock ``key`` (at most ``hold_s``: a dead holder frees it then); wait up
    to ``wait_s`` for it, else QueueError(``busy``)."""
    lock = conn.lock(key, timeout=hold_s, blocking_timeout=wait_s)
    if not guard(lock.acquire):
        raise QueueError(busy)
    try:
        yield
    finally:
        # a lock that outlived hold_s may be another's by now: not ours to release
        with contextlib.suppress(redis.exceptions.LockError):
            guard(lock.release)
