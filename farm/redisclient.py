"""Redis clients for the farm, and the one place redis-py's errors become the farm's own."""

from __future__ import annotations

from typing import Any

import redis
from redis import Redis

from farm.errors import QueueError

__all__ = ["Redis", "connect", "guard"]


def connect(url: str, *, text: bool = True) -> Redis:
    """A client for ``url`` (``redis://`` or ``unix://``); ``text=False`` for rq's bytes."""
    try:
        if text:
            return Redis.from_url(url, decode_responses=True, health_check_interval=30)
        return Redis.from_url(url)
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
