"""The webhook dispatcher: outbox entries become deliveries, deliveries are POSTed and retried.

One dispatcher sends at a time, the holder of the ``WEBHOOK_DISPATCHER`` lease (every web
process runs one; the others wait to take over). Its work is two steps, each in Redis first:

1. *intake*: the outbox is read as a consumer group; for each entry a script creates one
   delivery per hook that wants the event (id ``<hook>.<outbox entry id>``, its JSON body
   fixed now) and acknowledges the entry in the same step. A dispatcher that dies before that
   leaves the entry pending in the group, and the next one (the same consumer name) reads it
   again: nothing is lost, nothing is made twice (a delivery that exists is left as it is).
2. *send*: each due delivery is POSTed (one request in flight per hook, so a healthy
   receiver gets a hook's events in order), then recorded: delivered (2xx), due again after
   an exponential back-off with jitter, or failed after FARM_WEBHOOK_MAX_ATTEMPTS. A
   dispatcher that dies while a request is on the wire has recorded nothing: the delivery is
   sent again, with the same delivery id. So: exactly once while nothing crashes, at least
   once (same X-Tessera-Delivery) across crashes and lease take-overs; receivers dedup by id.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import json
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from farm import keys, metrics, redisclock
from farm.errors import FarmError, NotFound, QueueError
from farm.models import JobSpec, WebhookEvent, WebhookJob
from farm.redisclient import Redis, guard
from farm.settings import Settings
from farm.webhooks import addresses, signing
from farm.webhooks.hooks import DELIVERIES_LISTED, Hook, Hooks

log = logging.getLogger("tessera.webhooks")

#: the outbox's consumer group, and its one consumer (one dispatcher holds the lease at a time,
#: and a new one must see what a dead one had read but not acknowledged)
GROUP = CONSUMER = "dispatcher"
#: the longest the dispatcher sleeps between looks at the outbox and the due deliveries
POLL_S = 0.25
#: outbox entries one intake step reads
INTAKE_BATCH = 100
#: due deliveries one look considers (ids only; one per hook is sent)
DUE_SCAN = 1000
#: requests in flight at once, over every hook
SEND_CONCURRENCY = 32
USER_AGENT = "Tessera-Webhooks/1"

_KEYS_LUA = keys.lua("webhook_delivery", "webhook_deliveries", "WEBHOOK_OUTBOX", "WEBHOOK_DUE")

# ARGV: entry id, now, then per delivery: id, hook, project, event, job id, body
# Creates the entry's deliveries (those not there yet) and acknowledges the entry, in one step.
_INTAKE = (
    _KEYS_LUA
    + f"""
for i = 3, #ARGV, 6 do
  local id, hook = ARGV[i], ARGV[i + 1]
  local dk = keys.webhook_delivery(id)
  if redis.call('EXISTS', dk) == 0 then
    redis.call('HSET', dk, 'hook', hook, 'project', ARGV[i + 2], 'event', ARGV[i + 3],
               'job_id', ARGV[i + 4], 'body', ARGV[i + 5], 'state', 'pending', 'attempts', 0,
               'created_s', ARGV[2], 'next_s', ARGV[2])
    redis.call('ZADD', keys.WEBHOOK_DUE, ARGV[2], id)
    local listed = keys.webhook_deliveries(hook)
    redis.call('ZADD', listed, ARGV[2], id)
    redis.call('ZREMRANGEBYRANK', listed, 0, -{DELIVERIES_LISTED + 1})
  end
end
redis.call('XACK', keys.WEBHOOK_OUTBOX, '{GROUP}', ARGV[1])
redis.call('XDEL', keys.WEBHOOK_OUTBOX, ARGV[1])
return 1
"""
)

# ARGV: id, outcome (delivered, retry, failed, dropped), attempts, next_s, result, now,
#       retention_s
_RECORD = (
    _KEYS_LUA
    + """
local dk = keys.webhook_delivery(ARGV[1])
if redis.call('HGET', dk, 'state') ~= 'pending' then
  redis.call('ZREM', keys.WEBHOOK_DUE, ARGV[1])
  return 0
end
redis.call('HSET', dk, 'attempts', ARGV[3], 'last_result', ARGV[5])
if ARGV[2] == 'retry' then
  redis.call('HSET', dk, 'next_s', ARGV[4])
  redis.call('ZADD', keys.WEBHOOK_DUE, ARGV[4], ARGV[1])
else
  redis.call('HSET', dk, 'state', ARGV[2], 'ended_s', ARGV[6])
  redis.call('ZREM', keys.WEBHOOK_DUE, ARGV[1])
  redis.call('EXPIRE', dk, math.max(1, math.floor(tonumber(ARGV[7]))))
end
return 1
"""
)

# KEYS: the lease   ARGV: holder, ms. Take the lease when free, renew it when ours.
_LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# KEYS: the lease   ARGV: holder
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


def retry_after_s(value: str | None, now: float) -> float | None:
    """The wait a ``Retry-After`` header asks for: delay seconds or an HTTP date (None when
    absent or unreadable; never below 0)."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        return float(text)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now)


def backoff_s(attempt: int, first_s: float, cap_s: float, rand: Callable[[], float]) -> float:
    """The wait before the try after ``attempt`` failed ones: doubling from ``first_s`` up to
    ``cap_s``, the upper half of it drawn at random (receivers that were down for everyone
    are not hit by every farm's retries at one instant)."""
    full = min(cap_s, first_s * 2.0 ** (attempt - 1))
    return full / 2 + rand() * full / 2


@dataclass(frozen=True)
class Delivery:
    id: str
    hook_id: str
    project: str
    event: str
    body: bytes
    attempts: int


class Dispatcher:
    """The dispatcher of one web process; ``run`` until ``stop`` is set."""

    def __init__(
        self,
        settings: Settings,
        conn: Redis,
        name: str = "",
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.settings = settings
        self.conn = conn
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        #: Redis's clock (farm.redisclock), never waiting on Redis (it is read on the event
        #: loop too): due times outlive a lease take-over by another web replica, events and
        #: hooks are stamped with it, and a signature's timestamp is as good on it as on any
        self.clock = clock or redisclock.clock_for(conn).nowait
        self.hooks = Hooks(conn)
        self.leader = False
        self._group_ready = False
        self._intake = conn.register_script(_INTAKE)
        self._record = conn.register_script(_RECORD)
        self._lease = conn.register_script(_LEASE)
        self._release = conn.register_script(_RELEASE)
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()

    # --- the lease ------------------------------------------------------------------------------

    def hold_lease(self) -> bool:
        """Take or renew the dispatcher's lease (FARM_LEASE_TTL_S); False: another holds it."""
        ms = int(self.settings.lease_ttl_s * 1000)
        self.leader = bool(guard(self._lease, keys=[keys.WEBHOOK_DISPATCHER], args=[self.name, ms]))
        return self.leader

    def release_lease(self) -> None:
        guard(self._release, keys=[keys.WEBHOOK_DISPATCHER], args=[self.name])
        self.leader = False

    # --- intake: outbox entries become deliveries -----------------------------------------------

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            guard(self.conn.xgroup_create, keys.WEBHOOK_OUTBOX, GROUP, id="0", mkstream=True)
        except QueueError as exc:
            if "BUSYGROUP" not in exc.message:
                raise
        self._group_ready = True

    def intake(self) -> int:
        """Turn outbox entries into deliveries: first those read before and not acknowledged
        (a dispatcher died), then new ones. Returns the entries handled."""
        self._ensure_group()
        handled = 0
        for start in ("0", ">"):
            while True:
                try:
                    reply = guard(self.conn.xreadgroup, GROUP, CONSUMER,
                                  {keys.WEBHOOK_OUTBOX: start}, count=INTAKE_BATCH)  # fmt: skip
                except QueueError:
                    self._group_ready = False  # (Redis was flushed or restarted empty)
                    raise
                entries = [e for _stream, batch in reply or [] for e in batch]
                for entry_id, fields in entries:
                    try:
                        self._take(entry_id, fields or {})
                    except QueueError:
                        raise
                    except Exception:
                        # an entry this code cannot read must not hold up the ones after it
                        log.exception("event=webhook_entry_dropped entry=%s fields=%r",
                                      entry_id, fields)  # fmt: skip
                        guard(self._intake, keys=[], args=[entry_id, self.clock()])
                handled += len(entries)
                if len(entries) < INTAKE_BATCH:
                    break
        return handled

    def _take(self, entry_id: str, fields: dict[str, str]) -> None:
        args: list[Any] = [entry_id, self.clock()]
        event = fields.get("event", "")
        hooks = self.hooks.of_project(fields["project"]) if event else []
        wanting = [h for h in hooks if event in h.events and h.created_s <= float(fields["ts"])
                   and h.disabled_s is None]  # fmt: skip
        if wanting:
            job = self._job_part(fields)
            for hook in wanting:
                delivery_id = f"{hook.id}.{entry_id}"
                body = self._body(delivery_id, fields, job)
                args += [delivery_id, hook.id, hook.project, event, fields["job_id"], body]
        guard(self._intake, keys=[], args=args)
        if wanting:
            log.info("event=webhook_deliveries_created entry=%s kind=%s job=%s hooks=%d",
                     entry_id, event, fields["job_id"], len(wanting))  # fmt: skip

    def _job_part(self, fields: dict[str, str]) -> WebhookJob:
        job_id = fields["job_id"]
        spec = guard(self.conn.hget, keys.job(job_id), "spec")
        return WebhookJob(
            id=job_id,
            name=JobSpec.from_json(spec).name if spec else "",
            state=fields.get("state", ""),
            frames_done=int(fields.get("frames_done") or 0),
            frames_total=int(fields.get("frames_total") or 0),
            reason=fields.get("message", ""),
        )

    def _body(self, delivery_id: str, fields: dict[str, str], job: WebhookJob) -> str:
        frame: int | None = None
        files: list[dict[str, Any]] | None = None
        if fields.get("frame"):
            frame = int(fields["frame"])
            recorded = guard(self.conn.hget, keys.delivered(fields["job_id"]), str(frame))
            listed = json.loads(recorded) if recorded else []
            files = [{k: f[k] for k in ("name", "size", "sha256")} for f in listed]
        event = WebhookEvent(
            id=delivery_id,
            event=fields["event"],
            ts=float(fields["ts"]),
            project=fields["project"],
            job=job,
            frame=frame,
            files=files,
        )
        return event.to_json()

    # --- sending ------------------------------------------------------------------------------

    def due(self, busy: set[str]) -> list[Delivery]:
        """The earliest due delivery of each hook not in ``busy`` (one in flight per hook)."""
        ids: list[str] = guard(self.conn.zrangebyscore, keys.WEBHOOK_DUE, "-inf", self.clock(),
                               start=0, num=DUE_SCAN)  # fmt: skip
        picked: dict[str, str] = {}
        for delivery_id in ids:
            hook_id = delivery_id.split(".", 1)[0]
            if hook_id not in busy and hook_id not in picked:
                picked[hook_id] = delivery_id
        if not picked:
            return []
        pipe = self.conn.pipeline(transaction=False)
        for delivery_id in picked.values():
            pipe.hmget(
                keys.webhook_delivery(delivery_id), "project", "event", "body", "attempts", "state"
            )
        out: list[Delivery] = []
        for (hook_id, delivery_id), row in zip(picked.items(), guard(pipe.execute), strict=True):
            project, event, body, attempts, state = row
            if state != "pending":
                guard(self.conn.zrem, keys.WEBHOOK_DUE, delivery_id)  # (its record is gone)
                continue
            out.append(Delivery(delivery_id, hook_id, project, event, body.encode(), int(attempts)))
        return out

    def record(
        self, delivery: Delivery, outcome: str, result: str, attempts: int,
        asked_s: float | None = None,
    ) -> float:  # fmt: skip
        """Write an attempt's outcome: delivered, retry (returns when it is due: after the
        back-off, and no sooner than the receiver's Retry-After ``asked_s``, up to
        FARM_WEBHOOK_RETRY_AFTER_MAX_S), failed or dropped (its hook was deleted or disabled)."""
        now = self.clock()
        s = self.settings
        next_s = now
        if outcome == "retry":
            wait = backoff_s(attempts, s.webhook_backoff_s, s.webhook_backoff_max_s, random.random)
            if asked_s is not None:
                wait = max(wait, min(asked_s, s.webhook_retry_after_max_s))
            next_s = now + wait
        guard(self._record, keys=[],
              args=[delivery.id, outcome, attempts, next_s, result[:300], now,
                    s.job_retention_s])  # fmt: skip
        return next_s

    async def send(self, http: aiohttp.ClientSession, delivery: Delivery) -> str:
        """POST one delivery, record the outcome; returns it (delivered, retry, failed, ...)."""
        hook: Hook | None
        try:
            hook = await asyncio.to_thread(self.hooks.get, delivery.project, delivery.hook_id)
        except NotFound:
            hook = None
        if hook is None or hook.disabled_s is not None:
            why = "the webhook was deleted" if hook is None else "the webhook is disabled"
            await asyncio.to_thread(self.record, delivery, "dropped", why, delivery.attempts)
            metrics.WEBHOOK_ATTEMPTS.labels("dropped").inc()
            return "dropped"
        attempts = delivery.attempts + 1
        outcome, result, asked_s = await self._post(http, hook, delivery)
        if outcome == "gone":
            # the receiver says the hook is no more: it is disabled (shown in its listing)
            outcome, result = "failed", "HTTP 410 Gone: the webhook is disabled"
            await asyncio.to_thread(self.hooks.disable, hook.project, hook.id,
                                    "the receiver answered 410 Gone")  # fmt: skip
            log.warning("event=webhook_disabled hook=%s project=%s why=gone", hook.id,
                        hook.project)  # fmt: skip
        if outcome == "retry" and attempts >= self.settings.webhook_max_attempts:
            outcome = "failed"
        next_s = await asyncio.to_thread(self.record, delivery, outcome, result, attempts,
                                         asked_s)  # fmt: skip
        metrics.WEBHOOK_ATTEMPTS.labels(outcome).inc()
        wait = f" retry_in_s={next_s - self.clock():.1f}" if outcome == "retry" else ""
        log.info("event=webhook_%s hook=%s delivery=%s kind=%s attempt=%d result=%r%s",
                 "attempt_failed" if outcome == "retry" else outcome, hook.id, delivery.id,
                 delivery.event, attempts, result, wait)  # fmt: skip
        return outcome

    async def _post(
        self, http: aiohttp.ClientSession, hook: Hook, delivery: Delivery
    ) -> tuple[str, str, float | None]:
        """('delivered' | 'retry' | 'failed' | 'gone', what happened, the wait a 429 or 503
        asked for in Retry-After) of one attempt."""
        allow = bool(self.settings.webhook_allow_private)
        host = urlsplit(hook.url).hostname or ""
        if addresses.literal(host):
            why = addresses.refusal(host.strip("[]"), allow)
            if why:
                return "failed", f"refused: {why}", None
        now = self.clock()
        timestamp = int(now)
        signature = signing.sign_all(hook.signing_secrets(now), timestamp, delivery.body)
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Tessera-Event": delivery.event,
            "X-Tessera-Delivery": delivery.id,
            "X-Tessera-Timestamp": str(timestamp),
            "X-Tessera-Signature": signature,
        }
        timeout = aiohttp.ClientTimeout(total=self.settings.webhook_timeout_s)
        try:
            async with http.post(hook.url, data=delivery.body, headers=headers,
                                 allow_redirects=False, timeout=timeout) as resp:  # fmt: skip
                status = resp.status
                asked = resp.headers.get("Retry-After") if status in (429, 503) else None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, addresses.AddressRefused):
                return "failed", f"refused: {exc.os_error}", None
            return "retry", f"cannot connect: {exc.os_error}", None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return "retry", f"{type(exc).__name__}: {exc}".strip(), None
        if 200 <= status < 300:
            return "delivered", f"HTTP {status}", None
        if status == 410:
            return "gone", f"HTTP {status}", None
        asked_s = retry_after_s(asked, now)
        if asked_s is not None:
            return "retry", f"HTTP {status} (Retry-After {asked_s:.0f} s)", asked_s
        return "retry", f"HTTP {status}", None

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Hold (or wait for) the lease, take in the outbox, send what is due, until ``stop``."""
        connector = aiohttp.TCPConnector(
            resolver=addresses.GuardedResolver(bool(self.settings.webhook_allow_private)),
            limit=SEND_CONCURRENCY,
        )
        renew_s = self.settings.lease_ttl_s / 3
        next_lease = 0.0
        async with aiohttp.ClientSession(connector=connector) as http:
            try:
                while not stop.is_set():
                    try:
                        if time.monotonic() >= next_lease:
                            await asyncio.to_thread(self.hold_lease)
                            next_lease = time.monotonic() + renew_s
                        if self.leader:
                            await self._step(http)
                    except FarmError as exc:
                        log.warning("event=webhook_dispatcher_error error=%s message=%r",
                                    exc.code, exc.message)  # fmt: skip
                    except Exception:
                        log.exception("event=webhook_dispatcher_error")
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wait(stop), POLL_S)
            finally:
                for task in self._in_flight.values():
                    task.cancel()
                await asyncio.gather(*self._in_flight.values(), return_exceptions=True)
                if self.leader:
                    with contextlib.suppress(FarmError):
                        await asyncio.to_thread(self.release_lease)

    async def _wait(self, stop: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _step(self, http: aiohttp.ClientSession) -> None:
        await asyncio.to_thread(self.intake)
        if len(self._in_flight) >= SEND_CONCURRENCY:
            return
        busy = set(self._in_flight)
        for delivery in await asyncio.to_thread(self.due, busy):
            if len(self._in_flight) >= SEND_CONCURRENCY:
                break
            task = asyncio.create_task(self._send_logged(http, delivery))
            self._in_flight[delivery.hook_id] = task
            task.add_done_callback(functools.partial(self._done, delivery.hook_id))

    async def _send_logged(self, http: aiohttp.ClientSession, delivery: Delivery) -> None:
        try:
            await self.send(http, delivery)
        except FarmError as exc:
            # not recorded: the delivery stays due and is sent again (the same id)
            log.warning("event=webhook_send_error delivery=%s error=%s message=%r", delivery.id,
                        exc.code, exc.message)  # fmt: skip

    def _done(self, hook_id: str, _task: asyncio.Task[None]) -> None:
        self._in_flight.pop(hook_id, None)
        self._wake.set()
