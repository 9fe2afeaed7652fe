"""The render worker's tasks, run by rq in the worker: inspect, render a tile, assemble a frame."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from farm import keys
from farm.devices import Device
from farm.errors import FarmError, LeaseLost, NoCapacity, RenderError
from farm.jobstore import JobStore
from farm.models import OUTPUT_FORMATS, BlendSource, JobSpec, TileTask
from farm.queue import RenderQueue
from farm.redisclient import Redis
from farm.settings import Settings
from farm.slots import Lease, Request, SlotAllocator
from farm.states import JobState
from farm.storage import LocalStorage, frame_file_name, frame_tiles_key, place_file, tile_key
from farm.tiling import TileGrid, TilePlan, plan_tiles
from workers import exr
from workers.child import BlenderChild
from workers.stitching import stitch

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
    storage: LocalStorage
    child: BlenderChild
    allocator: SlotAllocator
    #: the device this worker is bound to (its render leases are taken there)
    device: Device
    specs: dict[str, JobSpec] = field(default_factory=dict)

    @property
    def scratch(self) -> Path:
        path = self.settings.work_dir / self.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def spec(self, job_id: str) -> JobSpec:
        if job_id not in self.specs:
            self.specs[job_id] = self.store.spec(job_id)
        return self.specs[job_id]

    def blend_path(self, source: BlendSource) -> Path:
        if source.kind == "path":
            path = Path(source.location)
        else:
            path = self.storage.path(source.location)
        if not path.is_file():
            raise RenderError(f"{source.name} is not readable on worker {self.name}: {path}")
        return path

    def sweep(self) -> None:
        """Requeue work whose worker vanished: tiles not renewed, frames not assembled."""
        for job_id in self.store.active_job_ids():
            spec = self.spec(job_id)
            found = self.store.recover(job_id, spec.max_attempts)
            lost = self.queue.missing(self.store.queued_tasks(job_id))
            for t in found.tiles:
                log.warning(
                    "event=tile_requeued job=%s frame=%d tile=%d attempt=%d reason=worker_lost",
                    job_id,
                    t.frame,
                    t.index,
                    t.attempt,
                )
            self.queue.stage_tiles([*found.tiles, *lost], spec.tile_timeout_s)
            for frame in found.frames:
                self.queue.enqueue_assembly(job_id, frame, spec.tile_timeout_s)


_context: WorkerContext | None = None


def install(ctx: WorkerContext) -> None:
    global _context
    _context = ctx


def context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("tasks run only inside a worker that installed its context")
    return _context


# --- inspection ------------------------------------------------------------------------------


def inspect_blend(source: dict[str, Any], reply_key: str) -> None:
    """Open the .blend with scripts off and push the report (or the error) onto ``reply_key``."""
    ctx = context()
    src = BlendSource.from_dict(source)
    try:
        report = ctx.child.inspect(ctx.blend_path(src), ctx.settings.inspect_timeout_s)
        reply: dict[str, Any] = {"ok": True, "report": report}
    except FarmError as exc:
        reply = {"ok": False, **exc.to_dict()}
    pipe = ctx.conn.pipeline()
    pipe.lpush(reply_key, json.dumps(reply))
    pipe.expire(reply_key, 600)
    pipe.execute()


# --- tiles -------------------------------------------------------------------------------------


def render_tile(job_id: str, frame: int, index: int, attempt: int) -> None:
    ctx = context()
    task = TileTask(job_id, frame, index, attempt)
    started = ctx.store.start_tile(task)
    if started != "ok":
        log.info("event=tile_skipped job=%s frame=%d tile=%d attempt=%d why=%s",
                 job_id, frame, index, attempt, started)  # fmt: skip
        return
    spec = ctx.spec(job_id)
    try:
        lease = ctx.allocator.acquire(ctx.name, _render_request(ctx, spec), wait_s=LEASE_WAIT_S)
    except NoCapacity as exc:
        _tile_failed(ctx, spec, task, exc.message, counts=False)
        return
    except FarmError as exc:
        _tile_failed(ctx, spec, task, exc.message)
        return
    try:
        _render_leased(ctx, spec, task, lease)
    finally:
        ctx.allocator.release(lease)


def _render_request(ctx: WorkerContext, spec: JobSpec) -> Request:
    # device memory (on the CPU device: host memory) the render reserves: the scene's estimate
    # from inspection, never below the configured floor, never above the device
    wanted = max(spec.vram_mib, ctx.settings.render_vram_floor_mib)
    return Request(
        "render",
        vram_mib=min(wanted, ctx.device.vram_mib),
        render_slots=1,
        device_ids=(ctx.device.id,),
    )


def _render_leased(ctx: WorkerContext, spec: JobSpec, task: TileTask, lease: Lease) -> None:
    grid = TileGrid.parse(spec.tiles)
    plan = plan_tiles(spec.width, spec.height, grid, spec.overlap_px)[task.index]
    scratch = ctx.scratch / f"{task.job_id}-{task.frame}-{task.index}-{task.attempt}.exr"
    t0 = time.monotonic()
    renewal = _Renewal(ctx, task, lease)
    try:
        with renewal:
            result = ctx.child.render(
                ctx.blend_path(spec.source),
                frame=task.frame,
                width=spec.width,
                height=spec.height,
                rect=None if _whole(plan, spec) else plan.render,
                samples=spec.samples,
                out_path=scratch,
                timeout_s=spec.tile_timeout_s,
            )
        ctx.storage.put(tile_key(task.job_id, task.frame, task.index, task.attempt), scratch,
                        move=True)  # fmt: skip
    except FarmError as exc:
        scratch.unlink(missing_ok=True)
        if renewal.lost is not None:
            # preempted or paused past the lease: not the tile's fault
            _tile_failed(ctx, spec, task, f"lease lost: {renewal.lost}", counts=False)
        else:
            _tile_failed(ctx, spec, task, exc.message)
        return
    except Exception as exc:
        scratch.unlink(missing_ok=True)
        _tile_failed(ctx, spec, task, f"internal error: {exc!r}")
        raise
    if result.get("autoexec_fail"):
        ctx.conn.hset(keys.job(task.job_id), "scripts_blocked", 1)
    outcome = ctx.store.finish_tile(task, grid.count, lease.id, lease.token)
    if outcome == "fenced":
        _tile_failed(ctx, spec, task, "lease lost before the commit", counts=False)
    log.info("event=tile_done job=%s frame=%d tile=%d attempt=%d render_s=%.3f total_s=%.3f "
             "commit=%s device=%s token=%d", task.job_id, task.frame, task.index, task.attempt,
             result.get("render_s", 0.0), time.monotonic() - t0, outcome, lease.device,
             lease.token)  # fmt: skip
    if outcome == "frame_ready":
        ctx.queue.enqueue_assembly(task.job_id, task.frame, spec.tile_timeout_s)


def _whole(plan: TilePlan, spec: JobSpec) -> bool:
    r = plan.render
    return (r.x0, r.y0, r.x1, r.y1) == (0, 0, spec.width, spec.height)


def _tile_failed(
    ctx: WorkerContext, spec: JobSpec, task: TileTask, reason: str, counts: bool = True
) -> None:
    outcome, next_attempt = ctx.store.fail_tile(task, reason, spec.max_attempts, counts)
    log.warning("event=tile_failed job=%s frame=%d tile=%d attempt=%d counts=%s outcome=%s "
                "reason=%r", task.job_id, task.frame, task.index, task.attempt, counts, outcome,
                reason)  # fmt: skip
    if outcome == "retry":
        retry = TileTask(task.job_id, task.frame, task.index, next_attempt)
        ctx.queue.stage_tiles([retry], spec.tile_timeout_s)


class _Renewal:
    """Renews the tile and its device lease while the Blender child renders.

    When the lease is lost (a stream preempted it, or this process was paused past it) the
    Blender child is killed at once: the tile's result could no longer be committed.
    """

    def __init__(self, ctx: WorkerContext, task: TileTask, lease: Lease) -> None:
        self.ctx, self.task, self.lease = ctx, task, lease
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tile-lease", daemon=True)

    @property
    def every_s(self) -> float:
        return min(self.ctx.store.tile_lease_s, self.ctx.allocator.ttl_ms / 1000) / 3

    def __enter__(self) -> _Renewal:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.lease = self.ctx.allocator.renew(self.lease)
                if not self.ctx.store.touch_tile(self.task):
                    self.lost = "the tile was taken over"
            except LeaseLost as exc:
                self.lost = str(exc.fields.get("why", exc.message))
            except FarmError as exc:
                log.warning(
                    "event=renew_failed job=%s frame=%d tile=%d error=%r",
                    self.task.job_id,
                    self.task.frame,
                    self.task.index,
                    exc.message,
                )
                continue
            if self.lost is not None:
                log.warning("event=lease_lost job=%s frame=%d tile=%d why=%r", self.task.job_id,
                            self.task.frame, self.task.index, self.lost)  # fmt: skip
                self.ctx.child.kill()
                return


# --- frames ------------------------------------------------------------------------------------


def assemble_frame(job_id: str, frame: int) -> None:
    """Stitch a frame's tiles, write the job's formats into its output folder, commit the frame."""
    ctx = context()
    if not ctx.store.claim_frame(job_id, frame):
        return
    spec = ctx.spec(job_id)
    try:
        _assemble(ctx, spec, job_id, frame)
    except FarmError as exc:
        ctx.store.end_job(
            job_id, JobState.FAILED, f"frame {frame} could not be assembled: {exc.message}"
        )
        return
    outcome = ctx.store.finish_frame(job_id, frame)
    if outcome == "ok":
        ctx.storage.remove_tree(frame_tiles_key(job_id, frame))
    log.info("event=frame_done job=%s frame=%d commit=%s", job_id, frame, outcome)


def _assemble(ctx: WorkerContext, spec: JobSpec, job_id: str, frame: int) -> None:
    plans = plan_tiles(spec.width, spec.height, TileGrid.parse(spec.tiles), spec.overlap_px)
    attempts = ctx.store.committed_attempts(job_id, frame, len(plans))
    tiles = [
        (p, exr.read_rgba(ctx.storage.path(tile_key(job_id, frame, p.index, a))))
        for p, a in zip(plans, attempts, strict=True)
    ]
    image = stitch(spec.width, spec.height, tiles)
    out_dir = Path(spec.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    stitched = ctx.scratch / f"{job_id}-{frame}-stitched.exr"
    exr.write_rgba(stitched, image)
    try:
        conversions = []
        for name in spec.formats:
            file_format, depth, ext = OUTPUT_FORMATS[name]
            dest = out_dir / frame_file_name(frame, ext)
            if name == "exr":
                place_file(stitched, dest)
            else:
                conversions.append(
                    {"path": str(dest), "format": file_format, "color_depth": depth, "quality": 90}
                )
        if conversions:
            ctx.child.convert(
                ctx.blend_path(spec.source), stitched, conversions, ctx.settings.inspect_timeout_s
            )
    finally:
        stitched.unlink(missing_ok=True)
