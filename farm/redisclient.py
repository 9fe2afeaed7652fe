"""Redis clients for the farm, and the one place redis-py's errors become the farm's own."""

from __future__ import annotations

from typing import Any

import redis
from redis import Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from farm.errors import QueueError

__all__ = ["Redis", "connect", "guard"]


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


def connect(url: str, *, text: bool = True) -> Redis:
    """A client for ``url`` (``redis://`` or ``unix://``); ``text=False`` for rq's bytes."""
    errors = [redis.ConnectionError, redis.TimeoutError]
    try:
        if text:
            return Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                  socket_timeout=SOCKET_TIMEOUT_S, retry=_retry(),
                                  retry_on_error=errors)  # fmt: skip
        return Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, retry=_retry(),
                              retry_on_error=errors)  # fmt: skip
    except ValueError as exc:
        raise QueueError(f"FARM_REDIS_URL {url!r} is not a Redis URL: {exc}") from exc


def guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; Redis being away or refusing becomes QueueError with the reason."""
    try:
        return fn(*args, **kwargs)
    except redis.ConnectionError as exc:
        raise QueueError(f"cannot reach Redis: {exc}") from exc
    except redis.ResponseError as exc:
        raise QueueError(f"Redis refused the command: {exc}") from exc
