"""One seeded chaos run: build the farm, submit jobs through ``accept``, inject faults at random
moments, then check every promise from outside and report a table and one JSON line."""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import boto3
import numpy as np
import numpy.typing as npt

from farm import jobstore, keys, queue
from farm.accept import accept
from farm.models import Event
from farm.settings import Settings
from farm.storage.local import LocalStorage
from farm.submission import RenderRequest
from tests.blendscenes import make_scene
from tests.chaos.farm import ChaosFarm
from tests.chaos.faults import INJECT, KINDS, Injected, Timing
from tests.chaos.inotify import WriteCounter
from tests.farmprocs import until
from tests.s3server import CREDENTIALS
from workers import exr
from workers.child import BlenderChild

ENDED = ("done", "failed", "canceled")
WIDTH, HEIGHT = 67, 41
BUCKET = "chaos"
#: a spot stop's grace: short, so that a SIGTERM mostly lands on a tile it must abandon
STOP_GRACE_S = 1.0


@dataclass
class Plan:
    seed: int
    jobs: int
    faults: int
    duration_s: float
    workers: int = 3
    frames: int = 3
    samples: int = 500
    lease_ttl_s: float = 2.0
    retention_s: float = 6.0
    s3_timeout_s: float = 1.5
    #: kinds drawn from (all by default); the short run may name fewer
    kinds: tuple[str, ...] = KINDS


@dataclass
class JobRecord:
    id: str
    output: str
    folder: Path | None
    status: Any = None
    tiles: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


@dataclass
class Result:
    plan: Plan
    isolated: bool
    network_note: str
    injected: list[Injected] = field(default_factory=list)
    jobs: list[JobRecord] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    table: list[tuple[str, int, int, int, int, str]] = field(default_factory=list)
    requeues: list[str] = field(default_factory=list)


def schedule(plan: Plan, rng: random.Random, unavailable: set[str]) -> list[tuple[float, str]]:
    """(offset s, "job" or a fault kind), sorted: the first job at once, the others in the
    first 60 % of the run; faults over the whole run, every kind before any repeats."""
    kinds = [k for k in plan.kinds if k not in unavailable]
    drawn: list[str] = []
    while len(drawn) < plan.faults:
        round_ = kinds[:]
        rng.shuffle(round_)
        drawn += round_
    events = [(0.0, "job")]
    events += [(rng.uniform(0, plan.duration_s * 0.6), "job") for _ in range(plan.jobs - 1)]
    events += [(rng.uniform(1.0, plan.duration_s), kind) for kind in drawn[: plan.faults]]
    return sorted(events)


def run(plan: Plan, root: Path, out: TextIO = sys.stdout) -> Result:
    t_start = time.monotonic()
    rng = random.Random(plan.seed)
    run_id = secrets.token_hex(2)
    env = {
        "FARM_LEASE_TTL_S": str(plan.lease_ttl_s),
        "FARM_STOP_GRACE_S": str(STOP_GRACE_S),
        "FARM_CPU_THREADS": "1",
        "FARM_STORAGE_RETRY_S": "300",
        "FARM_JOB_RETENTION_S": str(plan.retention_s),
        "FARM_USAGE_RAW_RETENTION_S": str(plan.retention_s),
        "FARM_S3_TIMEOUT_S": str(plan.s3_timeout_s),
        "FARM_S3_MAX_ATTEMPTS": "2",
    }
    farm = ChaosFarm(root, run_id, plan.workers, env)
    # the driver's own boto3 (accept's output check, reading frames back) talks to moto too
    saved = {name: os.environ.get(name) for name in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    print(f"chaos: seed={plan.seed} run={run_id} root={root}", file=out, flush=True)
    result: Result | None = None
    try:
        scene = make_scene(root / "scene.blend", width=WIDTH, height=HEIGHT,
                           samples=plan.samples, frame_end=plan.frames)  # fmt: skip
        farm.start(disk_mib=256)
        note = f"{plan.workers} network namespaces on bridge {farm.net.host_ip}/24"
        if farm.net.isolated and farm.net.reason:  # isolated, but not filtered
            note += f" ({farm.net.reason})"
        result = Result(plan, farm.net.isolated, note if farm.net.isolated else farm.net.reason)
        print(f"chaos: network: {result.network_note}; from a namespace: {farm.reach}",
              file=out, flush=True)  # fmt: skip
        result.figures["namespace_reaches"] = farm.reach
        if farm.reach and farm.reach != {"redis": True, "s3": True, "other_port": False}:
            result.violations.append(f"a namespace reaches {farm.reach}, not only Redis and S3")
        reference = _references(scene, plan.frames, root / "reference")
        for w in farm.workers:
            until(lambda w=w: "event=worker_ready" in w.log_text() or w.proc.poll() is not None,  # type: ignore[misc]
                  180, f"{w.name} ready")  # fmt: skip
            if w.proc.poll() is not None:
                raise RuntimeError(f"worker {w.name} exited {w.proc.returncode} while starting")
        _drive(plan, farm, rng, scene, result, reference, out)
    except Exception:
        if result is None:
            result = Result(plan, False, farm.net.reason if hasattr(farm, "net") else "")
        result.violations.append("the run itself failed: " + traceback.format_exc(limit=4))
        for w in [*farm.workers, *farm.ended]:
            tail = "\n    ".join(w.log_text().splitlines()[-15:])
            print(f"chaos: log of {w.name}:\n    {tail}", file=out, flush=True)
    finally:
        stopped, orphans = _stop(farm)
        assert result is not None
        result.violations += stopped
        result.figures["orphan_processes"] = orphans
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    result.figures["wall_s"] = round(time.monotonic() - t_start, 1)
    report(result, out)
    return result


def _references(scene: Path, frames: int, work: Path) -> dict[int, npt.NDArray[np.float32]]:
    """Each frame rendered once, full frame, by a Blender child outside the farm."""
    out = {}
    with BlenderChild(python=sys.executable, work_dir=work, name="reference") as child:
        for frame in range(1, frames + 1):
            path = work / f"ref{frame}.exr"
            child.render(scene, frame=frame, width=WIDTH, height=HEIGHT, rect=None,
                         samples=None, out_path=path, timeout_s=300)  # fmt: skip
            out[frame] = exr.read_rgba(path)
    return out


def _drive(
    plan: Plan,
    farm: ChaosFarm,
    rng: random.Random,
    scene: Path,
    result: Result,
    reference: dict[int, npt.NDArray[np.float32]],
    out: TextIO,
) -> None:
    settings = Settings.from_env({**farm.worker_env("driver"),
                                  "FARM_REDIS_URL": f"redis://127.0.0.1:{farm.redis.port}/0",
                                  "FARM_S3_ENDPOINT_URL": farm.moto.endpoint})  # fmt: skip
    s3 = boto3.client("s3", endpoint_url=farm.moto.endpoint)
    s3.create_bucket(Bucket=BUCKET)
    conn = jobstore.connect(settings.redis_url)
    store = jobstore.JobStore(conn, settings.lease_ttl_s)
    q = queue.RenderQueue(queue.connect(settings.redis_url), "cpu")
    source = LocalStorage(settings.storage_dir).put_upload(scene)
    rconn = farm.rconn()
    baseline = _redis_snapshot(rconn)
    timing = Timing(plan.lease_ttl_s, plan.s3_timeout_s, STOP_GRACE_S)
    with WriteCounter() as writes:
        t0 = time.monotonic()
        for offset, what in schedule(plan, rng, unavailable(farm)):
            time.sleep(max(0.0, t0 + offset - time.monotonic()))
            _snapshot_ended(store, result.jobs)
            if what == "job":
                k = len(result.jobs)
                folder = None if k % 2 else farm.disk / "out" / f"job{k}"
                output = str(folder) if folder else f"s3://{BUCKET}/job{k}"
                if folder is not None:
                    writes.watch(folder)
                req = RenderRequest(output=output, tiles="2x1", formats="exr",
                                    name=f"chaos-{k}")  # fmt: skip
                job_id = accept(settings, store, q, req, source, inspect_timeout_s=180).job_id
                result.jobs.append(JobRecord(job_id, output, folder))
                print(f"chaos: {time.monotonic() - t0:6.1f} s  job {k} {job_id} -> {output}",
                      file=out, flush=True)  # fmt: skip
            else:
                injected = INJECT[what](farm, rng.random(), timing)
                result.injected.append(injected)
                print(f"chaos: {time.monotonic() - t0:6.1f} s  {what} {injected.target} "
                      f"mid_tile={injected.mid_tile} {injected.detail}"
                      f"{' PROBLEM ' + injected.problem if injected.problem else ''}",
                      file=out, flush=True)  # fmt: skip
        faults_end = time.monotonic()
        deadline = time.monotonic() + max(300.0, plan.duration_s)
        while time.monotonic() < deadline and not all(j.status for j in result.jobs):
            _snapshot_ended(store, result.jobs)
            time.sleep(0.3)
        result.figures["drain_s"] = round(time.monotonic() - faults_end, 1)
        farm.proxy.clear()
        _check(plan, farm, result, reference, writes, s3, rconn, baseline)
    s3.close()


def unavailable(farm: ChaosFarm) -> set[str]:
    """Faults this machine cannot inject: a partition needs namespaces, a full disk a tmpfs
    of the run's own (both root)."""
    return ({"partition"} if not farm.net.isolated else set()) | (
        {"disk_full"} if not farm.mounted else set()
    )


def _snapshot_ended(store: jobstore.JobStore, jobs: list[JobRecord]) -> None:
    """Read each newly ended job's tiles and events before retention trims them."""
    for job in jobs:
        if job.status is not None:
            continue
        status = store.status(job.id)
        if status.state in ENDED:
            job.tiles = {str(k): str(v) for k, v in store.conn.hgetall(keys.tiles(job.id)).items()}
            job.events = store.events(job.id, "0")
            job.status = status


# --- the promises, checked from outside --------------------------------------------------------


def _check(
    plan: Plan,
    farm: ChaosFarm,
    result: Result,
    reference: dict[int, npt.NDArray[np.float32]],
    writes: WriteCounter,
    s3: Any,
    rconn: Any,
    baseline: dict[str, Any],
) -> None:
    v, fig = result.violations, result.figures
    # every accepted job done (a failure only with a reason a fault forced)
    for job in result.jobs:
        if job.status is None:
            v.append(f"job {job.id} did not end")
        elif job.status.state != "done":
            forced = _forced(job.status.reason, result.injected)
            if not forced:
                v.append(f"job {job.id} {job.status.state}: {job.status.reason}")
        rendering = [t for t, s in job.tiles.items() if s == "rendering"]
        if rendering:
            v.append(f"job {job.id} ended with tiles still rendering: {rendering}")

    # no lease, deadline or requeue left behind
    def idle() -> bool:
        return not any(rconn.zcard(k) for k in (keys.TILE_DEADLINES, keys.FRAME_DEADLINES,
                                                keys.REQUEUED, keys.LEASE_EXPIRY))  # fmt: skip

    try:
        until(idle, plan.lease_ttl_s * 5 + 10, "leases and deadlines cleared")
    except AssertionError:
        v.append("left in Redis: " + ", ".join(
            f"{k}={rconn.zcard(k)}" for k in (keys.TILE_DEADLINES, keys.FRAME_DEADLINES,
                                              keys.REQUEUED, keys.LEASE_EXPIRY)))  # fmt: skip
    # each frame bit-exact; each delivered file written once
    frames_checked = exact = once = more = 0
    puts = Counter(r.path.split("?")[0] for r, status in farm.proxy.log.answered
                   if r.method == "PUT" and 200 <= status < 300)  # fmt: skip
    for job in result.jobs:
        if job.status is None or job.status.state != "done":
            continue
        if job.folder is not None:
            counts = writes.written(job.folder)
        else:
            prefix = f"/{BUCKET}/{job.output.rsplit('/', 1)[1]}/"
            counts = {p[len(prefix) :]: n for p, n in puts.items() if p.startswith(prefix)}
        for frame in range(1, plan.frames + 1):
            name = f"frame_{frame:04d}.exr"
            got = _read_frame(job, name, s3)
            frames_checked += 1
            if got is not None and np.array_equal(got, reference[frame]):
                exact += 1
            else:
                v.append(f"job {job.id} {name} differs from the reference (or is missing)")
        for name, n in counts.items():
            if name == "manifest.json":
                continue  # rewritten by design when two assemblers finish last together
            if n == 1:
                once += 1
            else:
                more += 1
                v.append(f"job {job.id} {name} written {n} times")
        expected = {f"frame_{f:04d}.exr" for f in range(1, plan.frames + 1)}
        if plan.frames > 1:
            expected.add("preview.mp4")  # an animation's preview (workers.preview)
        missing = expected - set(counts)
        if missing:
            v.append(f"job {job.id}: no write seen of {sorted(missing)}")
    fig.update(frames_checked=frames_checked, frames_bit_exact=exact, files_written_once=once,
               files_written_more_than_once=more)  # fmt: skip
    _attribute(result)
    _check_redis(plan, farm, result, rconn, baseline)


def _forced(reason: str, injected: list[Injected]) -> bool:
    """A job may fail only where its tile ran out of attempts to faults that cost one: its
    worker lost (SIGKILL, a pause, a partition past the lease) or its Blender child killed."""
    if not re.search(r"failed after \d+ attempt\(s\)", reason):
        return False
    kinds = next((k for text, k in CAUSES if text in reason), ())
    return any(i.kind in kinds for i in injected)


def _read_frame(job: JobRecord, name: str, s3: Any) -> npt.NDArray[np.float32] | None:
    if job.folder is not None:
        path = job.folder / name
        return exr.read_rgba(path) if path.exists() else None
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / name
        try:
            s3.download_file(BUCKET, f"{job.output.rsplit('/', 1)[1]}/{name}", str(local))
        except Exception:
            return None
        return exr.read_rgba(local)


#: which faults can cause a requeue with this reason (the latest such fault before it did)
CAUSES = (
    ("stopped answering", ("worker_sigkill", "sigstop", "partition", "redis_sigkill")),
    ("worker stopped", ("sigterm",)),
    ("Blender crashed", ("blender_sigkill",)),
    ("lease lost", ("sigstop", "partition", "redis_sigkill")),
)


#: a tile event's reason naming the storage: such faults must be waited out, not retried
STORAGE_FAULT = re.compile(r"storage|No space left|S3|SlowDown|did not answer", re.IGNORECASE)


def _cause(result: Result, event: Event) -> int | None:
    kinds = next((k for text, k in CAUSES if text in event.message), KINDS)
    before = [n for n, i in enumerate(result.injected) if i.at <= event.ts and i.kind in kinds]
    return before[-1] if before else None


def _attribute(result: Result) -> None:
    """Requeues and counted tile failures, each put down to the latest fault before it that
    can cause one with its reason."""
    requeued: Counter[int] = Counter()
    failed: Counter[int] = Counter()
    for job in result.jobs:
        for event in job.events:
            if event.type != "tile_state" or not event.message:
                continue
            cause = _cause(result, event)
            if STORAGE_FAULT.search(event.message):
                # a full disk or a storage outage costs time, never an attempt or a requeue
                where = f"job {event.job_id} frame {event.frame} tile {event.tile}"
                result.violations.append(f"{where} {event.state}: {event.message}")
            result.requeues.append(
                f"{event.job_id} f{event.frame}t{event.tile} "
                f"a{event.attempt} {event.state}: {event.message}"
            )
            if cause is None:
                continue
            if event.state == "queued":
                requeued[cause] += 1
            if event.state == "failed":
                failed[cause] += 1
    for kind in sorted({i.kind for i in result.injected}, key=KINDS.index):
        mine = [n for n, i in enumerate(result.injected) if i.kind == kind]
        problems = "; ".join(result.injected[n].problem for n in mine
                             if result.injected[n].problem)  # fmt: skip
        result.table.append((
            kind, len(mine), sum(result.injected[n].mid_tile for n in mine),
            sum(requeued[n] for n in mine), sum(failed[n] for n in mine), problems or "ok",
        ))  # fmt: skip
        if problems:
            result.violations.append(f"{kind}: {problems}")
    tiles = [s for job in result.jobs for s in job.events if s.type == "tile_state"]
    result.figures["tiles_rerendered"] = sum(
        1 for e in tiles if e.state == "rendering" and (e.attempt or 1) > 1
    )
    result.figures["tile_failures_counted"] = sum(
        j.status.tile_failures for j in result.jobs if j.status is not None
    )


_ID = re.compile(r"[0-9a-f]{8,}(-[0-9a-f]{4,})*")


def _pattern(key: str) -> str:
    return _ID.sub("<id>", key)


def _redis_snapshot(rconn: Any) -> dict[str, Any]:
    names = list(rconn.scan_iter(count=1000))
    return {
        "keys": Counter(_pattern(k) for k in names),
        "persistent": Counter(_pattern(k) for k in names if rconn.ttl(k) == -1),
        "used_memory": int(rconn.info("memory")["used_memory"]),
    }


#: what a job leaves for good: its summary and its entries in the indexes (farm/keys.py)
SUMMARY = re.compile(r"^tessera:(job:<id>|jobs|jobs-ended|project:.*|usage.*|bands:.*)$")
#: rq's structures per queue (one each, whatever the number of jobs)
RQ_FIXED = re.compile(r"^rq:(queues|wip:.*|failed:.*|finished:.*|workers.*)$")


def _check_redis(
    plan: Plan, farm: ChaosFarm, result: Result, rconn: Any, baseline: dict[str, Any]
) -> None:
    ids = [j.id for j in result.jobs]

    def trimmed() -> bool:
        return not any(next(rconn.scan_iter(f"tessera:job:{i}:*", count=1000), None)
                       for i in ids)  # fmt: skip

    try:
        until(trimmed, plan.retention_s + plan.lease_ttl_s * 4 + 30, "retention trimming jobs")
    except AssertionError:
        result.violations.append("jobs' tiles/events still in Redis past FARM_JOB_RETENTION_S")
    after = _redis_snapshot(rconn)
    grown = after["persistent"] - baseline["persistent"]
    summaries = sum(n for p, n in grown.items() if SUMMARY.match(p))
    # a task a SIGKILLed worker had started stays in rq's started registry (no expiry) until
    # rq's own maintenance finds it abandoned, past its timeout, and files it as failed (24 h)
    # (a member is "task id:execution id")
    started = {m.split(":")[0] for k in rconn.scan_iter("rq:wip:*") for m in rconn.zrange(k, 0, -1)}
    abandoned = [k for k in rconn.scan_iter("rq:job:*")
                 if rconn.ttl(k) == -1 and k.removeprefix("rq:job:") in started]  # fmt: skip
    for key in abandoned:
        grown[_pattern(key)] -= 1
    kills = sum(1 for i in result.injected if i.kind == "worker_sigkill")
    if len(abandoned) > kills:
        result.violations.append(f"{len(abandoned)} rq task records left started, "
                                 f"{kills} workers SIGKILLed")  # fmt: skip
    leaked = {p: n for p, n in grown.items()
              if n > 0 and not SUMMARY.match(p) and not RQ_FIXED.match(p)}  # fmt: skip
    if leaked:
        result.violations.append(f"keys left without expiry beyond summaries: {leaked}")
    if grown.get("tessera:job:<id>", 0) != len(ids):
        result.violations.append(f"{grown.get('tessera:job:<id>', 0)} job summaries for "
                                 f"{len(ids)} jobs")  # fmt: skip
    expiring = after["keys"] - after["persistent"] - (baseline["keys"] - baseline["persistent"])
    result.figures.update(
        redis_keys_baseline=sum(baseline["keys"].values()),
        redis_keys_after=sum(after["keys"].values()),
        redis_summary_keys=summaries,
        redis_rq_abandoned_task_records=len(abandoned),
        redis_expiring_keys=sum(expiring.values()),
        redis_expiring_patterns=sorted(expiring),
        redis_used_memory_baseline_bytes=baseline["used_memory"],
        redis_used_memory_after_bytes=after["used_memory"],
    )


def _stop(farm: ChaosFarm) -> tuple[list[str], int]:
    """Everything ended and removed; the problems seen, and how many processes were left."""
    problems: list[str] = []
    if not hasattr(farm, "net"):
        return problems, 0
    problems += farm.stop()
    left = farm.left_running()
    if left:
        problems.append(f"processes left running: {left}")
    leftovers = farm.net.leftovers()
    if leftovers:
        problems.append(f"network left behind: {leftovers}")
    return problems, len(left)


# --- the report --------------------------------------------------------------------------------


def report(result: Result, out: TextIO) -> None:
    header = ("fault", "injected", "mid-tile", "tiles requeued", "tiles failed", "outcome")
    rows = [header, *[tuple(str(c) for c in row) for row in result.table]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)), file=out)
    jobs = result.jobs
    figures = {
        "seed": result.plan.seed,
        "workers": result.plan.workers,
        "network_namespaces": result.isolated,
        "jobs_accepted": len(jobs),
        "jobs_done": sum(1 for j in jobs if j.status is not None and j.status.state == "done"),
        "jobs_failed": sum(1 for j in jobs if j.status is not None and j.status.state != "done"),
        "faults_injected": len(result.injected),
        **result.figures,
        "violations": result.violations,
    }
    for line in result.requeues:
        print(f"tile event: {line}", file=out)
    for line in result.violations:
        print(f"VIOLATION: {line}", file=out)
    print(json.dumps(figures), file=out, flush=True)
    result.figures = figures
