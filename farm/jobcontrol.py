"""What a user does to a job after submitting it: suspend, resume, requeue, archive, delete.

Suspend holds tiles back where a worker draws them: a worker that takes a tile of a suspended
job does not start it; the start script marks the tile held (``:h``) under its next attempt
number (no failure is counted) and the worker drops the rq task. Tiles already rendering
finish and commit. Resume queues every held tile again; tiles still waiting in rq were never
touched and start as before. Nothing scans or rewrites the rq queues.

Requeue sends chosen tiles (whole frames or single tasks) of a job back to the queue under new
attempt numbers, also of a done, failed or canceled job, whose unfinished tiles go with them so
that the job can end again. A requeued frame's delivery record is dropped (it is delivered
again) and its running assembly fenced off: its next assembly's attempt is above every
earlier one. A late commit of an old tile attempt or assembly is refused as ``stale``.

Every action appends a ``job_action`` event (who did it) to the job's stream and to its
project's feed (``keys.project_events``), which the jobs list follows.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from farm import delivery, jobscripts, keys
from farm.errors import BadParameter, Conflict, FarmError, NotFound
from farm.jobstore import JobStore
from farm.models import Event, JobStatus, TileTask, tile_key
from farm.queue import RenderQueue
from farm.redisclient import Redis, guard
from farm.settings import Settings
from farm.states import JOB_FINAL, JobState
from farm.storage import layout
from farm.storage.base import Storage

log = logging.getLogger("tessera.jobcontrol")

#: what the batch endpoint and the CLI may ask for
ACTIONS = ("suspend", "resume", "requeue", "archive", "unarchive", "delete", "cancel")
#: the animation's MP4 preview in a job's output (workers.stillmodes.PREVIEW_NAME)
PREVIEW_FILE = "preview.mp4"
#: tiles one requeue may name (a job holds at most farm.models.MAX_JOB_TASKS)
MAX_REQUEUE_NAMES = 100_000

_ACTION_EVENT = """
local function action_event(jk, evk, jid, ts, what, message)
  local fields = {'type', 'job_action', 'job_id', jid, 'ts', ts, 'state', what,
                  'message', message, 'v', '1'}
  event(evk, fields)
  project_event(jk, fields)
end
"""

# KEYS: job, events   ARGV: jid, ts, who
SUSPEND = (
    jobscripts.PRELUDE
    + _ACTION_EVENT
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'no_job' end
if st ~= 'queued' and st ~= 'running' then return 'job_' .. st end
job_move(KEYS[1], KEYS[2], ARGV[1], 'suspended', ARGV[2], '')
action_event(KEYS[1], KEYS[2], ARGV[1], ARGV[2], 'suspended', 'suspended by ' .. ARGV[3])
return 'ok'
"""
)

# KEYS: job, tiles, events   ARGV: jid, ts, who
# Returns {'ok', frame, index, attempt, ...}: the held tiles to push, or {'job_<state>'}.
RESUME = (
    jobscripts.PRELUDE
    + _ACTION_EVENT
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return {'no_job'} end
if st ~= 'suspended' then return {'job_' .. st} end
local out = {'ok'}
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local name, value = all[i], all[i + 1]
  if string.sub(name, -2) == ':h' then
    local tile = string.sub(name, 1, -3)
    redis.call('HDEL', KEYS[2], name)
    if redis.call('HGET', KEYS[2], tile) == 'queued'
       and redis.call('HGET', KEYS[2], tile .. ':a') == value then
      -- until the push is confirmed, the sweep may push it (a crash between)
      redis.call('ZADD', REQUEUED, ARGV[2], ARGV[1] .. '|' .. tile)
      local sep = string.find(tile, ':', 1, true)
      table.insert(out, string.sub(tile, 1, sep - 1))
      table.insert(out, string.sub(tile, sep + 1))
      table.insert(out, value)
    end
  end
end
local new = 'queued'
if redis.call('HEXISTS', KEYS[1], 'started_s') == 1 then new = 'running' end
job_move(KEYS[1], KEYS[3], ARGV[1], new, ARGV[2], '')
action_event(KEYS[1], KEYS[3], ARGV[1], ARGV[2], 'resumed', 'resumed by ' .. ARGV[3])
return out
"""
)

# KEYS: job, tiles, framecount, assembling, events, delivered
# ARGV: jid, ts, who, message, tile name ('frame:index')...
# Returns {'ok', n, frame, index, attempt (n times), delivered frame...}, {'nothing'},
# {'no_job'} or {'trimmed'}.
REQUEUE = (
    jobscripts.PRELUDE
    + _ACTION_EVENT
    + """
local jk, tk, fk, ak, evk, dk = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local jid, ts = ARGV[1], ARGV[2]
local st = redis.call('HGET', jk, 'state')
if not st then return {'no_job'} end
if redis.call('HEXISTS', jk, 'trimmed_s') == 1 then return {'trimmed'} end
local tiles, frames, order = {}, {}, {}
for i = 5, #ARGV do
  local name = ARGV[i]
  local v = redis.call('HGET', tk, name)
  -- a queued tile waits already (held ones go on resume); an unknown name is skipped
  if v and v ~= 'queued' then
    local sep = string.find(name, ':', 1, true)
    local frame, index = string.sub(name, 1, sep - 1), string.sub(name, sep + 1)
    if v == 'done' then
      redis.call('HINCRBY', jk, 'tiles_done', -1)
      redis.call('HINCRBY', fk, frame, -1)
    elseif v == 'rendering' then
      -- its worker finds the tile taken over and stops; its late commit is stale
      redis.call('HDEL', tk, name .. ':d')
      redis.call('ZREM', TILE_DEADLINES, jid .. '|' .. name)
    end
    tile_move(tk, name, 'queued')
    local attempt = tonumber(redis.call('HGET', tk, name .. ':a') or '0') + 1
    redis.call('HSET', tk, name .. ':a', attempt)
    redis.call('HDEL', tk, name .. ':f', name .. ':h')
    redis.call('ZADD', REQUEUED, ts, jid .. '|' .. name)
    tile_event(evk, jid, ts, 'queued', frame, index, attempt, 'requeued by ' .. ARGV[3])
    for _, x in ipairs({frame, index, tostring(attempt)}) do table.insert(tiles, x) end
    if not frames[frame] then frames[frame] = true; table.insert(order, frame) end
  end
end
if #tiles == 0 then return {'nothing'} end
local delivered = {}
for _, frame in ipairs(order) do
  local cur = redis.call('HGET', ak, frame .. ':a')
  if cur then
    -- an assembly offered or in flight: fenced off, and the next one goes above it
    local last = tonumber(redis.call('HGET', ak, frame .. ':last') or '0')
    if tonumber(cur) > last then redis.call('HSET', ak, frame .. ':last', cur) end
    redis.call('HDEL', ak, frame, frame .. ':a')
    redis.call('ZREM', FRAME_DEADLINES, jid .. '|' .. frame)
  end
  -- a done job counts every frame (also one finished before ':c' was written)
  if redis.call('HDEL', ak, frame .. ':c') == 1 or st == 'done' then
    redis.call('HINCRBY', jk, 'frames_done', -1)
  end
  if redis.call('HDEL', dk, frame) == 1 then table.insert(delivered, frame) end
end
if FINAL[st] or st == 'assembling' then
  redis.call('HSET', jk, 'reason', '')
  redis.call('HDEL', jk, 'finished_s')
  redis.call('ZREM', keys.JOBS_ENDED, jid)
  job_move(jk, evk, jid, 'running', ts, '')
end
action_event(jk, evk, jid, ts, 'requeued', ARGV[4])
local out = {'ok', #tiles / 3}
for _, x in ipairs(tiles) do table.insert(out, x) end
for _, x in ipairs(delivered) do table.insert(out, x) end
return out
"""
)

# KEYS: job, tiles, framecount, assembling, events, delivered, JOBS, project's jobs, JOBS_ENDED
# ARGV: jid, ts, who
DELETE = (
    jobscripts.PRELUDE
    + """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'no_job' end
if not FINAL[st] then return 'job_' .. st end
project_event(KEYS[1], {'type', 'job_action', 'job_id', ARGV[1], 'ts', ARGV[2], 'state', 'deleted',
                        'message', 'deleted by ' .. ARGV[3], 'v', '1'})
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('ZREM', KEYS[7], ARGV[1])
redis.call('ZREM', KEYS[8], ARGV[1])
redis.call('ZREM', KEYS[9], ARGV[1])
return 'ok'
"""
)


@dataclass(frozen=True)
class Requeued:
    status: JobStatus
    #: tile attempts queued again
    tiles: list[TileTask]
    #: frames whose delivery was dropped (they are delivered again)
    redelivered: list[int]


@dataclass(frozen=True)
class Deleted:
    job_id: str
    #: storage objects removed: the job's tiles, logs and preview stills, its delivered files
    objects: int
    #: the job was still running and was canceled first
    canceled: bool


class JobControl:
    """The user's actions on jobs; every method names who acts (for the events)."""

    def __init__(self, store: JobStore, settings: Settings, storage: Storage, rq_conn: Redis):
        self.store, self.settings, self.storage, self.rq_conn = store, settings, storage, rq_conn
        conn = store.conn
        self._suspend = conn.register_script(SUSPEND)
        self._resume = conn.register_script(RESUME)
        self._requeue = conn.register_script(REQUEUE)
        self._delete = conn.register_script(DELETE)

    @property
    def conn(self) -> Redis:
        return self.store.conn

    # --- suspend and resume ------------------------------------------------------------------

    def suspend(self, job_id: str, who: str) -> JobStatus:
        """No tile of the job starts from now on; those rendering finish."""
        outcome = guard(self._suspend, keys=[keys.job(job_id), keys.events(job_id)],
                        args=[job_id, self.store.clock(), who])  # fmt: skip
        self.check_outcome(job_id, str(outcome), "only a queued or running job can be suspended")
        log.info("event=job_suspended job=%s user=%s", job_id, who)
        return self.store.status(job_id)

    def resume(self, job_id: str, who: str) -> tuple[JobStatus, int]:
        """Run a suspended job again: its held tiles are queued; (status, tiles pushed)."""
        flat = guard(self._resume, keys=[keys.job(job_id), keys.tiles(job_id),
                     keys.events(job_id)], args=[job_id, self.store.clock(), who])  # fmt: skip
        self.check_outcome(job_id, str(flat[0]), "only a suspended job can be resumed")
        tasks = _tasks(job_id, flat[1:])
        self._push(job_id, tasks)
        log.info("event=job_resumed job=%s tiles=%d user=%s", job_id, len(tasks), who)
        return self.store.status(job_id), len(tasks)

    # --- requeue -------------------------------------------------------------------------------

    def requeue(
        self,
        job_id: str,
        who: str,
        frames: list[int] | None = None,
        tasks: list[tuple[int, int]] | None = None,
    ) -> Requeued:
        """Render chosen frames (every task of each) and tasks (frame, index) again, and deliver
        their frames again. Nothing chosen: every unfinished tile (a canceled or failed job
        run again). A failed or canceled job's unfinished tiles always go with the chosen
        ones, so that it can end."""
        status = self.store.status(job_id)
        spec = status.spec
        if spec.source.kind == "upload" and not self.storage.exists(spec.source.location):
            # its project deleted the upload (farm.uploadrecords) once the job had ended
            raise Conflict(f"job {job_id}'s file {spec.source.name} was deleted from the farm: "
                           "upload it again and submit a new job", job_id=job_id)  # fmt: skip
        per_frame = spec.tasks_per_frame
        frames, tasks = list(frames or []), list(tasks or [])
        if len(frames) * per_frame + len(tasks) > MAX_REQUEUE_NAMES:
            raise BadParameter(f"at most {MAX_REQUEUE_NAMES} tasks may be requeued at once")
        known = set(spec.frames)
        for f in frames:
            if f not in known:
                raise BadParameter(f"frame {f} is not a frame of job {job_id}", frame=f)
        for f, i in tasks:
            if f not in known or not 0 <= i < per_frame:
                raise BadParameter(
                    f"task {f}:{i} is not a task of job {job_id} (its frames have tasks 0 to "
                    f"{per_frame - 1})",
                    task=f"{f}:{i}",
                )
        states = self.store.tile_states(job_id)
        chosen = {tile_key(f, i) for f in frames for i in range(per_frame)}
        chosen |= self._whole_frames_where_tiles_are_gone(job_id, tasks, per_frame, states)
        if status.state in (JobState.FAILED, JobState.CANCELED) or not (frames or tasks):
            chosen |= {name for name, st in states.items() if st != "done"}
        if not chosen:
            raise Conflict(f"job {job_id} has nothing to requeue")
        # the files of each frame delivered so far, read before the script drops the records
        records = guard(self.conn.hgetall, keys.delivered(job_id))
        what = _what(frames, tasks)
        message = f"{what} requeued by {who}"
        flat = guard(
            self._requeue,
            keys=[keys.job(job_id), keys.tiles(job_id), keys.frame_counts(job_id),
                  keys.assembling(job_id), keys.events(job_id), keys.delivered(job_id)],
            args=[job_id, self.store.clock(), who, message, *sorted(chosen)],
        )  # fmt: skip
        outcome = str(flat[0])
        if outcome == "nothing":
            raise Conflict(f"job {job_id}: every chosen task is queued already")
        if outcome == "trimmed":
            raise Conflict(f"job {job_id} ended more than FARM_JOB_RETENTION_S ago and its tile "
                           "records were trimmed: submit it again", job_id=job_id)  # fmt: skip
        self.check_outcome(job_id, outcome, "")
        count = int(flat[1])
        queued = _tasks(job_id, flat[2 : 2 + 3 * count])
        redelivered = sorted(int(f) for f in flat[2 + 3 * count :])
        self._unpublish(spec.output, [records.get(str(f)) for f in redelivered])
        if spec.preview and len(spec.frames) > 1 and redelivered:
            self._renew_preview(job_id, spec.output, redelivered, records)
        self._push(job_id, queued)
        log.info("event=job_requeued job=%s tiles=%d frames=%s user=%s", job_id, len(queued),
                 redelivered, who)  # fmt: skip
        return Requeued(self.store.status(job_id), queued, redelivered)

    def _whole_frames_where_tiles_are_gone(
        self, job_id: str, tasks: list[tuple[int, int]], per_frame: int, states: dict[str, Any]
    ) -> set[str]:
        """The chosen tasks, and every task of their frame where a done sibling's tile is no
        longer stored (FARM_TILE_RETENTION=delete drops them once the frame is delivered):
        the frame cannot be stitched from the old tiles, so all of it renders again."""
        out: set[str] = set()
        for frame in sorted({f for f, _ in tasks}):
            mine = {tile_key(f, i) for f, i in tasks if f == frame}
            out |= mine
            siblings = [i for i in range(per_frame) if tile_key(frame, i) not in mine]
            attempts = self.store.committed_attempts(job_id, frame, per_frame)
            gone = any(
                states.get(tile_key(frame, i)) == "done"
                and not self.storage.exists(layout.tile_key(job_id, frame, i, attempts[i]))
                for i in siblings
            )
            if gone:
                out |= {tile_key(frame, i) for i in range(per_frame)}
        return out

    def _unpublish(self, output: str, records: list[str | None]) -> None:
        """An object store commits each file once: the requeued frames' files go, so their
        next delivery can commit. A folder's files are replaced by the delivery itself."""
        target = delivery.open_output(output, self.settings)
        if not delivery.commits_once(target):
            return
        for record in records:
            for item in json.loads(record or "[]"):
                target.delete(item["name"])

    def _renew_preview(
        self, job_id: str, output: str, frames: list[int], records: dict[str, str]
    ) -> None:
        """The animation's MP4 is made again with the requeued frames: their old stills go (it
        is encoded once every frame's still is back, with the last of them), and the MP4 leaves
        the record of the frame it was delivered with (and an object store, which commits a
        file once), so that the manifest lists the new one."""
        for frame in frames:
            self.storage.delete(layout.preview_still_key(job_id, frame))
        redelivered = {str(f) for f in frames}
        for name, record in records.items():
            items = json.loads(record or "[]")
            kept = [item for item in items if item["name"] != PREVIEW_FILE]
            if name not in redelivered and len(kept) < len(items):
                guard(self.conn.hset, keys.delivered(job_id), name, json.dumps(kept))
                target = delivery.open_output(output, self.settings)
                if delivery.commits_once(target):
                    target.delete(PREVIEW_FILE)

    def _push(self, job_id: str, tasks: list[TileTask]) -> None:
        if not tasks:
            return
        spec = self.store.spec(job_id)
        RenderQueue(self.rq_conn, spec.device).stage_tiles(tasks, spec.tile_timeout_s)
        self.store.confirm_pushed(tasks)

    # --- archive -------------------------------------------------------------------------------

    def archive(self, job_id: str, who: str, archived: bool = True) -> JobStatus:
        """Hide an ended job from the default jobs list (``archived=False``: show it again).
        Its records, files and retention are unchanged."""
        status = self.store.status(job_id)
        if archived and status.state not in JOB_FINAL:
            raise Conflict(f"job {job_id} is {status.state}; only an ended job can be archived",
                           state=status.state)  # fmt: skip
        what = "archived" if archived else "unarchived"
        now = self.store.clock()
        event = Event("job_action", job_id, now, state=what, message=f"{what} by {who}")
        fields: dict[Any, Any] = event.to_fields()
        pipe = self.conn.pipeline()
        if archived:
            pipe.hset(keys.job(job_id), mapping={"archived_s": now, "archived_by": who})
        else:
            pipe.hdel(keys.job(job_id), "archived_s", "archived_by")
        pipe.xadd(keys.events(job_id), fields, maxlen=100_000, approximate=True)
        pipe.xadd(keys.project_events(status.spec.project), fields, maxlen=1_000,
                  approximate=True)  # fmt: skip
        guard(pipe.execute)
        log.info("event=job_%s job=%s user=%s", what, job_id, who)
        return self.store.status(job_id)

    # --- delete --------------------------------------------------------------------------------

    def delete(self, job_id: str, who: str, confirm: bool) -> Deleted:
        """Remove a job: its stored tiles, logs and previews, the files it delivered and its
        manifest, then its records in Redis. Only with ``confirm``; a job still running is
        canceled first (its workers stop at their next lease renewal)."""
        if not confirm:
            raise BadParameter(f"deleting job {job_id} removes its records and files: confirm "
                               "it (confirm: true, or --yes)", job_id=job_id)  # fmt: skip
        status = self.store.status(job_id)
        canceled = False
        if status.state not in JOB_FINAL:
            canceled = self.store.end_job(job_id, JobState.CANCELED, f"deleted by {who}") == "ok"
        # files first: a failure here leaves the records, and the delete can be asked again
        objects = self.storage.delete_prefix(f"jobs/{job_id}")
        objects += self._delete_delivered(job_id, status.spec.output, status.spec.preview)
        outcome = guard(
            self._delete,
            keys=[keys.job(job_id), keys.tiles(job_id), keys.frame_counts(job_id),
                  keys.assembling(job_id), keys.events(job_id), keys.delivered(job_id), keys.JOBS,
                  keys.project_jobs(status.spec.project), keys.JOBS_ENDED],
            args=[job_id, self.store.clock(), who],
        )  # fmt: skip
        self.check_outcome(job_id, str(outcome), "a running job is canceled before it is deleted")
        log.info("event=job_deleted job=%s objects=%d canceled=%s user=%s", job_id, objects,
                 canceled, who)  # fmt: skip
        return Deleted(job_id, objects, canceled)

    def _delete_delivered(self, job_id: str, output: str, preview: bool) -> int:
        """The files the job delivered (its records, else its manifest once trimmed), and the
        manifest with the animation's preview where the manifest is the job's; never anything
        else in its output."""
        target = delivery.open_output(output, self.settings)
        names: set[str] = set()
        for record in guard(self.conn.hvals, keys.delivered(job_id)):
            names |= {item["name"] for item in json.loads(record)}
        try:
            manifest = json.loads(target.read_bytes(delivery.MANIFEST))
            if manifest.get("job_id") == job_id:
                names |= {f["name"] for e in manifest["frames"] for f in e["files"]}
                names.add(delivery.MANIFEST)
                if preview:  # a requeue of the last frame drops it from the records
                    names.add(PREVIEW_FILE)
        except (FarmError, ValueError, KeyError, OSError):
            pass  # no manifest (the job ended before its last frame), or not this job's
        count = 0
        for name in sorted(names):
            if target.exists(name):
                target.delete(name)
                count += 1
        return count

    # --- plumbing ------------------------------------------------------------------------------

    @staticmethod
    def check_outcome(job_id: str, outcome: str, why: str) -> None:
        if outcome == "ok":
            return
        if outcome == "no_job":
            raise NotFound(f"no job {job_id!r}", job_id=job_id)
        state = outcome.removeprefix("job_")
        raise Conflict(f"job {job_id} is {state}{'; ' + why if why else ''}", job_id=job_id,
                       state=state)  # fmt: skip


def _tasks(job_id: str, flat: list[Any]) -> list[TileTask]:
    return [
        TileTask(job_id, int(flat[i]), int(flat[i + 1]), int(flat[i + 2]))
        for i in range(0, len(flat), 3)
    ]


def _what(frames: list[int], tasks: list[tuple[int, int]]) -> str:
    parts = []
    if frames:
        parts.append(f"frame{'s' if len(frames) > 1 else ''} {', '.join(map(str, frames))}")
    if tasks:
        parts.append(f"task{'s' if len(tasks) > 1 else ''} "
                     + ", ".join(f"{f}:{i}" for f, i in tasks))  # fmt: skip
    return " and ".join(parts) or "unfinished tiles"
