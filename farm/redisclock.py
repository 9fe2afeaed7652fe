"""The farm's one clock: the Redis server's, read on any host without a round trip per call.

A deadline written by one host is judged by another: a worker's tile lease by the sweeper on
another machine, a tag slot's lease by the next worker's pick (which reads Redis's own
``TIME``), a worker's beat by the web. With each host's own clock, a worker whose clock ran more
than a lease behind wrote tile deadlines already past for a sweeper with the right time, and
every tile it started was taken back from it (tests/farm/test_redis_clock.py). So every such
time is Redis's: each process learns how far its own clock is from the server's (one ``TIME``,
its round trip halved) and adds that, learning it again every ``REFRESH_S`` (the local clock
slews; a failover brings another server's clock).
The allocator's scripts and the queue's pick read ``TIME`` inside Redis, so they agree.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import redis

from farm.redisclient import Redis

#: seconds between two readings of the server's clock
REFRESH_S = 10.0

log = logging.getLogger("tessera.redis")


class RedisClock:
    """Seconds since the epoch on the Redis server's clock, as ``time.time()`` gives them.

    ``local`` is this host's clock (tests give a wrong one). Until the server has answered
    once, the local clock is used as it is: every write that depends on it goes to the same
    server, and fails there if it is away.
    """

    def __init__(
        self, conn: Redis, refresh_s: float = REFRESH_S, local: Callable[[], float] = time.time
    ) -> None:
        # the pool, not the client: a clock cached per pool must not keep the pool alive
        self._pool = weakref.ref(conn.connection_pool)
        self.refresh_s = refresh_s
        self.local = local
        self.offset_s = 0.0
        self._next = 0.0  # time.monotonic() of the next reading
        self._synced = False
        self._lock = threading.Lock()

    def __call__(self) -> float:
        if time.monotonic() >= self._next:
            self.sync()
        return self.local() + self.offset_s

    def nowait(self) -> float:
        """The time as ``__call__`` gives it, without ever waiting on Redis (for an event loop,
        where a reading during an outage would hold every task for the ride-out): a reading
        that is due is taken on a thread; before the first, this host's time is used."""
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + self.refresh_s  # one reading on its way
            threading.Thread(target=self.sync, name="redis-clock", daemon=True).start()
        return self.local() + self.offset_s

    def sync(self) -> None:
        """Read the server's clock now (at most one thread at a time; the others go on)."""
        pool = self._pool()
        # the first reading is waited for: until then this host's time would be used as it is
        if pool is None or not self._lock.acquire(blocking=not self._synced):
            return
        try:
            before = self.local()
            seconds, micros = Redis(connection_pool=pool).time()
            after = self.local()
            offset = seconds + micros / 1e6 - (before + after) / 2
            if abs(offset - self.offset_s) > 1.0:
                log.info("event=clock_offset offset_s=%.3f", offset)
            self.offset_s, self._synced = offset, True
            self._next = time.monotonic() + self.refresh_s
        except redis.RedisError as exc:
            # The call that wanted the time meets the same outage and says so. Not tried again
            # for a while: each try rides the outage out, as long again as that call's own.
            log.debug("event=clock_unread error=%r", exc)
            self._next = time.monotonic() + self.refresh_s
        finally:
            self._lock.release()


_CLOCKS: weakref.WeakKeyDictionary[object, RedisClock] = weakref.WeakKeyDictionary()
_CLOCKS_LOCK = threading.Lock()


def clock_for(conn: Redis) -> RedisClock:
    """The clock of ``conn``'s server, one per connection pool (its clients share it)."""
    pool = conn.connection_pool
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get(pool)
        if clock is None:
            clock = _CLOCKS[pool] = RedisClock(conn)
        return clock


def now(conn: Redis) -> float:
    """The Redis server's time now, in seconds since the epoch."""
    return clock_for(conn)()


def now_nowait(conn: Redis) -> float:
    """The Redis server's time, never waiting on Redis (``RedisClock.nowait``)."""
    return clock_for(conn).nowait()
