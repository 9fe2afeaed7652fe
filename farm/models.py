"""The wire contract: versioned dataclasses for jobs, tiles, inspection reports and events.

Web, CLI and workers all speak these; each carries ``v`` so a reader can refuse what it does
not understand instead of misreading it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from farm.errors import BadParameter
from farm.settings import Settings
from farm.tiling import TileGrid

SCHEMA_VERSION = 1

#: output format name -> (Blender file_format, colour depth, file extension)
OUTPUT_FORMATS: dict[str, tuple[str, str, str]] = {
    "exr": ("OPEN_EXR", "32", ".exr"),
    "png": ("PNG", "8", ".png"),
    "png16": ("PNG", "16", ".png"),
    "jpeg": ("JPEG", "8", ".jpg"),
}
DEFAULT_FORMATS = ("exr", "png")
#: how a still is split between workers: by tiles of the frame, or by runs of its samples
TILES = "tiles"
SAMPLE_SPLIT = "sample_split"
SPLIT_MODES = (TILES, SAMPLE_SPLIT)
#: largest image side Cycles is asked to render, in pixels
MAX_RESOLUTION = 65_536
MAX_SAMPLES = 1_000_000
#: bounds of a job's options (the API, the CLI and the embedded farm check the same ones)
#: the narrowest tile side, in pixels: finer grids cost more in per-tile overhead than they save
MIN_TILE_PX = 8
#: tiles (frames x tiles per frame, or sample-split parts) one job may queue, where the farm
#: sets no lower limit of its own (FARM_JOB_MAX_TILES)
MAX_JOB_TASKS = 100_000
#: attempts per tile a job may ask for
MAX_ATTEMPTS = 10
#: the longest a tile may be allowed to render, in seconds (7 days)
MAX_TILE_TIMEOUT_S = 7 * 24 * 3600.0
MIN_TILE_TIMEOUT_S = 0.1
#: a job name: 1 to 128 letters, digits, spaces and . , _ - + ( ) # @ & ' (no control
#: characters, slashes or markup: names are printed in terminals and pages)
MAX_NAME_CHARS = 128
JOB_NAME_RE = re.compile(rf"[\w .,+()#@&'-]{{1,{MAX_NAME_CHARS}}}")
#: a job's priority, either way of 0 (its default): waiting tiles of higher ones go first
MAX_PRIORITY = 1000
#: the widest tile overlap a request may ask for, in pixels
MAX_OVERLAP_PX = 1024
#: the most workers one still is sample-split between
MAX_SPLIT_PARTS = 64
#: the most jobs one job may wait for
MAX_DEPENDS_ON = 16


@dataclass(frozen=True)
class JobOption:
    """One option of a render job a client sets: a field of the API's job body and a flag of
    `farm submit` and `farm render`, with its default and, for a number, its bounds."""

    name: str
    #: the JSON types the API takes for it
    types: tuple[type, ...]
    help: str
    #: its value when not given (None: as saved in the file, or chosen by the farm)
    default: Any = None
    #: the farm setting (FARM_*) whose value stands in when the client gives none
    setting: str = ""
    #: the CLI's flag, where it is not ``--`` and the name with dashes
    flag: str = ""
    #: inclusive bounds of a number; ``label`` and ``unit`` are how a message names it
    low: float | None = None
    high: float | None = None
    label: str = ""
    unit: str = ""

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        """Refuse a number outside the bounds, the message giving them."""
        if self.low is None or self.high is None or value is None:
            return
        if not self.low <= value <= self.high:
            raise BadParameter(
                f"{self.label or self.name} must be {_number(self.low)} to "
                f"{_number(self.high)}{self.unit}, not {_number(value)}{self.unit}",
                field=self.name,
                low=self.low,
                high=self.high,
            )


def _number(x: float) -> str:
    return f"{x:.0f}" if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


#: Every option a client may set on a job, and only those: the API's job body takes exactly
#: these fields (plus where the file is) and the CLI exactly these flags. The one place their
#: defaults and bounds are declared; a field added to the job elsewhere is not public until
#: it is added here.
JOB_OPTIONS: dict[str, JobOption] = {
    o.name: o
    for o in (
        JobOption("frames", (str, int, list),
                  "frames to render, e.g. 1-10,20,30-40x2 (default: the scene's range)"),
        JobOption("tiles", (str,), "tile grid per frame, COLSxROWS", default="2x2"),
        JobOption("samples", (int,), "Cycles samples per pixel (default: as saved)",
                  low=1, high=MAX_SAMPLES, label="samples"),
        JobOption("resolution", (str,), "WIDTHxHEIGHT in pixels (default: as saved)"),
        JobOption("formats", (str, list), "output formats: exr, png, png16, jpeg",
                  default=",".join(DEFAULT_FORMATS)),
        JobOption("device", (str,), "render on cpu or gpu", default="cpu"),
        JobOption("overlap_px", (int,), "tile overlap in pixels (default 16 when the scene "
                  "samples adaptively)", flag="--overlap", low=0, high=MAX_OVERLAP_PX,
                  label="tile overlap", unit=" pixels"),
        JobOption("allow_missing", (bool,), "render even though external files are missing "
                  "(they render magenta)", default=False),
        JobOption("max_attempts", (int,), "attempts per tile before the job fails",
                  default=Settings.max_attempts, setting="max_attempts", low=1,
                  high=MAX_ATTEMPTS, label="max attempts"),
        JobOption("tile_timeout_s", (float,), "the longest one tile may render, in seconds",
                  default=Settings.tile_timeout_s, setting="tile_timeout_s",
                  flag="--tile-timeout", low=MIN_TILE_TIMEOUT_S, high=MAX_TILE_TIMEOUT_S,
                  label="tile timeout", unit=" s"),
        JobOption("name", (str,), "the job's name (default: the file's)"),
        JobOption("project", (str,), "the project the job belongs to", default="default"),
        JobOption("priority", (int,), "waiting tiles of a higher priority render first",
                  default=0, low=-MAX_PRIORITY, high=MAX_PRIORITY, label="priority"),
        JobOption("denoise", (bool,), "denoise each frame once after stitching or merging "
                  "(OpenImageDenoise)", default=False),
        JobOption("mode", (str,), "tiles: split a frame into tiles; sample_split (stills): "
                  "split its samples between workers", default=TILES),
        JobOption("split_parts", (int,), "parts of a sample split", default=2, flag="--split",
                  low=1, high=MAX_SPLIT_PARTS, label="a sample split", unit=" parts"),
        JobOption("passes", (bool,), "the EXR holds every view-layer pass and Cryptomatte "
                  "(multilayer)", default=False),
        JobOption("backend", (str,), "Cycles GPU backend: OPTIX, CUDA, HIP, ONEAPI, METAL "
                  "(default: the worker's best)"),
        JobOption("allow_cpu_fallback", (bool,), "a tile whose GPU or backend is unusable "
                  "renders on the CPU instead of failing", default=False),
        JobOption("preview", (bool,), "deliver an MP4 preview of an animation's frames",
                  default=True, flag="--no-preview"),
        JobOption("tags", (str, list), "tags a worker must all have to render the job, e.g. "
                  "big-ram,houdini (default: none, any worker of the device)"),
        JobOption("depends_on", (str, list), "ids of jobs of the same project this job waits "
                  f"for (at most {MAX_DEPENDS_ON}); it fails when one of them fails"),
        JobOption("frame_order", (str,), "sequential, or first-last-middle: those three frames "
                  "first, then the rest", default="sequential"),
        JobOption("live_preview", (bool,), "render each tile in sample passes (1, 4, 16, ... "
                  "samples) that the job page shows converging live", default=False),
    )
}  # fmt: skip


def default_of(name: str) -> Any:
    """The default of the job option ``name`` (the one declaration of it)."""
    return JOB_OPTIONS[name].default


def parse_formats(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))
    if not names:
        raise BadParameter("no output format given; choose from " + ", ".join(OUTPUT_FORMATS))
    for name in names:
        if name not in OUTPUT_FORMATS:
            raise BadParameter(
                f"output format {name!r} is not one of {', '.join(OUTPUT_FORMATS)}", format=name
            )
    # png and png16 would write the same file name
    if "png" in names and "png16" in names:
        raise BadParameter("choose one of png and png16")
    return names


def _check_version(data: dict[str, Any], what: str) -> None:
    v = data.get("v", SCHEMA_VERSION)
    if v != SCHEMA_VERSION:
        raise BadParameter(f"{what} has schema version {v}; this farm speaks {SCHEMA_VERSION}")


@dataclass(frozen=True)
class BlendSource:
    """Where a worker finds the .blend: a path on a shared/local disk, or an upload in storage."""

    kind: str  # "path" | "upload"
    location: str  # absolute path, or storage key of the upload
    sha256: str
    name: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BlendSource:
        return cls(**data)


@dataclass(frozen=True)
class JobSpec:
    """What a job renders and how; fixed when the job is accepted."""

    source: BlendSource
    frames: tuple[int, ...]
    tiles: str  # "CxR"
    width: int
    height: int
    output: str  # folder the frames are delivered to
    name: str = "job"
    samples: int | None = None
    overlap_px: int = 0
    formats: tuple[str, ...] = DEFAULT_FORMATS
    device: str = default_of("device")
    max_attempts: int = default_of("max_attempts")
    tile_timeout_s: float = default_of("tile_timeout_s")
    priority: int = default_of("priority")
    #: device memory a tile reserves, estimated at inspection (the worker applies its floor)
    vram_mib: int = 0
    #: the project the job belongs to: access, device-class policy and usage accounting
    project: str = default_of("project")
    #: denoise each frame once, after stitching or merging (OIDN on noisy colour, albedo, normal)
    denoise: bool = default_of("denoise")
    #: how a frame is split: "tiles" (the grid) or "sample_split" (split_parts workers each
    #: render the whole frame with a disjoint run of the samples, merged afterwards)
    mode: str = default_of("mode")
    #: 1 in tiles mode (the request's split_parts counts only for a sample split)
    split_parts: int = 1
    #: the exr output is a multilayer EXR of every view-layer pass (and Cryptomatte)
    passes: bool = default_of("passes")
    #: the Cycles GPU backend asked for (OPTIX, CUDA, HIP, ONEAPI, METAL); None: the worker's best
    backend: str | None = default_of("backend")
    #: a GPU tile whose GPU or backend is unusable renders on the CPU instead of failing
    allow_cpu_fallback: bool = default_of("allow_cpu_fallback")
    #: scene frame rate, for the video preview of an animation
    fps: float = 24.0
    #: deliver an H.264 MP4 of an animation's frames when they are all done
    preview: bool = default_of("preview")
    #: the scene composites: tasks render every pass, PNG/JPEG are the compositor's result
    compositor: bool = False
    #: the submitter's role in ``project``: each tile's lease asks the allocator as that role,
    #: so the project's device policy holds on every worker; empty for an operator's (CLI) job
    role: str = ""
    #: a worker renders the job's tiles only if it has every one of these tags (farm.tags)
    tags: tuple[str, ...] = ()
    #: jobs (same project) that must be done before this one's tiles are queued
    depends_on: tuple[str, ...] = ()
    #: "sequential" or "first-last-middle": the order the frames' tiles are queued in
    frame_order: str = default_of("frame_order")
    #: each tile renders in sample passes published as they land (farm.passschedule,
    #: farm.livepreview); adaptive sampling is off, as in a sample split
    live_preview: bool = default_of("live_preview")
    v: int = SCHEMA_VERSION

    @property
    def tasks_per_frame(self) -> int:
        """Render tasks per frame: tiles of the grid, or parts of the sample split."""
        if self.mode == SAMPLE_SPLIT:
            return self.split_parts
        return TileGrid.parse(self.tiles).count

    @property
    def layered(self) -> bool:
        """Whether tasks render multilayer EXRs (every pass) rather than plain RGBA."""
        return self.denoise or self.passes or self.compositor or self.mode == SAMPLE_SPLIT

    def to_json(self) -> str:
        data = asdict(self)
        data["frames"] = list(self.frames)
        data["formats"] = list(self.formats)
        data["tags"] = list(self.tags)
        data["depends_on"] = list(self.depends_on)
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        data = json.loads(text)
        _check_version(data, "job spec")
        data["source"] = BlendSource.from_dict(data["source"])
        data["frames"] = tuple(data["frames"])
        data["formats"] = tuple(data["formats"])
        data["tags"] = tuple(data.get("tags", ()))
        data["depends_on"] = tuple(data.get("depends_on", ()))
        return cls(**data)


@dataclass(frozen=True)
class TileTask:
    """The queue payload of one tile attempt; ``attempt`` fences out stale copies."""

    job_id: str
    frame: int
    index: int
    attempt: int

    @property
    def key(self) -> str:
        return tile_key(self.frame, self.index)

    @property
    def rq_id(self) -> str:
        return f"tile-{self.job_id}-{self.frame}-{self.index}-{self.attempt}"


def tile_key(frame: int, index: int) -> str:
    return f"{frame}:{index}"


@dataclass(frozen=True)
class InspectionReport:
    """What the Blender child found in a .blend, opened with scripts off."""

    path: str
    version: str
    scene: str
    engine: str
    frame_start: int
    frame_end: int
    frame_step: int
    fps: float
    width: int
    height: int
    samples: int
    adaptive_sampling: bool
    denoising: bool
    cameras: list[str]
    camera: str | None
    missing_files: list[str]
    libraries: list[str]
    autoexec_fail: bool
    autoexec_fail_message: str
    wants_scripts: bool
    scripts: list[str]
    #: coarse device memory the scene needs (geometry, textures, buffers); 0 when unknown
    vram_estimate_mib: int = 0
    #: the scene's final render runs a compositor node tree
    compositor: bool = False
    #: the estimate's probe renders, timed (farm.estimate.Probe), when inspection was asked
    #: for one; ``probe_error`` says why there is none where it failed
    probe: dict[str, Any] | None = None
    probe_error: str = ""
    v: int = SCHEMA_VERSION

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InspectionReport:
        _check_version(data, "inspection report")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def as_written(self, path: str) -> str:
        """``path`` (as the worker found it) the way the user wrote it in Blender.

        A file next to the .blend is shown relative to it (``//textures/a.png``): the farm's
        storage layout is nobody's business; any other path is the user's own absolute one.
        """
        folder = os.path.dirname(self.path)
        if folder and path.startswith(folder + os.sep):
            return "//" + os.path.relpath(path, folder)
        return path

    def missing_as_written(self) -> list[str]:
        return [self.as_written(p) for p in self.missing_files]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class JobStatus:
    """A job as read back from Redis: spec, state and counters."""

    id: str
    spec: JobSpec
    state: str
    reason: str
    created_s: float
    started_s: float | None
    finished_s: float | None
    tiles_total: int
    tiles_done: int
    tile_failures: int
    frames_total: int
    frames_done: int
    scripts_blocked: bool
    warnings: list[str] = field(default_factory=list)
    #: when a user archived it (hidden from the default jobs list, kept); None: not archived
    archived_s: float | None = None
    #: the estimate shown at submission (farm.estimate.Estimate as a dict); None: none
    estimate: dict[str, Any] | None = None
    #: the estimate against the done job's render times (farm.estimaterecords.Check)
    estimate_actual: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["spec"] = json.loads(self.spec.to_json())
        return data


@dataclass(frozen=True)
class Event:
    """One progress event of a job, as stored in its Redis stream (``type`` says which)."""

    type: str  # job_state | tile_state | frame_done | warning
    job_id: str
    ts: float
    state: str = ""
    frame: int | None = None
    tile: int | None = None
    attempt: int | None = None
    message: str = ""
    id: str = ""  # the stream entry id, set when read
    v: int = SCHEMA_VERSION

    def to_fields(self) -> dict[str, str]:
        data = {k: v for k, v in asdict(self).items() if v is not None and k != "id"}
        return {k: str(v) for k, v in data.items()}

    @classmethod
    def from_fields(cls, entry_id: str, fields: dict[str, str]) -> Event:
        def opt_int(name: str) -> int | None:
            return int(fields[name]) if name in fields else None

        return cls(
            type=fields["type"],
            job_id=fields["job_id"],
            ts=float(fields["ts"]),
            state=fields.get("state", ""),
            frame=opt_int("frame"),
            tile=opt_int("tile"),
            attempt=opt_int("attempt"),
            message=fields.get("message", ""),
            id=entry_id,
            v=int(fields.get("v", SCHEMA_VERSION)),
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class WebhookJob:
    """The job a webhook event is about, as it stood when the event happened."""

    id: str
    name: str
    state: str
    frames_done: int
    frames_total: int
    #: why it failed or was canceled (job.failed, job.canceled); empty otherwise
    reason: str = ""


@dataclass(frozen=True)
class WebhookEvent:
    """The JSON body of one webhook delivery (farm.webhooks; the README's Notifications)."""

    #: the delivery id, also in X-Tessera-Delivery: the same for every try of this delivery
    id: str
    #: job.submitted, frame.done, job.done, job.failed or job.canceled
    event: str
    #: when it happened (epoch s)
    ts: float
    project: str
    job: WebhookJob
    #: frame.done: the frame, and its delivered files (name, size, sha256)
    frame: int | None = None
    files: list[dict[str, Any]] | None = None
    v: int = SCHEMA_VERSION

    def to_json(self) -> str:
        data = {k: v for k, v in asdict(self).items() if v is not None}
        if not data["job"]["reason"]:
            del data["job"]["reason"]
        return json.dumps(data, separators=(",", ":"), sort_keys=True)
