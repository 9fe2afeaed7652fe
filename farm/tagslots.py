"""The slots of FARM_TAG_LIMITS: a tile of a job with a limited tag holds one of the tag's K
slots from the worker's pick (farm.queue takes it) to the tile's end, renewed with its lease,
so that a worker that dies frees its slot when the lease would have expired."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from farm import keys, redisclock
from farm.redisclient import Redis, guard


def renew_in(pipe: Any, conn: Redis, tags: Iterable[str], task_id: str, lease_s: float) -> int:
    """Extend the slots ``task_id`` (a tile's rq id) holds of ``tags`` by ``lease_s``, queued
    on ``pipe`` (its lease renewal's round trip); returns how many replies it adds (one a tag:
    the slots' ZADDs, which extend only a slot held)."""
    tags = list(tags)
    if not tags:
        return 0
    # Redis's clock, as the pick that took the slot (and counts slots held) reads it
    until = redisclock.now(conn) + lease_s
    for tag in tags:
        pipe.zadd(keys.tag_slots(tag), {task_id: until}, xx=True)
    return len(tags)


def release(conn: Redis, tags: Iterable[str], task_id: str) -> None:
    """Free the slots ``task_id`` holds (none held: nothing happens)."""
    tags = list(tags)
    if not tags:
        return
    pipe = conn.pipeline(transaction=False)
    for tag in tags:
        pipe.zrem(keys.tag_slots(tag), task_id)
    guard(pipe.execute)


def running(conn: Redis, tag: str) -> int:
    """Slots of ``tag`` held now (expired ones not counted)."""
    return int(guard(conn.zcount, keys.tag_slots(tag), redisclock.now(conn), "+inf"))
