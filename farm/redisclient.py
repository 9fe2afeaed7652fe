"""Redis clients for the farm, and the one place redis-py's errors become the farm's own."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis
from redis import Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from farm import keys, redisurl
from farm.errors import BadParameter, QueueError

__all__ = ["Redis", "confirm_replicated", "connect", "guard", "locked"]

T = TypeVar("T")


#: how long a client rides out Redis being away (a restart, a failover, a partition) before a
#: command fails: it reconnects with backoff until then. Retried scripts are compare-and-set: a
#: commit whose reply was lost and is sent again finds its tile already done and changes nothing.
RIDE_OUT_S = 15.0
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 1.0
#: a connection not made in this long goes nowhere (a partition drops the SYNs): give up on it
#: and try again, rather than spend the whole ride-out on one attempt
CONNECT_TIMEOUT_S = 2.0


#: a reply slower than this is a dead connection (reconnect and retry). Every blocking call
#: of the farm (XREAD BLOCK, BLPOP) blocks for less: they poll in steps of 0.5 to 2 s. rq sets
#: its own, longer timeout on its connection for its dequeue.
SOCKET_TIMEOUT_S = 10.0

log = logging.getLogger("tessera.redis")


class RideOut(Retry):
    """Retry for ``ride_out_s`` in all (not a count of attempts, whose cost depends on how the
    network fails), and say so: once when Redis goes away, once when it is back or given up."""

    def __init__(self, ride_out_s: float) -> None:
        backoff = ExponentialWithJitterBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S)
        super().__init__(backoff, retries=-1)
        self.ride_out_s = ride_out_s

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        start = time.monotonic()  # (exponential backoff with jitter keeps no state to reset)
        failures = 0
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if failures == 1:
                    log.warning("event=redis_unreachable error=%r retry_for_s=%.0f",
                                str(error), self.ride_out_s)  # fmt: skip
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                left_s = start + self.ride_out_s - time.monotonic()
                if left_s <= 0:
                    log.error("event=redis_given_up error=%r attempts=%d after_s=%.1f",
                              str(error), failures, time.monotonic() - start)  # fmt: skip
                    raise
                time.sleep(min(self._backoff.compute(failures), left_s))
                continue
            if failures:
                log.warning("event=redis_reachable attempts=%d after_s=%.1f", failures + 1,
                            time.monotonic() - start)  # fmt: skip
            return result


#: connections one client opens at most. Beyond it a caller waits for a free connection
#: (a blocking pool) instead of opening more: a flood of requests queues in the process, it
#: does not exhaust Redis' client limit or the host's sockets.
MAX_CONNECTIONS = 64
#: how long a caller waits for a free connection before the call fails (QueueError)
POOL_WAIT_S = 30.0


def connect(
    url: str,
    *,
    text: bool = True,
    max_connections: int = MAX_CONNECTIONS,
    ride_out_s: float = RIDE_OUT_S,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
) -> Redis:
    """A client for ``url`` (``redis://``, ``unix://`` or ``redis+sentinel://``); ``text=False``
    for rq's bytes.

    Its pool holds at most ``max_connections``; callers beyond that wait (POOL_WAIT_S). A
    command fails (QueueError through ``guard``) once Redis has been away for ``ride_out_s``.
    Behind Sentinels each new connection asks them for the primary, so a connection lost in a
    failover comes back, within the ride-out, to the replica they promoted.
    """
    errors = [redis.ConnectionError, redis.TimeoutError]
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": min(CONNECT_TIMEOUT_S, socket_timeout_s),
        "retry": RideOut(ride_out_s),
        "retry_on_error": errors,
    }
    if text:
        options.update(decode_responses=True, health_check_interval=30)
    if redisurl.is_sentinel(url):
        return _sentinel_client(url, max_connections, options)
    try:
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=POOL_WAIT_S, **options
        )
    except ValueError as exc:
        raise QueueError(f"FARM_REDIS_URL {url!r} is not a Redis URL: {exc}") from exc
    return _owning(pool)


class _SentinelConnection(SentinelManagedConnection):
    """A connection to the primary the Sentinels name, asked again at each attempt to connect.

    redis-py reconnects a connection that broke in use (a retried command) to the address it
    had, the dead primary's, for the whole ride-out; this one asks the Sentinels instead."""

    def connect_check_health(
        self, check_health: bool = True, retry_socket_connect: bool = True
    ) -> None:
        if self._sock or not retry_socket_connect:
            # connected, or called back from the Sentinels' own connect with a fresh address
            super().connect_check_health(check_health, retry_socket_connect)
        else:
            self.connect()  # type: ignore[no-untyped-call]


class _BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """Sentinel's pool (connections go to the primary the Sentinels name now; one to a former
    primary is dropped when released) that makes callers wait past ``max_connections``."""


def _sentinel_client(url: str, max_connections: int, options: dict[str, Any]) -> Redis:
    try:
        address = redisurl.parse_sentinel(url)
    except BadParameter as exc:
        raise QueueError(exc.message) from exc
    # the Sentinels get the same timeouts; the password is the data nodes' (requirepass);
    # redis-py types Sentinel from 8.2 on
    sentinels = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
        list(address.sentinels),
        sentinel_kwargs={
            "socket_timeout": options["socket_timeout"],
            "socket_connect_timeout": options["socket_connect_timeout"],
        },
    )
    pool = _BlockingSentinelPool(  # type: ignore[no-untyped-call]
        address.service,
        sentinels,
        db=address.db,
        password=address.password,
        max_connections=max_connections,
        timeout=POOL_WAIT_S,
        connection_class=_SentinelConnection,
        **options,
    )
    return _owning(pool)


class _OwningClient(Redis):
    """A client whose ``close()`` closes its own pool's sockets. ``Redis(connection_pool=pool)``
    leaves them open for the garbage collector at every close of a client the farm made.

    Only an explicit close: redis-py's ``from_pool`` also closes the pool when the client is
    collected, and with it the Sentinel failover test took 34 s instead of 14 s (something
    still using the pool after its client was collected lost its connections; not traced)."""

    def __del__(self) -> None:
        pass  # the pool (and its sockets) go with the last object holding it

    def close(self) -> None:
        super().close()
        self.connection_pool.disconnect()


def _owning(pool: redis.ConnectionPool) -> Redis:
    return _OwningClient(connection_pool=pool)


#: how long a write that must survive a failover waits for a replica to confirm it
REPLICA_WAIT_S = 5.0


def confirm_replicated(conn: Redis, key: str, field: str | None = None) -> bool:
    """After a write whose loss in a failover would be worse than a re-render (an accepted
    job, a delivered frame): True once a replica holds it (WAIT), or no replica exists that a
    failover could promote; False when the write is gone (it went to a primary that failed
    before its replica had it: write it again) or no replica confirmed it in REPLICA_WAIT_S
    (QueueError). ``key`` (``field`` of a hash) is what the write created.

    A replica still in its first sync counts (INFO's connected replicas, not ROLE's, which
    lists only those in sync): it reports its link down for -1 s, which Sentinel takes as
    fit to promote, so a failover then would put an empty replica in the primary's place.
    WAIT confirms the writes of its own connection, and a pool lends any: a fence written on
    the same connection as the WAIT, after the write, orders it behind ours in the stream.
    Does nothing for a client without Sentinels (one Redis: no failover can lose a write).
    """
    if not isinstance(conn.connection_pool, SentinelConnectionPool):
        return True
    replicas = int(guard(conn.info, "replication").get("connected_slaves", 0))
    pipe = conn.pipeline(transaction=False)
    if field is None:
        pipe.exists(key)
    else:
        pipe.hexists(key, field)
    pipe.incr(keys.REPLICATION_FENCE)
    pipe.execute_command("WAIT", 1 if replicas else 0, int(REPLICA_WAIT_S * 1000))  # type: ignore[no-untyped-call]
    there, _fence, acked = guard(pipe.execute)
    if not there:
        log.warning("event=redis_write_lost key=%s field=%s", key, field)
        return False
    if replicas and not int(acked):
        raise QueueError(
            f"no Redis replica confirmed the write of {key} within {REPLICA_WAIT_S:.0f} s",
            key=key,
        )
    return True


def guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn``; Redis being away or refusing becomes QueueError with the reason."""
    try:
        return fn(*args, **kwargs)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # a timeout is no ConnectionError in redis-py: it escaped as redis' own error
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
