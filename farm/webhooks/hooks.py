"""A project's webhooks: where they go, which events they want, their secrets (Redis)."""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict, dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from farm import keys, redisclock
from farm.errors import BadParameter, Conflict, NotFound
from farm.redisclient import Redis, guard
from farm.webhooks import addresses, signing

#: every event a hook may ask for (the outbox's ``event`` field)
EVENTS = ("job.submitted", "frame.done", "job.done", "job.failed", "job.canceled")
#: the longest URL a hook may have
URL_MAX_CHARS = 2048
#: deliveries of one hook its listing keeps (older ones are dropped from it)
DELIVERIES_LISTED = 200

# KEYS: the project's hooks, WEBHOOK_PROJECTS   ARGV: hook id, record, most hooks, project
_CREATE = """
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
"""
# KEYS: the project's hooks, WEBHOOK_PROJECTS, the hook's deliveries   ARGV: hook id, project
_DELETE = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[2]) end
redis.call('DEL', KEYS[3])
return 1
"""


@dataclass(frozen=True)
class Hook:
    id: str
    project: str
    url: str
    events: tuple[str, ...]
    secret: str
    created_s: float
    created_by: str
    #: the secret before the last rotation, and until when deliveries are signed with it too
    previous_secret: str = ""
    previous_until_s: float = 0.0
    rotated_s: float | None = None
    #: set when a receiver answered 410 Gone (or someone disabled it): no deliveries are made
    disabled_s: float | None = None
    disabled_reason: str = ""

    def public(self) -> dict[str, Any]:
        """What listings show: everything but the secrets (each shown once, when it is made)."""
        data = asdict(self)
        del data["secret"], data["previous_secret"]
        data["events"] = list(self.events)
        data["disabled"] = self.disabled_s is not None
        return data

    def signing_secrets(self, now: float) -> list[str]:
        """The secrets a delivery sent at ``now`` is signed with: the current one, and the
        previous one during the grace period after a rotation."""
        if self.previous_secret and now < self.previous_until_s:
            return [self.secret, self.previous_secret]
        return [self.secret]

    @classmethod
    def from_json(cls, text: str) -> Hook:
        data = json.loads(text)
        data["events"] = tuple(data["events"])
        return cls(**data)


def check_url(url: object, allow_private: bool) -> str:
    """A hook's URL: http(s), a host, no credentials or fragment, at most URL_MAX_CHARS; an IP
    literal (or ``localhost``) only where ``refusal`` allows it. Names are checked when sent."""
    if not isinstance(url, str) or not url:
        raise BadParameter('give the hook\'s "url" (https://...)')
    if len(url) > URL_MAX_CHARS:
        raise BadParameter(f"a webhook URL is at most {URL_MAX_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise BadParameter(f"webhook URL {url[:100]!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise BadParameter(f"a webhook URL is http:// or https://, not {parts.scheme or '?'}:")
    host = parts.hostname or ""
    if not host:
        raise BadParameter("a webhook URL needs a host")
    if parts.username is not None or parts.password is not None:
        raise BadParameter("a webhook URL carries no credentials; check the signature instead")
    if parts.fragment:
        raise BadParameter("a webhook URL has no #fragment")
    if port == 0:
        raise BadParameter("a webhook URL's port is 1 to 65535")
    if any(ord(c) < 33 for c in url):
        raise BadParameter("a webhook URL has no spaces or control characters")
    if host == "localhost" or host.endswith(".localhost"):
        host = "127.0.0.1"
    if addresses.literal(host):
        why = addresses.refusal(host, allow_private)
        if why:
            raise BadParameter(f"webhook URL refused: {why}")
    return url


def check_events(events: object) -> tuple[str, ...]:
    """The events a hook wants: a non-empty list of EVENTS (None: all of them)."""
    if events is None:
        return EVENTS
    if not isinstance(events, list) or not events or not all(isinstance(e, str) for e in events):
        raise BadParameter(f'"events" is a list of one or more of {", ".join(EVENTS)}')
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise BadParameter(f"unknown event(s) {', '.join(unknown)}; known: {', '.join(EVENTS)}")
    return tuple(e for e in EVENTS if e in events)


class Hooks:
    """The webhooks of every project, and their deliveries' records."""

    def __init__(self, conn: Redis) -> None:
        self.conn = conn
        self._create = conn.register_script(_CREATE)
        self._delete = conn.register_script(_DELETE)

    def create(self, project: str, url: str, events: tuple[str, ...], user: str, most: int) -> Hook:
        """A new hook with a new secret (the caller shows it once); Conflict at ``most``."""
        hook = Hook(
            id="wh_" + secrets.token_hex(8),
            project=project,
            url=url,
            events=events,
            secret=signing.new_secret(),
            # Redis's clock, as the job events it is matched against (farm.redisclock)
            created_s=redisclock.now(self.conn),
            created_by=user,
        )
        made = guard(
            self._create,
            keys=[keys.webhooks(project), keys.WEBHOOK_PROJECTS],
            args=[hook.id, json.dumps(asdict(hook)), most, project],
        )
        if not made:
            raise Conflict(
                f"project {project!r} has {most} webhooks, the most it may have "
                "(FARM_WEBHOOK_MAX_PER_PROJECT); delete one first",
                project=project,
                limit=most,
            )
        return hook

    def of_project(self, project: str) -> list[Hook]:
        raw: dict[str, str] = guard(self.conn.hgetall, keys.webhooks(project))
        return sorted((Hook.from_json(v) for v in raw.values()), key=lambda h: h.created_s)

    def get(self, project: str, hook_id: str) -> Hook:
        text = guard(self.conn.hget, keys.webhooks(project), hook_id)
        if text is None:
            raise NotFound(f"no webhook {hook_id!r} in project {project!r}", hook_id=hook_id)
        return Hook.from_json(text)

    def _change(self, project: str, hook_id: str, change: Any) -> Hook:
        """Replace the hook's record by ``change(hook)``, atomically; NotFound without it."""
        key = keys.webhooks(project)

        def update(pipe: Any) -> Hook:
            text = pipe.hget(key, hook_id)
            if text is None:
                raise NotFound(f"no webhook {hook_id!r} in project {project!r}", hook_id=hook_id)
            hook: Hook = change(Hook.from_json(text))
            pipe.multi()
            pipe.hset(key, hook_id, json.dumps(asdict(hook)))
            return hook

        hook: Hook = guard(self.conn.transaction, update, key, value_from_callable=True)
        return hook

    def rotate(self, project: str, hook_id: str, grace_s: float) -> Hook:
        """A new secret (the caller shows it once); the current one keeps signing deliveries,
        beside the new one, for ``grace_s``, while receivers move to the new one."""
        now = redisclock.now(self.conn)  # the dispatcher's clock (any web replica's)
        return self._change(project, hook_id, lambda h: replace(
            h, secret=signing.new_secret(), previous_secret=h.secret,
            previous_until_s=now + grace_s, rotated_s=now))  # fmt: skip

    def disable(self, project: str, hook_id: str, reason: str) -> Hook:
        """No more deliveries for the hook (those pending are dropped) until it is enabled."""
        now = redisclock.now(self.conn)
        return self._change(project, hook_id, lambda h: h if h.disabled_s is not None else
                            replace(h, disabled_s=now, disabled_reason=reason))  # fmt: skip

    def enable(self, project: str, hook_id: str) -> Hook:
        return self._change(project, hook_id,
                            lambda h: replace(h, disabled_s=None, disabled_reason=""))  # fmt: skip

    def delete(self, project: str, hook_id: str) -> None:
        gone = guard(
            self._delete,
            keys=[keys.webhooks(project), keys.WEBHOOK_PROJECTS, keys.webhook_deliveries(hook_id)],
            args=[hook_id, project],
        )
        if not gone:
            raise NotFound(f"no webhook {hook_id!r} in project {project!r}", hook_id=hook_id)

    def deliveries(self, project: str, hook_id: str, limit: int = 50) -> list[dict[str, Any]]:
        """The hook's latest deliveries, newest first: id, event, job, state, attempts, the
        last attempt's result and when it is next tried (pending ones)."""
        self.get(project, hook_id)
        ids: list[str] = guard(self.conn.zrevrange, keys.webhook_deliveries(hook_id), 0, limit - 1)
        pipe = self.conn.pipeline(transaction=False)
        for delivery_id in ids:
            pipe.hgetall(keys.webhook_delivery(delivery_id))
        rows = guard(pipe.execute) if ids else []
        return [public_delivery(d, row) for d, row in zip(ids, rows, strict=True) if row]


def public_delivery(delivery_id: str, row: dict[str, str]) -> dict[str, Any]:
    def opt(name: str) -> float | None:
        return float(row[name]) if row.get(name) else None

    return {
        "id": delivery_id,
        "event": row["event"],
        "job_id": row.get("job_id", ""),
        "state": row["state"],
        "attempts": int(row.get("attempts", 0)),
        "last_result": row.get("last_result", ""),
        "created_s": opt("created_s"),
        "next_s": opt("next_s") if row["state"] == "pending" else None,
        "ended_s": opt("ended_s"),
    }
