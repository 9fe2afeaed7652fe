"""The render worker's tasks, run by rq in the worker: inspect, render a tile, assemble a frame."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import shutil
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from farm import (
    blocklist,
    delivery,
    dependencies,
    estimate,
    estimaterecords,
    failures,
    keys,
    metrics,
    tagslots,
)
from farm.alloc.allocator import Lease, LeaseBeside, Request, SlotAllocator
from farm.alloc.devices import Device
from farm.errors import (
    BlenderCrashed,
    FarmError,
    LeaseLost,
    NoCapacity,
    RenderError,
    TileAbandoned,
)
from farm.jobstore import JobStore
from farm.models import BlendSource, JobSpec, TileTask
from farm.queue import RenderQueue, live_worker_names
from farm.redisclient import Redis, guard
from farm.settings import Settings
from farm.states import JobState
from farm.storage.base import Storage
from farm.storage.layout import ZIP_FILES, frame_tiles_key, tile_key, tile_log_key
from farm.taskrecords import Attempt, TaskRecords
from farm.workerstate import Reporter
from workers import progressive, redaction, stillmodes
from workers.child import BlenderChild
from workers.devicewait import acquire_for_tile
from workers.shutdown import Shutdown
from workers.storageretry import retry_storage
from workers.uploadcache import cached_upload

log = logging.getLogger("tessera.worker")

#: how long a worker waits for room on its device (a stream may hold it) before it hands the
#: tile back to the queue, not counted as a failure
LEASE_WAIT_S = 30.0


@dataclass
class WorkerContext:
    """What every task of one worker process shares: its Blender child above all."""

    settings: Settings
    name: str
    conn: Redis
    store: JobStore
    queue: RenderQueue
    storage: Storage
    child: BlenderChild
    allocator: SlotAllocator
    #: the device this worker is bound to (its render leases are taken there)
    device: Device
    #: SIGTERM state: a render in progress may be abandoned (see workers.shutdown)
    shutdown: Shutdown | None = None
    specs: dict[str, JobSpec] = field(default_factory=dict)
    #: what the workers page shows of this worker (farm.workerstate); its disabled flag
    report: Reporter = field(default_factory=Reporter)
    #: FARM_WORKER_TAGS and FARM_TAG_LIMITS (the queue pick routes by them; see farm.tags)
    tags: frozenset[str] = frozenset()
    tag_limits: dict[str, int] = field(default_factory=dict)
    #: the task record this worker wrote last as it started a task (see ``record``)
    _started: tuple[TileTask, Attempt] | None = field(default=None, init=False, repr=False)
    #: the tile on its device now: the writes that end it go in one round trip (``_Ending``)
    _ending: _Ending | None = field(default=None, init=False, repr=False)
    #: the worker's heartbeat, carrying the rendering tile's renewal (``CarriedRenewal``)
    carried: CarriedRenewal | None = None

    @property
    def scratch(self) -> Path:
        path = self.settings.work_dir / self.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @functools.cached_property
    def records(self) -> TaskRecords:
        return TaskRecords(self.store.conn)

    @property
    def device_label(self) -> str:
        """The device as a user reads it in a failure's cause and the task table."""
        if self.device.index is None:
            return "the CPU"
        return f"GPU {self.device.index} ({self.device.model})"

    def record(self, task: TileTask, ended: str, **fields: Any) -> None:
        """Note the attempt's end in the job's task records (its start: ``begin``); the
        records inform, so a Redis hiccup here is logged and the task goes on. The worker
        runs one task at a time: the start it wrote last is kept, so the end needs no read.
        The end of a tile on its device goes with the round trip that releases the device."""
        end = AttemptEnd(ended, self.store.clock(), self._kept_start(task), fields)
        ending = self._ending
        if ending is not None and ending.task == task:
            ending.end = end
            return
        try:
            self.records.ended(task, end.now, end.outcome, started=end.started, **end.fields)
        except FarmError as exc:
            _record_failed(task, exc)

    def _kept_start(self, task: TileTask) -> Attempt | None:
        """The start record this worker wrote last, where it is ``task``'s (taken: once)."""
        kept, self._started = self._started, None
        return kept[1] if kept is not None and kept[0] == task else None

    def begin(self, task: TileTask) -> tuple[str, bool]:
        """Start the tile (``JobStore.start_tile``'s outcome: 'ok' or why not) with the
        attempt's start record, and read whether an operator disabled this worker, in one
        round trip (``begin_writes``)."""
        started, record, disabled = begin_writes(
            self.conn, self.store, self.records, self.report, task, self.name,
            self.device_label, self.device.device_class, self.store.clock(),
        )  # fmt: skip
        self._started = None if record is None else (task, record)
        return started, disabled

    def spec(self, job_id: str) -> JobSpec:
        if job_id not in self.specs:
            self.specs[job_id] = self.store.spec(job_id)
        return self.specs[job_id]

    def blend_path(self, source: BlendSource) -> Path:
        if source.kind == "path":
            path = Path(source.location)
        else:
            path = cached_upload(self.storage, source, self.settings.work_dir / "blends")
        if not path.is_file():
            log.warning("event=blend_unreadable worker=%s path=%s", self.name, path)
            raise RenderError(f"{source.name} is not readable on worker {self.name}")
        return path

    def prepare(self, source: BlendSource, project: str | None) -> Path:
        """The .blend of ``source``, with the Blender child serving ``project``'s file set.

        The child never serves two projects (nor two file sets): a crash one project's file
        causes is never charged to another's task, and a sandboxed child sees one file set.
        """
        path = self.blend_path(source)
        root = file_set_root(source, path)
        if root.stat().st_mode & 0o005 != 0o005 and root.is_relative_to(self.settings.work_dir):
            # the cache's unpacked zip was made by mkdtemp (0700): the sandbox's user reads it
            root.chmod(0o755)
        if self.child.use(project, root, local=source.kind == "path"):
            log.info("event=child_switch worker=%s project=%s sha256=%s", self.name, project,
                     source.sha256)  # fmt: skip
        return path

    def sweep(self) -> None:
        """Requeue work whose worker vanished: tiles not renewed, frames not assembled.

        Every worker calls this; the one holding the sweeper's lease does the work, in
        proportion to what expired (``JobStore.sweep``), not to the jobs. A job whose push
        fails is logged and left unconfirmed, for the next sweep; the other jobs' go on.
        """
        # the worker's tags, for telling whether anyone may still render a blocklisted job
        blocklist.announce(self.conn, self.name, self.tags, self.settings.lease_ttl_s * 3)
        found = self.store.sweep(self.name, self.settings.lease_ttl_s)
        if found.leader:
            # waiting jobs counted again: a release or failure lost in between is healed
            dependencies.recheck(self.store)
        dependencies.push_released(self.store, self.queue.conn)
        for t in found.tiles:
            log.warning("event=tile_requeued job=%s frame=%d tile=%d attempt=%d "
                        "reason=worker_lost", t.job_id, t.frame, t.index, t.attempt)  # fmt: skip
        missing = self.queue.missing(found.unconfirmed)
        # the rest is in the queue: confirmed, so the sweep stops naming it
        self.store.confirm_pushed([t for t in found.unconfirmed if t not in missing])
        # an attempt may be in both lists: stage_tiles pushes each once
        pushes = [*found.tiles, *missing]
        for job_id in sorted({t.job_id for t in pushes}):
            mine = [t for t in pushes if t.job_id == job_id]
            try:
                # the job's own class: a requeued (or released) GPU tile never lands on CPUs
                spec = self.spec(job_id)
                RenderQueue(self.queue.conn, spec.device).stage_tiles(mine, spec.tile_timeout_s)
                self.store.confirm_pushed(mine)
            except Exception as exc:  # one job's failure must not keep the others' tiles waiting
                log.warning("event=sweep_push_failed job=%s tiles=%d error=%r", job_id,
                            len(mine), exc, exc_info=not isinstance(exc, FarmError))  # fmt: skip
        for job_id, frame, attempt in found.frames:
            try:
                self.queue.enqueue_assembly(job_id, frame, self.spec(job_id).tile_timeout_s,
                                            attempt)  # fmt: skip
            except Exception as exc:  # offered again once its new assembly deadline passes
                log.warning("event=sweep_assembly_failed job=%s frame=%d error=%r", job_id,
                            frame, exc, exc_info=not isinstance(exc, FarmError))  # fmt: skip


def file_set_root(source: BlendSource, path: Path) -> Path:
    """The folder of the job's own files: the unpacked zip (its .blend may sit in a subfolder
    of it), else the .blend's folder."""
    if ZIP_FILES in source.location:
        inside = PurePosixPath(source.location.split(ZIP_FILES, 1)[1])
        return path.parents[len(inside.parts) - 1]
    return path.parent


_context: WorkerContext | None = None


def install(ctx: WorkerContext) -> None:
    global _context
    _context = ctx


def context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("tasks run only inside a worker that installed its context")
    return _context


# --- inspection ------------------------------------------------------------------------------


#: error fields an inspection's asker may see; the rest (log tail, paths, pids) stays here
PUBLIC_FIELDS = frozenset({"reason", "signal", "exit_code", "timeout_s"})


def inspect_blend(
    source: dict[str, Any], reply_key: str, project: str = "", probe: bool = False
) -> None:
    """Open the .blend with scripts off and push the report (or the error) onto ``reply_key``.

    ``project`` asked for it (empty: none named; see BlenderChild.use). ``probe``: the report
    also carries the estimate's probe (``_probe``), timed on this worker's device.
    """
    ctx = context()
    src = BlendSource.from_dict(source)
    # a SIGTERM's grace abandons an inspection (and its probe) as it does a tile's render
    stopping = ctx.shutdown.rendering() if ctx.shutdown else contextlib.nullcontext()
    try:
        with ctx.report.activity("inspecting", task="inspection", project=project), stopping:
            path = ctx.prepare(src, project or None)
            report = ctx.child.inspect(path, ctx.settings.inspect_timeout_s)
            if probe:
                report = {**report, **_probe(ctx, path, report)}
        if "probe_error" in report and _stopped(ctx):
            raise TileAbandoned("the worker stopped during the probe")
        reply: dict[str, Any] = {"ok": True, "report": report}
    except FarmError as exc:
        if isinstance(exc, TileAbandoned) or _stopped(ctx):
            _hand_back_inspection(ctx, src, reply_key, project, probe)
            return
        log.warning("event=inspection_failed worker=%s project=%s sha256=%s error=%s "
                    "message=%r fields=%r", ctx.name, project, src.sha256, exc.code,
                    exc.message, exc.fields)  # fmt: skip
        shown = {k: v for k, v in exc.fields.items() if k in PUBLIC_FIELDS}
        reply = {"ok": False, **shown, "error": exc.code, "message": redaction.public(exc.message)}
    pipe = ctx.conn.pipeline()
    pipe.lpush(reply_key, json.dumps(reply))
    pipe.expire(reply_key, 600)
    pipe.execute()


def _stopped(ctx: WorkerContext) -> bool:
    """The worker gave up its work: a SIGTERM's grace ran out (workers.shutdown)."""
    return ctx.shutdown is not None and ctx.shutdown.abandoned.is_set()


def _hand_back_inspection(
    ctx: WorkerContext, src: BlendSource, reply_key: str, project: str, probe: bool
) -> None:
    """Queue the inspection again, at the front, for another worker of the device class to
    answer the same asker (who waits on ``reply_key`` until its own deadline): a stopping
    worker's inspection costs its asker the time spent, never a failed submission."""
    timeout_s = ctx.settings.inspect_timeout_s * (2 if probe else 1)
    ctx.queue.enqueue_inspection(src, reply_key, timeout_s, project, probe)
    log.warning("event=inspection_handed_back worker=%s project=%s why=stopping", ctx.name,
                project)  # fmt: skip


def _probe(ctx: WorkerContext, path: Path, report: dict[str, Any]) -> dict[str, Any]:
    """``{"probe": ...}``: the estimate's probe renders, timed on this worker's device; or
    ``{"probe_error": ...}`` (the report stands without it: tiles would say what failed)."""
    settings = ctx.settings
    frames = estimate.probe_frames(
        report["frame_start"], report["frame_end"], report["frame_step"],
        settings.estimate_probe_frames,
    )  # fmt: skip
    out_dir = ctx.child.writable(ctx.scratch / f"probe-{uuid.uuid4().hex}")
    try:
        measured = ctx.child.probe(path, frames=frames, pixels=settings.estimate_probe_pixels,
                                   budget_s=settings.estimate_probe_s, out_dir=out_dir,
                                   timeout_s=settings.inspect_timeout_s)  # fmt: skip
    except FarmError as exc:
        log.warning("event=probe_failed worker=%s error=%s message=%r", ctx.name, exc.code,
                    exc.message)  # fmt: skip
        return {"probe_error": redaction.public(exc.message)}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    log.info("event=probed worker=%s frames=%s took_s=%s", ctx.name, frames,
             measured.get("took_s"))  # fmt: skip
    return {"probe": {**measured, "device_class": ctx.device.device_class}}


# --- tiles -------------------------------------------------------------------------------------


def render_tile(job_id: str, frame: int, index: int, attempt: int) -> None:
    ctx = context()
    task = TileTask(job_id, frame, index, attempt)
    try:
        _render_tile(ctx, task)
    finally:
        # the slots of limited tags the pick took for this tile (farm.tagslots)
        tagslots.release(ctx.conn, ctx.tag_limits, task.rq_id)


def _render_tile(ctx: WorkerContext, task: TileTask) -> None:
    job_id, frame, index, attempt = task.job_id, task.frame, task.index, task.attempt
    started, disabled = ctx.begin(task)
    if started != "ok":
        log.info("event=tile_skipped job=%s frame=%d tile=%d attempt=%d why=%s",
                 job_id, frame, index, attempt, started)  # fmt: skip
        return
    spec = ctx.spec(job_id)
    if disabled:
        # taken in the moment its operator disabled it: handed back, not counted
        _tile_failed(ctx, spec, task, f"worker {ctx.name} was disabled by an operator; requeued",
                     counts=False)  # fmt: skip
        return
    # a SIGTERM's grace also ends the wait for a device: the worker must exit in time
    stop = ctx.shutdown.abandoned if ctx.shutdown is not None else None
    shown = rendering_shown(ctx.report, task, spec.project)
    try:
        request = _render_request(ctx, spec, job_id)
        lease = acquire_for_tile(ctx.store, ctx.allocator, ctx.name, task, request,
                                 LEASE_WAIT_S, stop, shown)  # fmt: skip
    except NoCapacity as exc:
        why = exc.message
        if stop is not None and stop.is_set():
            why = "worker stopped before the tile finished; requeued"
        _tile_failed(ctx, spec, task, why, counts=False, error=exc)
        return
    except FarmError as exc:
        _tile_failed(ctx, spec, task, exc.message, error=exc)
        return
    ending = _Ending(ctx, task, lease)
    ctx._ending = ending
    try:
        _render_leased(ctx, spec, task, lease)
    finally:
        ctx._ending = None
        ending.send()


def _render_request(ctx: WorkerContext, spec: JobSpec, job_id: str = "") -> Request:
    # device memory (on the CPU device: host memory) the render reserves: the scene's estimate
    # from inspection, never below the configured floor, never above the device
    wanted = max(spec.vram_mib, ctx.settings.render_vram_floor_mib)
    return Request(
        "render",
        vram_mib=min(wanted, ctx.device.vram_mib),
        render_slots=1,
        device_ids=(ctx.device.id,),
        project=spec.project,
        role=spec.role,
        job=job_id,
    )


def _render_leased(ctx: WorkerContext, spec: JobSpec, task: TileTask, lease: Lease) -> None:
    scratch = ctx.scratch / f"{task.job_id}-{task.frame}-{task.index}-{task.attempt}.exr"
    t0 = time.monotonic()
    renewal = _Renewal(ctx, task, lease)
    stopping = ctx.shutdown.rendering() if ctx.shutdown else contextlib.nullcontext()
    try:
        blend = ctx.prepare(spec.source, spec.project)
        mark = ctx.child.log_mark()  # this attempt's part of Blender's log goes in its own log
        with renewal, stopping:
            if spec.live_preview:
                # in sample passes, each merged state shown live (workers.progressive)
                result = progressive.render_in_passes(
                    ctx.child, ctx.store.conn, blend, spec, task, scratch,
                    ctx.settings.live_preview_ttl_s, renewal.check,
                    ctx.settings.live_preview_budget,
                )  # fmt: skip
            else:
                result = stillmodes.render_task(ctx.child, blend, spec, task, scratch,
                                                spec.tile_timeout_s)  # fmt: skip
        if renewal.lost is not None:
            # found lost once Blender had finished: the child is kept, the result dropped
            raise LeaseLost(f"lease lost after the render: {renewal.lost}")
        _store_tile(ctx, task, scratch, renewal)
    except FarmError as exc:
        scratch.unlink(missing_ok=True)
        if renewal.lost is not None:
            # preempted or paused past the lease: not the tile's fault
            _tile_failed(ctx, spec, task, f"lease lost: {renewal.lost}", counts=False, error=exc)
        elif ctx.shutdown is not None and ctx.shutdown.abandoned.is_set():
            # the machine is going away (spot reclaim, scale-down): not the tile's fault either
            _tile_failed(ctx, spec, task, "worker stopped before the tile finished; requeued",
                         counts=False, error=exc)  # fmt: skip
        else:
            _tile_failed(ctx, spec, task, exc.message, error=exc)
        return
    except Exception as exc:
        scratch.unlink(missing_ok=True)
        _tile_failed(ctx, spec, task, "internal error on the worker (see the tile's log)",
                     error=exc)  # fmt: skip
        raise
    if result.get("autoexec_fail"):
        ctx.store.mark_scripts_blocked(task.job_id)
    if result.get("fallback"):
        ctx.store.warn(task.job_id, f"tile {task.index} of frame {task.frame} rendered on the "
                       f"CPU: {result['fallback']}")  # fmt: skip
    outcome = ctx.store.finish_tile(task, spec.tasks_per_frame, lease.id, lease.token)
    if outcome == "fenced":
        _tile_failed(ctx, spec, task, "lease lost before the commit", counts=False)
    elif outcome in ("ok", "frame_ready"):
        logged = _write_done_log(ctx, task, result, ctx.child.log_since(mark))
        ctx.record(task, "done", render_s=result.get("render_s"), cpu_s=result.get("cpu_s"),
                   peak_memory_mib=result.get("peak_memory_mib"), logged=logged)  # fmt: skip
        metrics.TILES_RENDERED.labels(ctx.device.device_class).inc()
        ctx.report.count("done")
        metrics.TILE_SECONDS.labels(ctx.device.device_class).observe(time.monotonic() - t0)
    log.info("event=tile_done job=%s frame=%d tile=%d attempt=%d render_s=%.3f total_s=%.3f "
             "commit=%s device=%s backend=%s token=%d", task.job_id, task.frame, task.index,
             task.attempt, result.get("render_s", 0.0), time.monotonic() - t0, outcome,
             lease.device, result.get("device"), lease.token)  # fmt: skip
    if outcome == "frame_ready":
        # 1, or above the earlier assemblies of a frame the user requeued
        attempt = ctx.store.assembly_attempt(task.job_id, task.frame)
        ctx.queue.enqueue_assembly(task.job_id, task.frame, spec.tile_timeout_s, attempt)


def _store_tile(ctx: WorkerContext, task: TileTask, scratch: Path, renewal: _Renewal) -> None:
    """Store the rendered tile; a full disk or a store outage is waited out, the tile's and
    the device's leases renewed meanwhile: it costs time, never an attempt."""

    def keep() -> None:
        renewal.renew()
        renewal.check()

    key = tile_key(task.job_id, task.frame, task.index, task.attempt)
    retry_storage(lambda: ctx.storage.move_in(key, scratch), budget_s=ctx.settings.storage_retry_s,
                  what=f"tile {task.index} of frame {task.frame}", keep=keep)  # fmt: skip


def _tile_failed(
    ctx: WorkerContext,
    spec: JobSpec,
    task: TileTask,
    reason: str,
    counts: bool = True,
    error: BaseException | None = None,
) -> None:
    """Record the failed attempt under a reason the user may read, its short cause first
    (farm.failures); the whole story (error fields, Blender's log tail) goes to the operator's
    log and the tile's own log."""
    shown = redaction.public(reason, task.job_id)
    cause = shown
    if counts and error is not None:
        fields = error.fields if isinstance(error, FarmError) else {}
        code = error.code if isinstance(error, FarmError) else "internal"
        found = failures.classify(code, reason, fields, frame=task.frame,
                                  device=ctx.device_label,
                                  log_tail=fields.get("log_tail") or ())  # fmt: skip
        cause = redaction.public(found.cause, task.job_id)
        shown = failures.shown(cause, shown)
    if error is not None:
        _write_tile_log(ctx, task, reason, counts, error, cause)
    ctx.record(task, "failed" if counts else "requeued", cause=cause, logged=error is not None)
    outcome, next_attempt = ctx.store.fail_tile(task, shown, spec.max_attempts, counts)
    metrics.TILES_FAILED.labels(ctx.device.device_class, str(counts).lower()).inc()
    if counts:
        ctx.report.count("failed")
    if counts and outcome in ("retry", "failed"):
        _count_against_worker(ctx, spec, task)
    if outcome == "failed":
        metrics.observe_job_end(ctx.store, task.job_id)
    log.warning("event=tile_failed job=%s frame=%d tile=%d attempt=%d counts=%s outcome=%s "
                "reason=%r", task.job_id, task.frame, task.index, task.attempt, counts, outcome,
                reason)  # fmt: skip
    if outcome == "retry":
        retry = TileTask(task.job_id, task.frame, task.index, next_attempt)
        ctx.queue.stage_tiles([retry], spec.tile_timeout_s)
        ctx.store.confirm_pushed([retry])


def _count_against_worker(ctx: WorkerContext, spec: JobSpec, task: TileTask) -> None:
    """A counted failure counts against this worker for the job: at FARM_BLOCKLIST_FAILURES it
    takes no more of the job's tiles; when no live worker that may render them is left, the
    job says that it waits."""
    if not blocklist.record_failure(ctx.conn, task.job_id, ctx.name,
                                    ctx.settings.blocklist_failures,
                                    ctx.settings.job_retention_s):  # fmt: skip
        return
    log.warning("event=worker_blocklisted job=%s worker=%s failures=%d", task.job_id, ctx.name,
                ctx.settings.blocklist_failures)  # fmt: skip
    live = live_worker_names(ctx.queue.conn, spec.device)
    if blocklist.none_left(ctx.conn, task.job_id, spec.tags, live):
        blocklist.warn_waiting(ctx.conn, task.job_id)


def _write_tile_log(
    ctx: WorkerContext,
    task: TileTask,
    reason: str,
    counts: bool,
    error: BaseException,
    cause: str = "",
) -> None:
    """The attempt's failure in full, stored with the job (only its project reads it)."""
    fields = dict(error.fields) if isinstance(error, FarmError) else {}
    tail = fields.pop("log_tail", None) or []
    lines = [
        f"job {task.job_id} frame {task.frame} tile {task.index} attempt {task.attempt}",
        f"time {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} worker {ctx.name}",
        f"counts as a failure: {'yes' if counts else 'no'}",
        f"cause: {cause or reason}",
        f"reason: {reason}",
        f"error: {getattr(error, 'code', type(error).__name__)}: {error}",
        *(f"{key}: {value}" for key, value in sorted(fields.items())),
    ]
    if not isinstance(error, FarmError):
        lines += ["", *traceback.format_exception(error)]
    if tail:
        lines += ["", "Blender's log (last lines):", *tail]
    try:
        key = tile_log_key(task.job_id, task.frame, task.index, task.attempt)
        ctx.storage.put_bytes(key, ("\n".join(lines) + "\n").encode("utf-8"))
    except FarmError as exc:  # the log is a courtesy: never fail the failure over it
        log.warning("event=tile_log_failed job=%s error=%r", task.job_id, exc.message)


def _write_done_log(
    ctx: WorkerContext, task: TileTask, result: dict[str, Any], blender: list[str]
) -> bool:
    """The committed attempt's own log: its figures and Blender's lines while it rendered,
    stored with the job like a failed attempt's (only its project reads it)."""
    lines = [
        f"job {task.job_id} frame {task.frame} tile {task.index} attempt {task.attempt}",
        f"time {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} worker {ctx.name} "
        f"device {ctx.device_label}",
        "outcome: done",
        *(f"{k}: {result[k]}" for k in ("render_s", "peak_memory_mib", "samples", "passes",
                                         "device", "fallback") if result.get(k) is not None),
        "",
        "Blender's log (this attempt):",
        *blender,
    ]  # fmt: skip
    try:
        key = tile_log_key(task.job_id, task.frame, task.index, task.attempt)
        ctx.storage.put_bytes(key, ("\n".join(lines) + "\n").encode("utf-8"))
    except FarmError as exc:  # the log is a courtesy: never fail a rendered tile over it
        log.warning("event=tile_log_failed job=%s error=%r", task.job_id, exc.message)
        return False
    return True


def renew_leases_in(
    pipe: Any, allocator: SlotAllocator, store: JobStore, lease: Lease, task: TileTask
) -> Callable[[Sequence[Any]], tuple[Lease, bool]]:
    """A rendering tile's device lease and its own lease renewed on ``pipe`` (one round trip:
    the tile's own, or its worker's heartbeat's, ``CarriedRenewal``). The function returned
    reads the two replies: the renewed device lease (LeaseLost where it is gone) and whether
    the tile is still this attempt's. A tile whose device lease is lost is still touched by
    that round trip: its worker fails it at once, and were the worker to die first the sweep
    would find it one lease period later."""
    renewed = allocator.renew_in(pipe, lease)
    touched = store.touch_tile_in(pipe, task)
    return lambda replies: (renewed(replies[0]), touched(replies[1]))


def _record_failed(task: TileTask, exc: FarmError) -> None:
    log.warning("event=task_record_failed job=%s frame=%d tile=%d error=%r",
                task.job_id, task.frame, task.index, exc.message)  # fmt: skip


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended, for its record (``TaskRecords.ended``'s arguments)."""

    outcome: str
    now: float
    #: the attempt's start record, where the worker kept it (else it is read back)
    started: Attempt | None
    fields: dict[str, Any]


class _Ending:
    """The writes that end a tile on its device, in one round trip as it leaves the device
    (``end_writes``): the attempt's record (done, failed or requeued: ``WorkerContext.record``
    hands it here), the worker's return to idle on the workers page with the tile's counts,
    and the device lease's release. They were three round trips."""

    def __init__(self, ctx: WorkerContext, task: TileTask, lease: Lease) -> None:
        self.ctx, self.task, self.lease = ctx, task, lease
        #: the attempt's end, once it is known
        self.end: AttemptEnd | None = None

    def send(self) -> None:
        ctx = self.ctx
        end_writes(ctx.conn, ctx.records, ctx.report, ctx.allocator, self.lease, self.task,
                   self.end)  # fmt: skip


def rendering_shown(report: Reporter, task: TileTask, project: str) -> LeaseBeside:
    """The tile on the workers page (rendering, under its device lease), written with the
    lease's grant, in its round trip, and only where it was granted
    (``SlotAllocator.acquire``'s ``beside``)."""

    def shown(pipe: Any, lease_id: str) -> Callable[[Sequence[Any]], None]:
        return report.begin_in(pipe, keys.lease(lease_id), "rendering", task="tile",
                               job=task.job_id, project=project, frame=task.frame,
                               tile=task.index, lease=lease_id)  # fmt: skip

    return shown


def begin_writes(
    conn: Redis, store: JobStore, records: TaskRecords, report: Reporter, task: TileTask,
    worker: str, device: str, device_class: str, now: float,
) -> tuple[str, Attempt | None, bool]:  # fmt: skip
    """A tile's start, in one round trip: the job store's claim of the attempt, which writes
    the attempt's start record in the same step ('ok', the record; else why not, None), and
    whether an operator disabled the worker (False where Redis cannot say: the task was
    just taken from Redis, it goes on). Raises what ``JobStore.start_tile`` raises."""
    pipe = conn.pipeline(transaction=False)
    record, stored = records.start(task, worker, device, now, device_class)
    started = store.start_tile_in(pipe, task, stored)
    disabled = report.disabled_in(pipe)
    replies = guard(pipe.execute, raise_on_error=False)
    outcome = started(replies[0])
    # a reporter without a registry sends no read: then there is no reply for it
    return (
        outcome,
        record if outcome == "ok" else None,
        (disabled(replies[1]) if len(replies) > 1 else False),
    )


def end_writes(
    conn: Redis, records: TaskRecords, report: Reporter, allocator: SlotAllocator,
    lease: Lease, task: TileTask, end: AttemptEnd | None,
) -> None:  # fmt: skip
    """A tile's writes as it leaves its device, in one round trip: the attempt's end record
    (where ``end`` is known), the end of the worker's activity with its counts
    (``report.end_in``), the lease's release. A record or registry write that Redis refuses
    is logged (they inform); a release it refuses, or Redis away, raises as
    ``SlotAllocator.release`` does (the lease expires)."""
    pipe = conn.pipeline(transaction=False)
    wrote: Callable[[Any], None] | None = None
    if end is not None:
        try:
            wrote = records.ended_in(pipe, task, end.now, end.outcome, started=end.started,
                                     **end.fields)  # fmt: skip
        except FarmError as exc:  # its start had to be read back, and could not be
            _record_failed(task, exc)
    first = len(pipe)
    idle = report.end_in(pipe)
    last = len(pipe)
    released = allocator.release_in(pipe, lease)
    replies = guard(pipe.execute, raise_on_error=False)
    if wrote is not None:
        try:
            wrote(replies[0])
        except FarmError as exc:
            _record_failed(task, exc)
    idle(replies[first:last])
    released(replies[last])


class CarriedRenewal:
    """The rendering tile's renewal in the worker's heartbeat. The agent beats every
    ``interval_s`` (a third of its timeout), and that round trip carries the renewal of the
    tile on the device (its device lease and its own lease, ``renew_leases_in``): one round
    trip a beat instead of two. A tile whose lease the beats renew too seldom (a lease period
    shorter than the agent's) is not carried; one they stop renewing (a beat late or failing)
    renews on its own (``_Renewal``)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._renewal: _Renewal | None = None

    def carries(self, every_s: float) -> bool:
        """Whether a renewal needed every ``every_s`` can ride the beats."""
        return self.interval_s <= every_s

    def hold(self, renewal: _Renewal) -> None:
        with self._lock:
            self._renewal = renewal

    def drop(self, renewal: _Renewal) -> None:
        with self._lock:
            if self._renewal is renewal:
                self._renewal = None

    def beat_in(self, pipe: Any) -> Callable[[Sequence[Any]], None]:
        """The tile's renewal queued on the heartbeat's ``pipe`` (nothing when no tile
        renders); its reader never raises: a renewal Redis refused is logged, and the tile
        renews on its own if no later beat does."""
        with self._lock:
            renewal = self._renewal
        if renewal is None or renewal.lost is not None:
            return lambda _replies: None
        read = renewal.renew_in(pipe)

        def done(replies: Sequence[Any]) -> None:
            try:
                read(replies)
            except FarmError as exc:
                renewal.failed(exc)

        return done


class _Renewal:
    """Renews the tile and its device lease while the Blender child renders.

    Where the worker's heartbeat carries the renewal (``CarriedRenewal``), this renews only
    once its last renewal is ``CARRIED_SLACK`` periods old (the beats late or failing); else
    every period. When the lease is lost (a stream preempted it, or this process was paused
    past it) the render is cancelled at once, since its result could no longer be committed:
    the Blender child is killed, unless it has already finished (then it is kept, and the
    result dropped).
    """

    #: a carried renewal is renewed by its own thread only this many periods after the last:
    #: the beats come every period or sooner, so the thread renews only when they are late
    CARRIED_SLACK = 1.5

    def __init__(self, ctx: WorkerContext, task: TileTask, lease: Lease) -> None:
        self.ctx, self.task, self.lease = ctx, task, lease
        self.lost: str | None = None
        carried = ctx.carried
        self._carried = carried if carried is not None and carried.carries(self.every_s) else None
        #: how long after the last renewal this renews on its own
        self._own_every_s = self.every_s * (self.CARRIED_SLACK if self._carried else 1.0)
        self._lock = threading.Lock()
        self._renewed_s = time.monotonic()
        self._stopping = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tile-lease", daemon=True)

    @property
    def every_s(self) -> float:
        return min(self.ctx.store.tile_lease_s, self.ctx.allocator.ttl_ms / 1000) / 3

    @property
    def carried(self) -> bool:
        """Whether the worker's heartbeat renews this tile."""
        return self._carried is not None

    def __enter__(self) -> _Renewal:
        if self._carried is not None:
            self._carried.hold(self)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._carried is not None:
            self._carried.drop(self)
        self._stopping = True
        self._wake.set()
        self._thread.join()

    def check(self) -> None:
        """Raise LeaseLost once the lease is found lost (between live-preview passes)."""
        if self.lost is not None:
            raise LeaseLost(f"lease lost: {self.lost}")

    def renew(self) -> None:
        """Renew the device's lease and the tile's (``renew_leases_in``), and the tile's tag slots
        of limited tags (FARM_TAG_LIMITS), in one round trip; ``lost`` says why where either
        lease is gone. FarmError where Redis is away."""
        pipe = self.ctx.conn.pipeline(transaction=False)
        read = self.renew_in(pipe)
        read(guard(pipe.execute, raise_on_error=False))

    def renew_in(self, pipe: Any) -> Callable[[Sequence[Any]], None]:
        """``renew`` sent with ``pipe``; the function returned reads its replies, sets
        ``lost`` where a lease is gone and raises FarmError where Redis refused. The tile's
        tag slots go in the same round trip (a lost tile's are freed at its end anyway)."""
        ctx, task = self.ctx, self.task
        read = renew_leases_in(pipe, ctx.allocator, ctx.store, self.lease, task)
        tagslots.renew_in(pipe, ctx.conn, ctx.tag_limits, task.rq_id, ctx.store.tile_lease_s)

        def done(replies: Sequence[Any]) -> None:
            for refused in (r for r in replies[2:] if isinstance(r, Exception)):
                log.warning("event=tag_slot_renew_failed job=%s frame=%d tile=%d error=%r",
                            task.job_id, task.frame, task.index, str(refused))  # fmt: skip
            try:
                lease, ours = read(replies)
            except LeaseLost as exc:
                self._lose(str(exc.fields.get("why", exc.message)))
                return
            if not ours:
                self._lose("the tile was taken over")
                return
            with self._lock:
                self.lease, self._renewed_s = lease, time.monotonic()

        return done

    def failed(self, exc: FarmError) -> None:
        log.warning("event=renew_failed job=%s frame=%d tile=%d error=%r", self.task.job_id,
                    self.task.frame, self.task.index, exc.message)  # fmt: skip

    def _lose(self, why: str) -> None:
        self.lost = why
        self._wake.set()  # the thread cancels the render at once

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                wait_s = self._renewed_s + self._own_every_s - time.monotonic()
            if self.lost is None and wait_s > 0:
                self._wake.wait(wait_s)
                self._wake.clear()
                continue
            if self.lost is None:
                try:
                    self.renew()
                except FarmError as exc:
                    self.failed(exc)
                    self._wake.wait(self.every_s)
                    self._wake.clear()
                    continue
            if self.lost is not None:
                log.warning("event=lease_lost job=%s frame=%d tile=%d why=%r", self.task.job_id,
                            self.task.frame, self.task.index, self.lost)  # fmt: skip
                self.ctx.child.cancel(f"lease lost: {self.lost}")
                return


# --- frames ------------------------------------------------------------------------------------


def assemble_frame(job_id: str, frame: int, attempt: int = 1) -> None:
    """Stitch a frame's tiles, write the job's formats into its output folder, commit the frame.

    ``attempt`` is the assembly's lease token: renewed while it assembles, checked right before
    each file reaches the output. A storage outage is waited out (FARM_STORAGE_RETRY_S)."""
    ctx = context()
    if not ctx.store.claim_frame(job_id, frame, attempt):
        log.info("event=assembly_skipped job=%s frame=%d attempt=%d", job_id, frame, attempt)
        return
    spec = ctx.spec(job_id)
    try:
        with (
            ctx.report.activity("assembling", task="assembly", job=job_id, project=spec.project,
                                frame=frame),
            _FrameLease(ctx, job_id, frame, attempt) as lease,
        ):  # fmt: skip
            _assemble(ctx, spec, job_id, frame, lease)
    except LeaseLost as exc:
        # paused or cut off past the lease: another assembler has the frame; nothing written
        log.warning("event=assembly_fenced job=%s frame=%d attempt=%d why=%r", job_id, frame,
                    attempt, exc.message)  # fmt: skip
        return
    except FarmError as exc:
        log.warning("event=assembly_failed job=%s frame=%d error=%s message=%r fields=%r",
                    job_id, frame, exc.code, exc.message, exc.fields)  # fmt: skip
        found = failures.classify(exc.code, exc.message, exc.fields, frame=frame,
                                  device=ctx.device_label,
                                  log_tail=exc.fields.get("log_tail") or ())  # fmt: skip
        detail = failures.shown(found.cause, exc.message)
        reason = redaction.public(f"frame {frame} could not be assembled: {detail}", job_id)
        ctx.store.end_job(job_id, JobState.FAILED, reason)
        metrics.observe_job_end(ctx.store, job_id)
        return
    outcome = ctx.store.finish_frame(job_id, frame, attempt)
    if outcome == "ok":
        metrics.observe_job_end(ctx.store, job_id)
        _check_estimate(ctx, job_id, spec)
        # the job's last frame releases the jobs waiting for it: their tiles go out now
        dependencies.push_released(ctx.store, ctx.queue.conn)
    if outcome == "ok" and ctx.settings.tile_retention == "delete":
        # the MP4's preview stills stay with the job (a requeue rebuilds the MP4 from them)
        ctx.storage.delete_prefix(frame_tiles_key(job_id, frame))
    log.info("event=frame_done job=%s frame=%d commit=%s", job_id, frame, outcome)


def _check_estimate(ctx: WorkerContext, job_id: str, spec: JobSpec) -> None:
    """Once the job is done, check its estimate (if it had one) against its tasks' times."""
    try:
        if ctx.store.state(job_id) != JobState.DONE:
            return
        conn, rows = ctx.store.conn, ctx.records.rows(job_id)
        found = estimaterecords.record(conn, job_id, spec.project, rows, ctx.store.clock(),
                                       ctx.settings.estimate_errors_max)  # fmt: skip
    except FarmError as exc:  # the check informs; the job is done whatever happens here
        log.warning("event=estimate_check_failed job=%s error=%r", job_id, exc.message)
        return
    if found is not None:
        log.info("event=estimate_checked job=%s class=%s estimated_s=%s actual_s=%s error=%s",
                 job_id, found.device_class, found.estimated_s, found.actual_s,
                 found.error)  # fmt: skip


def _assemble(
    ctx: WorkerContext, spec: JobSpec, job_id: str, frame: int, lease: _FrameLease
) -> None:
    attempts = ctx.store.committed_attempts(job_id, frame, spec.tasks_per_frame)
    # tiles are read from the storage into, and the frame's files written to, a scratch folder;
    # the files then go to the job's output (folder or S3) through farm.delivery
    work = ctx.scratch / f"{job_id}-{frame}-assembly"
    ctx.child.writable(work)  # the (sandboxed) child writes the frame's files there
    try:
        outputs = [
            retry_storage(
                functools.partial(ctx.storage.fetch, tile_key(job_id, frame, i, a),
                                  work / f"tile-{i}.exr"),
                budget_s=ctx.settings.storage_retry_s, what=f"tile {i} of frame {frame}",
                keep=lease.check,
            )
            for i, a in enumerate(attempts)
        ]  # fmt: skip
        # stitch (or merge a sample split), denoise once, write the formats (workers.stillmodes)
        files, still = _frame_files(ctx, spec, job_id, frame, outputs, work)
        video = _keep_preview(ctx, spec, job_id, frame, still, work, keep=lease.check)
        if video is not None:
            files.append(video)
        retry_storage(
            lambda: delivery.deliver_frame(ctx.conn, ctx.settings, spec, job_id, frame, files,
                                           fence=lease.check),
            budget_s=ctx.settings.storage_retry_s, what=f"frame {frame}", keep=lease.check,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: times a frame's files are made again when the Blender child died making them (killed from
#: outside: out of memory on a busy host, an operator); a file that crashes it every time still
#: fails its job, saying so
ASSEMBLY_CRASH_RETRIES = 2


def _frame_files(
    ctx: WorkerContext, spec: JobSpec, job_id: str, frame: int, outputs: list[Path], work: Path
) -> tuple[list[Path], Path | None]:
    """``stillmodes.frame_files``, again with a fresh child where the child died meanwhile:
    the frame's tiles are all there, so a crash costs a conversion, never the job."""
    crashes = 0
    while True:
        try:
            return stillmodes.frame_files(spec, frame, outputs, ctx.child,
                                          ctx.prepare(spec.source, spec.project), work,
                                          ctx.settings.inspect_timeout_s)  # fmt: skip
        except BlenderCrashed as exc:
            crashes += 1
            if crashes > ASSEMBLY_CRASH_RETRIES:
                raise
            log.warning("event=assembly_child_crashed job=%s frame=%d crashes=%d error=%r",
                        job_id, frame, crashes, exc.message)  # fmt: skip


def _keep_preview(
    ctx: WorkerContext,
    spec: JobSpec,
    job_id: str,
    frame: int,
    still: Path | None,
    work: Path,
    *,
    keep: Callable[[], None],
) -> Path | None:
    """The frame's preview still kept in the farm's storage, and the animation's MP4 once every
    frame's is there (``stillmodes.animation_preview``): a full disk or a storage outage here is
    waited out as for the tiles and the frame's files, never a failed job."""
    return retry_storage(
        lambda: stillmodes.animation_preview(ctx.storage, spec, job_id, frame, still, work),
        budget_s=ctx.settings.storage_retry_s, what=f"the preview of frame {frame}", keep=keep,
    )  # fmt: skip


class _FrameLease:
    """An assembly's lease (its attempt), renewed while it assembles like a tile's.

    ``check`` asks Redis whether this attempt still holds the frame and raises LeaseLost when
    it does not: delivery runs it right before each file reaches the output."""

    def __init__(self, ctx: WorkerContext, job_id: str, frame: int, attempt: int) -> None:
        self.ctx, self.job_id, self.frame, self.attempt = ctx, job_id, frame, attempt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="frame-lease", daemon=True)

    def __enter__(self) -> _FrameLease:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def check(self) -> None:
        if self.ctx.store.frame_fenced(self.job_id, self.frame, self.attempt):
            raise LeaseLost(f"assembly attempt {self.attempt} of frame {self.frame} lost its "
                            "lease", job_id=self.job_id, frame=self.frame)  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self.ctx.store.tile_lease_s / 3):
            try:
                if not self.ctx.store.claim_frame(self.job_id, self.frame, self.attempt):
                    log.warning("event=assembly_lease_lost job=%s frame=%d attempt=%d",
                                self.job_id, self.frame, self.attempt)  # fmt: skip
                    return
            except FarmError as exc:  # Redis away for a moment: the next beat tries again
                log.warning("event=renew_failed job=%s frame=%d error=%r", self.job_id,
                            self.frame, exc.message)  # fmt: skip
