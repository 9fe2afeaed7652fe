"""Per-project limits: work in flight held to a count farm-wide, queued tiles, stored bytes.

Every web instance counts in the same Redis, so a project flooding several replicas meets one
limit. Work in flight is a sorted set of holders with expiries: a web process that dies holding
a slot frees it when the expiry passes, never by hand.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from farm import keys
from farm.errors import BadParameter, OverLimit
from farm.redisclient import Redis, guard, locked
from farm.settings import Settings
from farm.states import JOB_FINAL
from web.appkeys import CONN, SETTINGS, blocking


@dataclass(frozen=True)
class Limit:
    """One per-project limit: its name in the API, its setting, and what it counts."""

    name: str
    setting: str
    what: str

    @property
    def variable(self) -> str:
        return "FARM_" + self.setting.upper()


UPLOADS = Limit("uploads_in_flight", "project_max_uploads", "uploads in flight")
INSPECTIONS = Limit("inspections", "project_max_inspections", "inspections running")
QUEUED_TILES = Limit("queued_tiles", "project_max_queued_tiles", "tiles of unfinished jobs")
JOB_TILES = Limit("tiles_per_job", "job_max_tiles", "tiles in one job")
STORED_BYTES = Limit("stored_bytes", "project_max_stored_bytes", "bytes of uploads stored")
LIMITS = {lim.name: lim for lim in (UPLOADS, INSPECTIONS, QUEUED_TILES, JOB_TILES, STORED_BYTES)}

#: how far back a project's jobs are summed for its queued tiles (newest first)
JOBS_COUNTED = 2000
#: a submission holds its project's lock this long at most (a dead web frees it then), and
#: another waits this long for it
SUBMIT_LOCK_S = 30.0
SUBMIT_WAIT_S = 20.0

T = TypeVar("T")

#: KEYS: the project's in-flight set. ARGV: holder, hold_ms, limit.
#: Drops expired holders, then adds ``holder`` if the set has room; 1 = added, 0 = full.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""


class ProjectLimits:
    """The limits of each project: the farm's settings, or what a farm admin set for one."""

    def __init__(self, conn: Redis, settings: Settings) -> None:
        self.conn = conn
        self.settings = settings
        self._acquire = conn.register_script(_ACQUIRE)

    def allowed(self, project: str, limit: Limit) -> int:
        own = guard(self.conn.hget, keys.project_limits(project), limit.name)
        return int(own) if own is not None else int(getattr(self.settings, limit.setting))

    def all_allowed(self, project: str) -> dict[str, int]:
        own = guard(self.conn.hgetall, keys.project_limits(project))
        return {
            name: int(own[name]) if name in own else int(getattr(self.settings, lim.setting))
            for name, lim in LIMITS.items()
        }

    def set_allowed(self, project: str, values: dict[str, int | None]) -> None:
        """Set (or, with None, drop back to the farm's setting) some of a project's limits."""
        for name, value in values.items():
            if name not in LIMITS:
                raise BadParameter(f"no limit {name!r}; limits: {', '.join(LIMITS)}")
            if value is not None and value < 1:
                raise BadParameter(f"limit {name} must be at least 1, not {value}")
        pipe = self.conn.pipeline()
        for name, value in values.items():
            if value is None:
                pipe.hdel(keys.project_limits(project), name)
            else:
                pipe.hset(keys.project_limits(project), name, value)
        guard(pipe.execute)

    def over(self, project: str, limit: Limit, allowed: int, have: int | None = None) -> OverLimit:
        held = f"has {have} {limit.what}" if have is not None else f"is at {allowed} {limit.what}"
        return OverLimit(
            f"project {project!r} {held}; its limit is {allowed} ({limit.name}, set by "
            f"{limit.variable} or a farm admin): wait for some to finish",
            limit=limit.name,
            allowed=allowed,
            project=project,
        )

    # --- work in flight -------------------------------------------------------------------

    def acquire(self, project: str, limit: Limit, holder: str, hold_s: float) -> None:
        """Take one of the project's ``limit`` slots for ``hold_s`` at most; OverLimit when
        every slot is taken."""
        allowed = self.allowed(project, limit)
        key = keys.project_inflight(project, limit.name)
        got = guard(self._acquire, keys=[key], args=[holder, int(hold_s * 1000), allowed])
        if not got:
            raise self.over(project, limit, allowed)

    def release(self, project: str, limit: Limit, holder: str) -> None:
        guard(self.conn.zrem, keys.project_inflight(project, limit.name), holder)

    # --- counted work ---------------------------------------------------------------------

    def queued_tiles(self, project: str) -> int:
        """Tiles not yet done of the project's unfinished jobs (its newest JOBS_COUNTED)."""
        ids = guard(self.conn.zrevrange, keys.project_jobs(project), 0, JOBS_COUNTED - 1)
        pipe = self.conn.pipeline()
        for job_id in ids:
            pipe.hmget(keys.job(job_id), "state", "tiles_total", "tiles_done")
        final = {s.value for s in JOB_FINAL}
        total = 0
        for state, tiles, done in guard(pipe.execute) if ids else []:
            if state is not None and state not in final:
                total += max(0, int(tiles or 0) - int(done or 0))
        return total

    def check_queued_tiles(self, project: str, adding: int) -> None:
        allowed = self.allowed(project, QUEUED_TILES)
        have = self.queued_tiles(project)
        if have + adding > allowed:
            raise OverLimit(
                f"project {project!r} has {have} tiles of unfinished jobs and this job adds "
                f"{adding}; its limit is {allowed} ({QUEUED_TILES.name}, set by "
                f"{QUEUED_TILES.variable} or a farm admin): wait for jobs to finish",
                limit=QUEUED_TILES.name,
                allowed=allowed,
                project=project,
            )

    def within_tile_budget(self, project: str, adding: int, create: Callable[[], T]) -> T:
        """``create()`` the job if the project's queued tiles leave room for ``adding`` more;
        one submission of the project at a time is checked and created (a Redis lock)."""
        busy = f"project {project!r} has other submissions in progress; try again in a moment"
        with locked(self.conn, keys.project_submit_lock(project), SUBMIT_LOCK_S, SUBMIT_WAIT_S,
                    busy):  # fmt: skip
            self.check_queued_tiles(project, adding)
            return create()

    def stored_bytes(self, project: str) -> int:
        return int(guard(self.conn.get, keys.project_stored_bytes(project)) or 0)

    def check_stored_bytes(self, project: str, adding: int) -> None:
        allowed = self.allowed(project, STORED_BYTES)
        have = self.stored_bytes(project)
        if have + adding > allowed:
            raise OverLimit(
                f"project {project!r} stores {have} bytes of uploads and this one has {adding}; "
                f"its limit is {allowed} bytes ({STORED_BYTES.name}, set by "
                f"{STORED_BYTES.variable} or a farm admin)",
                limit=STORED_BYTES.name,
                allowed=allowed,
                project=project,
            )


def limits_of(request: web.Request) -> ProjectLimits:
    return ProjectLimits(request.app[CONN], request.app[SETTINGS])


@asynccontextmanager
async def in_flight(
    request: web.Request, project: str, limit: Limit, hold_s: float, holder: str = ""
) -> AsyncIterator[str]:
    """Hold one of ``project``'s ``limit`` slots while the block runs (429 when none is free)."""
    limits = limits_of(request)
    holder = holder or secrets.token_hex(8)
    await blocking(request.app, limits.acquire, project, limit, holder, hold_s)
    try:
        yield holder
    finally:
        await blocking(request.app, limits.release, project, limit, holder)
