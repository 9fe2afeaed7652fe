"""Job and tile state in Redis: create jobs, move tiles and frames through states, events."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from farm import cells, jobscripts, keys, redisclient, redisclock
from farm.alloc import usage
from farm.errors import Conflict, NotFound
from farm.models import Event, JobSpec, JobStatus, TileTask, tile_key
from farm.redisclient import Redis, guard
from farm.settings import Settings
from farm.states import JOB_FINAL, JobState, TileState
from farm.webhooks import outbox

#: how long a frame offered for assembly may wait for an assembler to take it before the sweep
#: offers it again (an assembler then holds it under the tiles' renewed lease, tile_lease_s)
ASSEMBLY_LEASE_S = 120.0
#: ended jobs a sweep pass trims to their summary at most (the rest wait for the next pass)
TRIM_LIMIT = 200


def connect(url: str) -> Redis:
    """A Redis client for the job store (text replies)."""
    return redisclient.connect(url)


@dataclass(frozen=True)
class Sweep:
    """What the farm's recovery sweep found (nothing when another worker is the sweeper)."""

    leader: bool
    #: attempts requeued because their worker stopped renewing them: to push to the queue
    tiles: list[TileTask]
    #: (job, frame, assembly attempt) assemblies past their deadline: to queue again
    frames: list[tuple[str, int, int]]
    #: requeued attempts whose push was never confirmed: push those the queue does not hold
    unconfirmed: list[TileTask]
    #: ended jobs trimmed to their summary in this pass
    trimmed_jobs: int = 0
    #: raw usage entries rolled up into hourly totals in this pass
    rolled_usage: int = 0


class JobStore:
    def __init__(
        self,
        conn: Redis,
        tile_lease_s: float = Settings.lease_ttl_s,
        clock: Callable[[], float] | None = None,
        job_retention_s: float = Settings.job_retention_s,
        usage_raw_retention_s: float = Settings.usage_raw_retention_s,
        cell: str = "",
    ) -> None:
        self.conn = conn
        #: the cell this store's farm is in a farm of cells (FARM_CELL): its job ids carry it
        self.cell = cell
        #: epoch seconds on Redis's clock, which every host shares (farm.redisclock): a
        #: deadline one host writes, another judges. The scale simulator drives its own.
        self.clock = clock or redisclock.clock_for(conn)
        #: a rendering tile not renewed for this long is requeued by the recovery sweep: the
        #: farm's lease TTL (FARM_LEASE_TTL_S), as for the tile's device lease
        self.tile_lease_s = tile_lease_s
        #: the sweep trims an ended job to its summary this long after it ended
        #: (FARM_JOB_RETENTION_S), and rolls up raw usage entries older than
        #: FARM_USAGE_RAW_RETENTION_S
        self.job_retention_s = job_retention_s
        self.usage_raw_retention_s = usage_raw_retention_s
        self._start = jobscripts.LIBRARY.bind(conn, "start_tile")
        self._touch = jobscripts.LIBRARY.bind(conn, "touch_tile")
        self._finish = jobscripts.LIBRARY.bind(conn, "finish_tile")
        self._fail = jobscripts.LIBRARY.bind(conn, "fail_tile")
        self._finish_frame = jobscripts.LIBRARY.bind(conn, "finish_frame")
        self._claim_frame = jobscripts.LIBRARY.bind(conn, "claim_frame")
        self._fence_frame = jobscripts.LIBRARY.bind(conn, "fence_frame")
        self._end = jobscripts.LIBRARY.bind(conn, "end_job")
        self._retry = jobscripts.LIBRARY.bind(conn, "retry_failed")
        self._sweep = jobscripts.LIBRARY.bind(conn, "sweep")
        self._trim = jobscripts.LIBRARY.bind(conn, "trim_ended")
        self._submitted = conn.register_script(outbox.SUBMITTED)

    # --- creating -------------------------------------------------------------------------

    def new_job_id(self) -> str:
        return cells.named(self.cell, time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:8])

    def stage_job(
        self, pipe: Any, job_id: str, spec: JobSpec, warnings: list[str], scripts_blocked: bool
    ) -> list[TileTask]:
        """Queue the commands that create a job into ``pipe`` (a MULTI pipeline); returns its tiles.

        The caller adds the queue pushes to the same pipeline, so a job exists exactly when its
        tiles are queued, and is in its project's index (the web's list) exactly when it exists.
        """
        # tiles of the grid, or parts of a sample split: the same tasks either way
        per_frame = spec.tasks_per_frame
        now = self.clock()
        tasks = [TileTask(job_id, f, i, 1) for f in spec.frames for i in range(per_frame)]
        # a job with dependencies waits for them (farm.dependencies): its tiles are not pushed
        state = JobState.WAITING if spec.depends_on else JobState.QUEUED
        pipe.hset(
            keys.job(job_id),
            mapping={
                "spec": spec.to_json(),
                "project": spec.project,
                "state": state.value,
                "reason": "",
                "created_s": now,
                "tiles_total": len(tasks),
                "tiles_done": 0,
                "tile_failures": 0,
                "frames_total": len(spec.frames),
                "frames_done": 0,
                "tiles_per_frame": per_frame,
                "scripts_blocked": int(scripts_blocked),
                "warnings": "\n".join(warnings),
            },
        )
        tile_fields: dict[str, Any] = {}
        for t in tasks:
            tile_fields[t.key] = TileState.QUEUED.value
            tile_fields[t.key + ":a"] = 1
        pipe.hset(keys.tiles(job_id), mapping=tile_fields)
        pipe.zadd(keys.JOBS, {job_id: now})
        pipe.zadd(keys.project_jobs(spec.project), {job_id: now})
        event = Event("job_state", job_id, now, state=state.value)
        pipe.xadd(keys.events(job_id), event.to_fields())
        # the webhooks' job.submitted, in the same MULTI (an outbox entry only with a hook)
        self._submitted(keys=[keys.job(job_id)], args=[job_id, now], client=pipe)
        # the jobs list's live feed (farm.jobscripts project_event, capped alike)
        pipe.xadd(keys.project_events(spec.project), event.to_fields(), maxlen=1000,
                  approximate=True)  # fmt: skip
        return tasks

    # --- changing a job's record ---------------------------------------------------------------

    def mark_scripts_blocked(self, job_id: str) -> None:
        """The file wanted to run Python while a tile rendered, and was not allowed to."""
        self._call(self.conn.hset, keys.job(job_id), "scripts_blocked", 1)

    def set_priority(self, job_id: str, priority: int) -> JobSpec:
        """Change the priority in a job's spec (its waiting tiles move with
        ``RenderQueue.set_priority``); Conflict once the job has ended, NotFound without it."""
        key = keys.job(job_id)

        def update(pipe: Any) -> JobSpec:
            state, text = pipe.hmget(key, "state", "spec")
            if text is None:
                raise NotFound(f"no job {job_id!r}", job_id=job_id)
            if JobState(state) in JOB_FINAL:
                raise Conflict(
                    f"job {job_id} has ended ({state}); its priority is fixed", state=state
                )
            spec = replace(JobSpec.from_json(text), priority=priority)
            pipe.multi()
            pipe.hset(key, "spec", spec.to_json())
            return spec

        spec: JobSpec = self._call(self.conn.transaction, update, key, value_from_callable=True)
        return spec

    # --- reading --------------------------------------------------------------------------

    def status(self, job_id: str) -> JobStatus:
        data = self._call(self.conn.hgetall, keys.job(job_id))
        if not data:
            raise NotFound(f"no job {job_id!r}", job_id=job_id)
        return _status_of(job_id, data)

    def statuses(self, job_ids: list[str]) -> list[JobStatus | None]:
        """The status of each job (None: no such job) in one round trip, for lists."""
        if not job_ids:
            return []
        pipe = self.conn.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(keys.job(job_id))
        rows = self._call(pipe.execute)
        return [
            _status_of(job_id, data) if data else None
            for job_id, data in zip(job_ids, rows, strict=True)
        ]

    def spec(self, job_id: str) -> JobSpec:
        text = self._call(self.conn.hget, keys.job(job_id), "spec")
        if text is None:
            raise NotFound(f"no job {job_id!r}", job_id=job_id)
        return JobSpec.from_json(text)

    def state(self, job_id: str) -> JobState:
        value = self._call(self.conn.hget, keys.job(job_id), "state")
        if value is None:
            raise NotFound(f"no job {job_id!r}", job_id=job_id)
        return JobState(value)

    def tile_states(self, job_id: str) -> dict[str, TileState]:
        raw = self._call(self.conn.hgetall, keys.tiles(job_id))
        return {k: TileState(v) for k, v in raw.items() if k.count(":") == 1}

    def created_s(self, job_id: str) -> float:
        value = self._call(self.conn.hget, keys.job(job_id), "created_s")
        if value is None:
            raise NotFound(f"no job {job_id!r}", job_id=job_id)
        return float(value)

    def project_job_ids(self, project: str, limit: int = 100) -> list[tuple[str, float]]:
        """The project's latest jobs, newest first: (job id, created epoch s)."""
        rows = self._call(self.conn.zrevrange, keys.project_jobs(project), 0, limit - 1,
                          withscores=True)  # fmt: skip
        return [(str(job_id), float(created)) for job_id, created in rows]

    def job_ids(self, limit: int = 50) -> list[str]:
        ids: list[str] = self._call(self.conn.zrevrange, keys.JOBS, 0, limit - 1)
        return ids

    def active_job_ids(self) -> list[str]:
        ids = self.job_ids(1000)
        states = self._call(self._pipelined_states, ids)
        return [j for j, st in zip(ids, states, strict=True) if st and st not in JOB_FINAL]

    def states(self, job_ids: list[str]) -> list[str | None]:
        """The state of each job (None: no such job), in one round trip."""
        return list(self._call(self._pipelined_states, job_ids))

    def _pipelined_states(self, job_ids: list[str]) -> list[str | None]:
        pipe = self.conn.pipeline(transaction=False)
        for j in job_ids:
            pipe.hget(keys.job(j), "state")
        return list(pipe.execute()) if job_ids else []

    def events(self, job_id: str, after: str = "0", block_ms: int | None = None) -> list[Event]:
        reply = self._call(
            self.conn.xread, {keys.events(job_id): after}, count=1000, block=block_ms
        )
        out: list[Event] = []
        for _stream, entries in reply or []:
            out.extend(Event.from_fields(eid, fields) for eid, fields in entries)
        return out

    # --- moving tiles and frames -------------------------------------------------------------

    def start_tile(self, task: TileTask, record: tuple[str, str] | None = None) -> str:
        """Claim a queued tile attempt for rendering: 'ok', 'stale', 'no_job' or 'job_<state>';
        ``record`` (a field of the tiles hash and its value: the attempt's start record,
        ``TaskRecords.start``) is written in the same step where it is 'ok'."""
        return str(self._run(self._start, *self._start_call(task, record)))

    def start_tile_in(
        self, pipe: Any, task: TileTask, record: tuple[str, str] | None = None
    ) -> Callable[[Any], str]:
        """``start_tile`` sent with ``pipe`` (one round trip with a worker's other calls as a
        tile starts); the function returned reads the pipeline's reply for it."""
        keys_, args = self._start_call(task, record)
        self._start.queue(pipe, keys_, args)
        return lambda value: str(self._call(self._start.reply, value, keys_, args))

    def _start_call(
        self, task: TileTask, record: tuple[str, str] | None
    ) -> tuple[list[str], list[Any]]:
        now = self.clock()
        keys_ = [keys.job(task.job_id), keys.tiles(task.job_id), keys.events(task.job_id)]
        args = [task.job_id, task.frame, task.index, task.attempt, now, now + self.tile_lease_s]
        return keys_, [*args, *(record or ())]

    def touch_tile(self, task: TileTask) -> bool:
        """Renew a rendering tile's lease; False when it is no longer ours."""
        return bool(self._run(self._touch, *self._touch_call(task)))

    def touch_tile_in(self, pipe: Any, task: TileTask) -> Callable[[Any], bool]:
        """``touch_tile`` sent with ``pipe`` (one round trip with its other calls, a worker's
        lease renewal); the function returned reads the pipeline's reply for it."""
        tiles_key, args = self._touch_call(task)
        self._touch.queue(pipe, tiles_key, args)
        return lambda value: bool(self._call(self._touch.reply, value, tiles_key, args))

    def _touch_call(self, task: TileTask) -> tuple[list[str], list[Any]]:
        deadline = self.clock() + self.tile_lease_s
        return [keys.tiles(task.job_id)], [task.key, task.attempt, deadline, task.job_id]

    def finish_tile(
        self, task: TileTask, tiles_per_frame: int, lease_id: str = "", lease_token: int = 0
    ) -> str:
        """Commit a rendered tile: 'ok', 'frame_ready' (its frame's last), 'stale', 'job_<st>'."""
        now = self.clock()
        j = task.job_id
        return str(
            self._run(
                self._finish,
                [
                    keys.job(j),
                    keys.tiles(j),
                    keys.frame_counts(j),
                    keys.assembling(j),
                    keys.events(j),
                ],
                [
                    j,
                    task.frame,
                    task.index,
                    task.attempt,
                    now,
                    tiles_per_frame,
                    now + ASSEMBLY_LEASE_S,
                    lease_id,
                    lease_token,
                ],
            )
        )

    def fail_tile(
        self, task: TileTask, reason: str, max_attempts: int, counts: bool = True
    ) -> tuple[str, int]:
        """Record a failed attempt: ('retry', next attempt), ('failed', n), ('stale', 0), ...

        ``counts=False`` requeues without counting a failure (preemption, a worker shutting down).
        """
        j = task.job_id
        reply = self._run(
            self._fail,
            [keys.job(j), keys.tiles(j), keys.events(j)],
            [
                j,
                task.frame,
                task.index,
                task.attempt,
                self.clock(),
                reason,
                max_attempts,
                "1" if counts else "0",
            ],
        )
        outcome = str(reply[0])
        return outcome, int(reply[1]) if len(reply) > 1 else 0

    def claim_frame(self, job_id: str, frame: int, attempt: int = 1) -> bool:
        """Take (or renew) assembly ``attempt`` of a frame whose tiles are all in, for
        ``tile_lease_s``; False once the frame was offered again under a later attempt (this
        assembler was paused or cut off past its lease), is assembled, or its job ended."""
        now = self.clock()
        return bool(
            self._run(
                self._claim_frame,
                [keys.job(job_id), keys.assembling(job_id)],
                [frame, now + self.tile_lease_s, job_id, attempt, now],
            )
        )

    def frame_fenced(self, job_id: str, frame: int, attempt: int) -> bool:
        """True when assembly ``attempt`` may no longer deliver: its lease passed or went to
        a later attempt, or the job ended. Checked right before each file reaches the output."""
        reply = self._run(
            self._fence_frame,
            [keys.job(job_id), keys.assembling(job_id)],
            [frame, attempt, self.clock()],
        )
        return not reply

    def finish_frame(self, job_id: str, frame: int, attempt: int = 1) -> str:
        """Commit assembly ``attempt`` of a frame: 'ok', 'stale' (not this attempt's), 'job_<s>'."""
        return str(
            self._run(
                self._finish_frame,
                [keys.job(job_id), keys.assembling(job_id), keys.events(job_id)],
                [job_id, frame, self.clock(), attempt],
            )
        )

    def end_job(self, job_id: str, state: JobState, reason: str = "") -> str:
        """Cancel or fail a job: 'ok', 'no_job' or 'job_<state>' when it had already ended."""
        return str(
            self._run(
                self._end,
                [keys.job(job_id), keys.tiles(job_id), keys.events(job_id)],
                [job_id, state.value, self.clock(), reason],
            )
        )

    def retry_failed(self, job_id: str) -> tuple[str, list[TileTask]]:
        """Queue every unfinished tile of a failed job again: ('ok', tiles to enqueue),
        ('nothing', []) when none is left, ('job_<state>', []) when the job has not failed."""
        flat = self._run(
            self._retry, [keys.job(job_id), keys.tiles(job_id), keys.events(job_id)],
            [job_id, self.clock()],
        )  # fmt: skip
        outcome = str(flat[0])
        rest = flat[1:]
        tasks = [
            TileTask(job_id, int(rest[i]), int(rest[i + 1]), int(rest[i + 2]))
            for i in range(0, len(rest), 3)
        ]
        return outcome, tasks

    def warn(self, job_id: str, message: str) -> None:
        event = Event("warning", job_id, self.clock(), message=message)
        self._call(self.conn.xadd, keys.events(job_id), event.to_fields())

    def sweep(
        self, sweeper: str, period_s: float, limit: int = 1000, requeue_grace_s: float | None = None
    ) -> Sweep:
        """One pass of the farm's recovery sweep, if ``sweeper`` holds (or takes) its lease.

        Every worker calls this each ``period_s``; one holds the lease (for two periods, so a
        missed beat keeps it, a dead sweeper is replaced) and does the work, which is in
        proportion to what expired, never to the number of jobs or workers. The sweeper also
        trims what Redis keeps (``trim``).
        """
        now = self.clock()
        grace = period_s if requeue_grace_s is None else requeue_grace_s
        flat = self._run(
            self._sweep,
            [keys.SWEEPER],
            [sweeper, now, int(period_s * 2000), limit, now + ASSEMBLY_LEASE_S, grace],
        )
        tiles: list[TileTask] = []
        frames: list[tuple[str, int, int]] = []
        unconfirmed: list[TileTask] = []
        i = 1
        while i < len(flat):
            if flat[i] == "f":
                frames.append((str(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3])))
                i += 4
                continue
            task = TileTask(str(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]), int(flat[i + 4]))
            (tiles if flat[i] == "t" else unconfirmed).append(task)
            i += 5
        if flat[0] != "leader":
            return Sweep(False, tiles, frames, unconfirmed)
        trimmed, rolled = self.trim(limit=min(limit, TRIM_LIMIT))
        return Sweep(True, tiles, frames, unconfirmed, trimmed, rolled)

    def trim(self, limit: int = TRIM_LIMIT) -> tuple[int, int]:
        """Trim the jobs that ended more than ``job_retention_s`` ago to their summary and roll
        up the raw usage entries older than ``usage_raw_retention_s``, at most ``limit`` of
        each (per project for usage): (jobs trimmed, usage entries rolled up)."""
        now = self.clock()
        trimmed = int(self._run(self._trim, [], [now - self.job_retention_s, limit, now]))
        rolled = usage.roll_up(self.conn, int(now * 1000), self.usage_raw_retention_s, limit)
        return trimmed, rolled

    def confirm_pushed(self, tasks: list[TileTask]) -> None:
        """The requeued attempts are in the queue: the sweep need not look at them again."""
        if tasks:
            members = [f"{t.job_id}|{t.key}" for t in tasks]
            self._call(self.conn.zrem, keys.REQUEUED, *members)

    def queued_tasks(self, job_id: str) -> list[TileTask]:
        """The current attempt of every queued tile of a job."""
        raw = self._call(self.conn.hgetall, keys.tiles(job_id))
        out = []
        for name, value in raw.items():
            if value == TileState.QUEUED.value and name.count(":") == 1:
                frame, index = name.split(":")
                out.append(TileTask(job_id, int(frame), int(index), int(raw[name + ":a"])))
        return out

    def committed_attempts(self, job_id: str, frame: int, count: int) -> list[int]:
        """The attempt whose output was committed, for each tile 0..count-1 of a frame."""
        names = [tile_key(frame, i) + ":a" for i in range(count)]
        values = self._call(self.conn.hmget, keys.tiles(job_id), names)
        return [int(v or 0) for v in values]

    def assembly_attempt(self, job_id: str, frame: int) -> int:
        """The attempt a frame whose tiles are all in is offered for assembly under: 1, or
        above every earlier assembly of a frame the user requeued (farm.jobcontrol)."""
        value = self._call(self.conn.hget, keys.assembling(job_id), f"{frame}:a")
        return int(value or 1)

    def tile_attempt(self, job_id: str, frame: int, index: int) -> int:
        value = self._call(self.conn.hget, keys.tiles(job_id), tile_key(frame, index) + ":a")
        return int(value or 0)

    # --- plumbing ------------------------------------------------------------------------------

    def _run(self, script: Any, keys_: list[str], args: list[Any]) -> Any:
        return guard(script, keys=keys_, args=args)

    @staticmethod
    def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return guard(fn, *args, **kwargs)


def _status_of(job_id: str, data: dict[str, str]) -> JobStatus:
    def opt(name: str) -> float | None:
        return float(data[name]) if data.get(name) else None

    return JobStatus(
        id=job_id,
        spec=JobSpec.from_json(data["spec"]),
        state=data["state"],
        reason=data.get("reason", ""),
        created_s=float(data["created_s"]),
        started_s=opt("started_s"),
        finished_s=opt("finished_s"),
        tiles_total=int(data["tiles_total"]),
        tiles_done=int(data["tiles_done"]),
        tile_failures=int(data["tile_failures"]),
        frames_total=int(data["frames_total"]),
        frames_done=int(data["frames_done"]),
        scripts_blocked=data.get("scripts_blocked") == "1",
        warnings=[w for w in data.get("warnings", "").split("\n") if w],
        archived_s=opt("archived_s"),
        estimate=_json_field(data, "estimate"),
        estimate_actual=_json_field(data, "estimate_actual"),
    )


def _json_field(data: dict[str, str], name: str) -> Any:
    return json.loads(data[name]) if data.get(name) else None
