"""Per-job blocklists: a worker that fails FARM_BLOCKLIST_FAILURES tiles of a job takes no more
of that job's tiles (its queue pick leaves them for other workers, no attempt counted) until
someone clears the job's blocklist."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from farm import keys, redisclock
from farm.redisclient import Redis, guard

#: the least time a worker's set of blocklisted jobs is kept (it is renewed by each new entry;
#: a worker's name is its process's, so the set is needed only while that process lives)
MIN_KEEP_S = 86400

_EVENT = """
local function warn(jid, ts, message)
  redis.call('XADD', keys.events(jid), 'MAXLEN', '~', 100000, '*', 'type', 'warning',
             'job_id', jid, 'ts', ts, 'message', message, 'v', '1')
end
"""

#: ARGV: job, worker, threshold, ts, keep_s. Counts a failure of the job's tile on the worker;
#: at the threshold the worker is blocklisted for the job (once). Returns 1 when it just was.
_RECORD = (
    keys.lua("blocklist", "worker_blocked", "events")
    + _EVENT
    + """
local bk = keys.blocklist(ARGV[1])
local n = redis.call('HINCRBY', bk, ARGV[2], 1)
if n < tonumber(ARGV[3]) or redis.call('HEXISTS', bk, ARGV[2] .. ':b') == 1 then return 0 end
redis.call('HSET', bk, ARGV[2] .. ':b', ARGV[4])
local wk = keys.worker_blocked(ARGV[2])
redis.call('SADD', wk, ARGV[1])
redis.call('EXPIRE', wk, ARGV[5])
warn(ARGV[1], ARGV[4], 'worker ' .. ARGV[2] .. ' is blocklisted for this job after ' .. n ..
     ' failed tiles; other workers render its tiles')
return 1
"""
)

#: ARGV: job, ts, who, worker ('' for all). Forgets the job's blocklist (or one worker's
#: entry and failure count); returns how many blocklisted workers it held.
_CLEAR = (
    keys.lua("blocklist", "worker_blocked", "events")
    + _EVENT
    + """
local bk = keys.blocklist(ARGV[1])
local only = ARGV[4] or ''
local cleared = 0
for _, name in ipairs(redis.call('HKEYS', bk)) do
  if string.sub(name, -2) == ':b' and (only == '' or name == only .. ':b') then
    redis.call('SREM', keys.worker_blocked(string.sub(name, 1, -3)), ARGV[1])
    cleared = cleared + 1
  end
end
if only == '' then redis.call('DEL', bk) else redis.call('HDEL', bk, only, only .. ':b') end
if cleared > 0 then
  warn(ARGV[1], ARGV[2], 'blocklist cleared by ' .. ARGV[3] .. ': ' .. cleared ..
       ' worker(s) may render this job again')
end
return cleared
"""
)


@dataclass(frozen=True)
class Entry:
    """A worker that failed tiles of the job, and whether it is blocklisted for it."""

    worker: str
    failures: int
    blocklisted: bool
    #: when it was blocklisted (epoch s), None while it is not
    since_s: float | None

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "failures": self.failures,
                "blocklisted": self.blocklisted, "since_s": self.since_s}  # fmt: skip


def record_failure(
    conn: Redis, job_id: str, worker: str, threshold: int, keep_s: float = MIN_KEEP_S
) -> bool:
    """Count a failed tile of ``job_id`` on ``worker`` (a counted failure only: never a
    preemption or an outage); True when this one blocklisted it."""
    keep = int(max(keep_s, MIN_KEEP_S))
    script = conn.register_script(_RECORD)
    now = redisclock.now(conn)
    return bool(guard(script, keys=[], args=[job_id, worker, threshold, now, keep]))


def entries(conn: Redis, job_id: str) -> list[Entry]:
    """The workers that failed the job's tiles, blocklisted ones first."""
    raw: dict[str, str] = guard(conn.hgetall, keys.blocklist(job_id))
    out = []
    for name, count in raw.items():
        if not name.endswith(":b"):
            since = raw.get(name + ":b")
            out.append(Entry(name, int(count), since is not None, float(since) if since else None))
    return sorted(out, key=lambda e: (not e.blocklisted, e.worker))


def blocked(conn: Redis, job_id: str) -> set[str]:
    return {e.worker for e in entries(conn, job_id) if e.blocklisted}


def clear(conn: Redis, job_id: str, who: str, worker: str = "") -> int:
    """Forget the job's blocklist (and its failure counts), or only ``worker``'s entry;
    returns the blocklisted workers it held."""
    script = conn.register_script(_CLEAR)
    return int(guard(script, keys=[], args=[job_id, redisclock.now(conn), who, worker]))


def announce(conn: Redis, worker: str, tags: frozenset[str], ttl_s: float) -> None:
    """Publish a live worker's tags (for telling whether anyone may still render a job)."""
    guard(conn.set, keys.worker_tags(worker), ",".join(sorted(tags)), ex=max(1, int(ttl_s)))


def none_left(conn: Redis, job_id: str, job_tags: tuple[str, ...], live: list[str]) -> bool:
    """Whether every live worker (``live``: names) that has the job's tags is blocklisted for
    it: the job then waits for a worker, which it says (farm.blocklist's caller warns)."""
    out = blocked(conn, job_id)
    pipe = conn.pipeline(transaction=False)
    for name in live:
        pipe.get(keys.worker_tags(name))
    for name, text in zip(live, guard(pipe.execute) if live else [], strict=True):
        if name not in out and set(job_tags) <= set((text or "").split(",")):
            return False
    return True


def warn_waiting(conn: Redis, job_id: str) -> None:
    message = ("every live worker that may render this job is blocklisted for it: the job "
               "waits for another worker (or clear its blocklist)")  # fmt: skip
    fields = {"type": "warning", "job_id": job_id, "ts": str(redisclock.now(conn)),
              "message": message, "v": "1"}  # fmt: skip
    guard(conn.xadd, keys.events(job_id), fields, maxlen=100000, approximate=True)
