"""Turning a user's render request and the file's inspection report into an accepted job."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from farm import cells, dependencies, keys
from farm.accounts import check_name
from farm.delivery import output_address
from farm.errors import (
    BadParameter,
    FarmError,
    MissingFiles,
    NoCamera,
    QueueError,
    error_class,
)
from farm.frames import FRAME_ORDERS, parse_frames
from farm.jobstore import JobStore
from farm.models import (
    JOB_NAME_RE,
    JOB_OPTIONS,
    MAX_DEPENDS_ON,
    MAX_JOB_TASKS,
    MAX_NAME_CHARS,
    MAX_RESOLUTION,
    MIN_TILE_PX,
    SAMPLE_SPLIT,
    SPLIT_MODES,
    BlendSource,
    InspectionReport,
    JobSpec,
    default_of,
    parse_formats,
)
from farm.queue import RenderQueue
from farm.redisclient import Redis, confirm_replicated, guard
from farm.settings import DEVICE_KINDS, GPU_BACKENDS, Settings
from farm.states import JobState
from farm.tags import parse_tags
from farm.tiling import TileGrid, plan_tiles

#: overlap used when the scene samples adaptively (pixels near a tile edge converge differently)
ADAPTIVE_OVERLAP_PX = 16


@dataclass(frozen=True)
class RenderRequest:
    """What the user asked for: the job options of ``farm.models.JOB_OPTIONS`` (their defaults
    declared there) and where the frames go; ``None`` means "as saved in the file"."""

    #: a folder, or a store URL (``s3://bucket/prefix``); the server's choice for web jobs
    output: Path | str
    frames: str | None = default_of("frames")
    tiles: str = default_of("tiles")
    samples: int | None = default_of("samples")
    resolution: str | None = default_of("resolution")
    formats: str = default_of("formats")
    device: str = default_of("device")
    overlap_px: int | None = default_of("overlap_px")
    allow_missing: bool = default_of("allow_missing")
    max_attempts: int = default_of("max_attempts")
    tile_timeout_s: float = default_of("tile_timeout_s")
    name: str | None = default_of("name")
    project: str = default_of("project")
    priority: int = default_of("priority")
    #: denoise each frame once after stitching or merging (OIDN; tiles are never denoised alone)
    denoise: bool = default_of("denoise")
    #: "tiles" or "sample_split" (see JobSpec.mode); split_parts workers for a sample split
    mode: str = default_of("mode")
    split_parts: int = default_of("split_parts")
    #: the exr output holds every view-layer pass and Cryptomatte (multilayer)
    passes: bool = default_of("passes")
    #: Cycles GPU backend (OPTIX, CUDA, HIP, ONEAPI, METAL); None lets the worker pick
    backend: str | None = default_of("backend")
    allow_cpu_fallback: bool = default_of("allow_cpu_fallback")
    #: an MP4 of an animation's frames is delivered next to them
    preview: bool = default_of("preview")
    #: comma-separated tags a worker must all have (farm.tags); None: none
    tags: str | None = default_of("tags")
    #: comma-separated ids of jobs of the same project to wait for; None: none
    depends_on: str | None = default_of("depends_on")
    #: "sequential" or "first-last-middle" (farm.frames.FRAME_ORDERS)
    frame_order: str = default_of("frame_order")
    #: tiles render in sample passes shown live on the job page (farm.passschedule)
    live_preview: bool = default_of("live_preview")


def request_from(
    values: Mapping[str, Any], output: Path | str, settings: Settings
) -> RenderRequest:
    """The request of the job options in ``values`` (an API body's fields, the CLI's flags;
    None: not given), each option not given at its default or the farm's setting.

    Only the options of ``JOB_OPTIONS`` are taken: anything else is refused by name."""
    unknown = sorted(set(values) - set(JOB_OPTIONS))
    if unknown:
        raise BadParameter(
            f"unknown job option(s): {', '.join(unknown)}; known: {', '.join(JOB_OPTIONS)}",
            fields=unknown,
        )
    fields: dict[str, Any] = {}
    for name, option in JOB_OPTIONS.items():
        value = values.get(name)
        if value is None:
            value = getattr(settings, option.setting) if option.setting else option.default
        elif isinstance(value, list):
            if not all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in value):
                raise BadParameter(f"field {name!r} must list strings or integers", field=name)
            value = ",".join(str(i) for i in value)
        elif name == "frames" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        fields[name] = value
    # the CLI spells it sample-split, the API sample_split
    fields["mode"] = str(fields["mode"]).replace("-", "_")
    return RenderRequest(output=output, **fields)


def parse_resolution(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise BadParameter(f"resolution {text!r} is not WIDTHxHEIGHT, for example 1920x1080")
    width, height = int(m.group(1)), int(m.group(2))
    for side in (width, height):
        if not 1 <= side <= MAX_RESOLUTION:
            raise BadParameter(
                f"resolution {width}x{height}: each side must be 1 to {MAX_RESOLUTION} pixels"
            )
    return width, height


def check_request(req: RenderRequest) -> None:
    """Every check that needs no Blender: run before anything is started or queued."""
    for option in JOB_OPTIONS.values():
        option.check(getattr(req, option.name))
    if req.frames is not None:
        parse_frames(req.frames)
    TileGrid.parse(req.tiles)
    if req.resolution is not None:
        width, height = parse_resolution(req.resolution)
        plan_tiles(width, height, TileGrid.parse(req.tiles))
        if req.mode != SAMPLE_SPLIT:
            check_tile_size(width, height, TileGrid.parse(req.tiles))
    parse_formats(req.formats)
    if req.device not in DEVICE_KINDS:
        raise BadParameter(f"device {req.device!r} is not one of {', '.join(DEVICE_KINDS)}")
    if req.name is not None:
        check_job_name(req.name)
    check_name("project", req.project)
    _check_modes(req)
    parse_tags(req.tags or "")
    parse_depends_on(req.depends_on or "")
    if req.frame_order not in FRAME_ORDERS:
        raise BadParameter(
            f"frame order {req.frame_order!r} is not one of {', '.join(FRAME_ORDERS)}",
            field="frame_order",
        )


#: a job id as farm.jobstore makes them (checked before any lookup)
JOB_ID_RE = cells.JOB_ID_RE


def parse_depends_on(text: str) -> tuple[str, ...]:
    """The job ids of a comma-separated list, once each, in the order given; at most
    MAX_DEPENDS_ON. Whether they exist in the project is ``accept``'s check."""
    ids = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    for job_id in ids:
        if not JOB_ID_RE.fullmatch(job_id):
            raise BadParameter(f"depends_on: {job_id[:40]!r} is not a job id (like "
                               "20261201-120000-0123abcd)", field="depends_on")  # fmt: skip
    if len(ids) > MAX_DEPENDS_ON:
        raise BadParameter(f"depends_on: a job may wait for at most {MAX_DEPENDS_ON} jobs, "
                           f"not {len(ids)}", field="depends_on")  # fmt: skip
    return ids


def check_job_name(name: str) -> str:
    if not JOB_NAME_RE.fullmatch(name):
        raise BadParameter(
            f"job name {name[:40]!r} must be 1 to {MAX_NAME_CHARS} letters, digits, spaces or "
            ". , _ - + ( ) # @ & '",
            field="name",
        )
    return name


def name_from_file(file_name: str) -> str:
    """A job name from an upload's file name: its stem, other characters made ``_``."""
    stem = Path(file_name).stem
    clean = "".join(c if JOB_NAME_RE.fullmatch(c) else "_" for c in stem)[:MAX_NAME_CHARS]
    return clean or "job"


def check_tile_size(width: int, height: int, grid: TileGrid) -> None:
    """Every tile at least MIN_TILE_PX on each side (smaller tiles cost more than they save)."""
    tile_w, tile_h = width // grid.cols, height // grid.rows
    if min(tile_w, tile_h) < MIN_TILE_PX:
        raise BadParameter(
            f"tile grid {grid} cuts the {width}x{height} image into tiles of {tile_w}x{tile_h} "
            f"pixels; tiles must be at least {MIN_TILE_PX} pixels on each side: ask for fewer "
            "tiles",
            field="tiles",
            min_tile_px=MIN_TILE_PX,
        )


def check_task_count(frames: int, per_frame: int, max_tasks: int) -> None:
    """A job queues frames x tiles per frame tasks; at most ``max_tasks``."""
    if frames * per_frame > max_tasks:
        raise BadParameter(
            f"the job would queue {frames} frame(s) x {per_frame} tile(s) = "
            f"{frames * per_frame} tiles; a job may have at most {max_tasks}: render fewer "
            "frames or fewer tiles per frame",
            limit="tiles_per_job",
            allowed=max_tasks,
        )


def _check_modes(req: RenderRequest) -> None:
    if req.mode not in SPLIT_MODES:
        raise BadParameter(f"mode {req.mode!r} is not one of {', '.join(SPLIT_MODES)}")
    if req.mode == SAMPLE_SPLIT:
        if req.frames is not None and len(parse_frames(req.frames)) != 1:
            raise BadParameter("sample split is for stills: give one frame (--frames N)")
        if req.samples is not None and req.samples < req.split_parts:
            raise BadParameter(f"cannot split {req.samples} sample(s) into {req.split_parts} parts")
    if req.live_preview and req.mode == SAMPLE_SPLIT:
        raise BadParameter(
            "a live preview renders tiles in sample passes: choose tiles mode, not a sample split"
        )
    if req.passes and "exr" not in parse_formats(req.formats):
        raise BadParameter("--passes writes a multilayer EXR: add exr to the formats")
    if req.backend is not None:
        if req.backend.upper() not in GPU_BACKENDS:
            raise BadParameter(
                f"GPU backend {req.backend!r} is not one of {', '.join(GPU_BACKENDS)}"
            )
        if req.device != "gpu":
            raise BadParameter(f"a GPU backend ({req.backend}) needs device gpu, not {req.device}")


def plan_job(
    req: RenderRequest,
    report: InspectionReport,
    source: BlendSource,
    max_tasks: int = MAX_JOB_TASKS,
) -> tuple[JobSpec, list[str]]:
    """The job to queue, and warnings for the user; raises when the file cannot render right
    or would queue more than ``max_tasks`` tiles."""
    check_request(req)
    if report.camera is None:
        hint = (
            f"it has cameras ({', '.join(report.cameras)}) but none is active"
            if report.cameras
            else "add a camera"
        )
        raise NoCamera(f"scene {report.scene!r} has no active camera: {hint}", scene=report.scene)
    if report.missing_files and not req.allow_missing:
        missing = report.missing_as_written()
        shown = ", ".join(missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise MissingFiles(
            f"{len(missing)} external file(s) the scene needs are missing: {shown}{more}",
            paths=missing,
        )
    frames = parse_frames(
        req.frames or f"{report.frame_start}-{report.frame_end}x{max(1, report.frame_step)}"
    )
    width, height = (
        parse_resolution(req.resolution) if req.resolution else (report.width, report.height)
    )
    grid = TileGrid.parse(req.tiles)
    overlap = req.overlap_px
    if overlap is None:
        overlap = ADAPTIVE_OVERLAP_PX if report.adaptive_sampling and grid.count > 1 else 0
    plan_tiles(width, height, grid, overlap)
    samples = req.samples
    if req.mode == SAMPLE_SPLIT:
        if len(frames) != 1:
            raise BadParameter(
                f"sample split is for stills; the scene has {len(frames)} frames: give --frames N"
            )
        # every part must know the total it is a share of
        samples = samples or report.samples
        if samples < req.split_parts:
            raise BadParameter(f"cannot split {samples} sample(s) into {req.split_parts} parts")
        grid, overlap = TileGrid.of(1, 1), 0
        check_task_count(len(frames), req.split_parts, max_tasks)
    else:
        check_tile_size(width, height, grid)
        check_task_count(len(frames), grid.count, max_tasks)
        if req.live_preview:
            # every pass must know the total it is a run of (farm.passschedule)
            samples = samples or report.samples

    warnings = []
    if report.engine != "CYCLES":
        warnings.append(f"the scene is set to {report.engine}; the farm renders it with Cycles")
    if report.denoising and not req.denoise:
        warnings.append(
            "the file asks for denoising, the job does not: ask for denoising (farm --denoise, "
            'or "denoise": true in the API) to denoise each frame once after stitching'
        )
    if req.mode == SAMPLE_SPLIT and report.adaptive_sampling:
        warnings.append(
            "adaptive sampling is off in a sample split (each part renders all its samples)"
        )
    if req.live_preview and report.adaptive_sampling:
        warnings.append(
            "adaptive sampling is off in a live preview (each pass renders all its samples)"
        )
    if report.wants_scripts:
        what = "; ".join(report.scripts) or report.autoexec_fail_message
        warnings.append(f"the file wanted to run Python and was not allowed to: {what}")
    if report.missing_files:
        warnings.append(f"rendering without {len(report.missing_files)} missing file(s)")
    if report.compositor:
        warnings.append(
            "the scene composites: tiles render every pass, and PNG/JPEG are the compositor's "
            "result made from the stitched frame"
        )

    spec = JobSpec(
        source=source,
        frames=tuple(frames),
        tiles=str(grid),
        width=width,
        height=height,
        output=output_address(req.output),
        name=req.name or name_from_file(source.name),
        samples=samples,
        overlap_px=overlap,
        formats=parse_formats(req.formats),
        device=req.device,
        max_attempts=req.max_attempts,
        tile_timeout_s=req.tile_timeout_s,
        priority=req.priority,
        vram_mib=report.vram_estimate_mib,
        project=req.project,
        denoise=req.denoise,
        mode=req.mode,
        split_parts=req.split_parts if req.mode == SAMPLE_SPLIT else 1,
        passes=req.passes,
        backend=req.backend.upper() if req.backend else None,
        allow_cpu_fallback=req.allow_cpu_fallback,
        fps=report.fps,
        preview=req.preview,
        # the compositor reads passes beyond Combined: every tile renders them all
        compositor=report.compositor,
        tags=parse_tags(req.tags or ""),
        depends_on=parse_depends_on(req.depends_on or ""),
        frame_order=req.frame_order,
        live_preview=req.live_preview,
    )
    return spec, warnings


def inspect(
    conn: Redis,
    queue: RenderQueue,
    source: BlendSource,
    timeout_s: float,
    on_wait: Callable[[], None] | None = None,
    *,
    project: str,
    probe: bool = False,
) -> InspectionReport:
    """Ask a worker of ``queue`` to inspect the file for ``project`` (its Blender child is
    never one another project's file has been in); waits at most ``timeout_s`` for its answer.

    ``on_wait`` runs about once a second while waiting (the embedded farm checks its workers).
    ``probe``: the report carries the estimate's probe too (farm.estimate); the worker may
    then take ``timeout_s`` for the probe on top of the opening (its own bound, in the child).
    """
    if probe:
        timeout_s *= 2
    reply_key = keys.reply(uuid.uuid4().hex)
    rq_id = queue.enqueue_inspection(source, reply_key, timeout_s, project, probe)
    deadline = time.monotonic() + timeout_s
    popped = None
    while popped is None and time.monotonic() < deadline:
        popped = guard(conn.blpop, [reply_key], timeout=1)
        if popped is None and on_wait is not None:
            on_wait()
    if popped is None:
        # no one waits for it any more: a worker that comes later must not find it queued
        queue.drop_waiting(rq_id)
        raise QueueError(
            f"no {queue.device_class} worker answered within {timeout_s:.0f} s; "
            f"start one with `farm worker --device {queue.device_class}`"
        )
    reply: dict[str, Any] = json.loads(popped[1])
    if not reply["ok"]:
        raise _error_from(reply)
    return InspectionReport.from_dict(reply["report"])


def _error_from(reply: dict[str, Any]) -> FarmError:
    fields = {k: v for k, v in reply.items() if k not in ("ok", "error", "message")}
    cls = error_class(str(reply.get("error", "")))
    return cls(reply.get("message", "the worker failed"), **fields)


#: times a job's transaction is written when a failover loses it before a replica has it
WRITE_ATTEMPTS = 3


def submit(
    rq_conn: Redis,
    store: JobStore,
    queue: RenderQueue,
    spec: JobSpec,
    warnings: list[str],
    scripts_blocked: bool,
) -> str:
    """Create the job, its tiles, its place in its project's index and its priority's band of
    the queue in one transaction (MULTI/EXEC); returns the job id. Clients call ``accept``.

    Behind Sentinels the job is accepted only once a replica holds it: a transaction the
    primary took and lost in a failover is written again (to the promoted replica), one no
    replica confirms is canceled and refused (QueueError)."""
    job_id = store.new_job_id()
    for _ in range(WRITE_ATTEMPTS):
        with rq_conn.pipeline(transaction=True) as pipe:
            tasks = store.stage_job(pipe, job_id, spec, warnings, scripts_blocked)
            if spec.depends_on:
                # waits, its tiles pushed once its dependencies are done (farm.dependencies)
                dependencies.link(rq_conn, pipe, job_id, store.clock())
            else:
                # straight into its priority's band: nothing waiting is reordered
                ordered = dependencies.in_queue_order(spec, tasks)
                queue.stage_tiles(ordered, spec.tile_timeout_s, pipeline=pipe,
                                  priority=spec.priority, tags=spec.tags)  # fmt: skip
            guard(pipe.execute)
        try:
            if confirm_replicated(rq_conn, keys.job(job_id)):
                if spec.depends_on:
                    # all done already: released in the transaction, pushed now
                    dependencies.push_released(store, rq_conn)
                return job_id
        except QueueError:
            # not accepted, so it must not run either (best effort: were the cancel lost as
            # well, the job renders though its submission was refused; nothing is lost)
            store.end_job(job_id, JobState.CANCELED, "no Redis replica confirmed the job")
            raise
    raise QueueError(f"job {job_id} was lost in Redis failovers {WRITE_ATTEMPTS} times")
