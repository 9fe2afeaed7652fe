"""The embedded farm: a private redis-server and local workers for one `farm render` command."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from farm import jobstore, lifetime, queue, submission
from farm.accept import accept
from farm.blendfile import check_blend
from farm.errors import JobCanceled, JobFailed, QueueError, SetupError
from farm.models import BlendSource, InspectionReport, JobStatus
from farm.progress import ProgressBar
from farm.redisserver import RedisServer
from farm.settings import Settings
from farm.states import JOB_FINAL, JobState
from farm.storage.base import sha256_file
from farm.tags import parse_tags, worker_tags

log = logging.getLogger("tessera.embedded")

#: seconds between checks that the local workers are still alive
WORKER_CHECK_S = 1.0
#: a worker that exits sooner than this after its start is broken, not unlucky
STARTUP_S = 30.0


def threads_per_worker(workers: int) -> int:
    """CPU workers split the cores between them; one worker lets Cycles take them all (0)."""
    if workers <= 1:
        return 0
    return max(1, (os.cpu_count() or 1) // workers)


class LocalWorkers:
    """`farm worker` processes on this host; restarted if one dies while the farm runs.

    ``files``: the project and the folder of the caller's own files the job renders; each
    worker starts its Blender child on them, so the first task (the inspection) keeps it.
    """

    def __init__(
        self, settings: Settings, count: int, log_dir: Path, files: tuple[str, Path] | None = None
    ) -> None:
        self.settings = settings
        self.count = count
        self.log_dir = log_dir
        self.files = files
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned_at: dict[str, float] = {}
        self.restarts = 0

    def start(self) -> None:
        for i in range(self.count):
            self._spawn(f"local-{self.settings.device}-{i}")

    def _spawn(self, name: str) -> None:
        self.spawned_at[name] = time.monotonic()
        env = {**os.environ, **self.settings.to_env()}
        args = ["worker", "--name", name]
        if self.files is not None:
            args += ["--project", self.files[0], "--local-files", str(self.files[1])]
        self.procs[name] = lifetime.spawn_farm(args, env, self.log_dir / f"{name}.log")

    def check(self, note: Callable[[str], None]) -> None:
        """Restart any worker that died; its tile is requeued by the recovery sweep.

        A worker that dies within ``STARTUP_S`` of being started cannot work here (no GPU, a
        broken install): restarting it would loop, so the farm stops with the worker's reason.
        """
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if time.monotonic() - self.spawned_at[name] < STARTUP_S:
                raise SetupError(
                    f"worker {name} could not start (exit status {code}): {self.last_error(name)}"
                )
            note(f"worker {name} exited with status {code}; starting it again")
            self.restarts += 1
            self._spawn(name)

    def last_error(self, name: str) -> str:
        lines = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        errors = [line.removeprefix("farm: error: ") for line in lines if "error" in line]
        return (errors or lines or ["no output"])[-1]

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for name in self.procs:
            path = self.log_dir / f"{name}.log"
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM (rq finishes the task in hand), then SIGKILL after ``grace_s``.

        ``grace_s=0`` once the job is done: every frame is delivered, the workers are idle and
        their Redis is about to be discarded, so a graceful exit has nothing to save. A failed
        or canceled job may still have an assembly writing into the output folder.
        """
        lifetime.stop_all(self.procs.values(), grace_s)


@dataclass(frozen=True)
class RenderOutcome:
    job: JobStatus
    report: InspectionReport
    warnings: list[str]
    elapsed_s: float
    worker_restarts: int


class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: clean up as for Ctrl-C."""


@contextmanager
def _signals_stop() -> Iterator[None]:
    def raise_stop(signum: int, _frame: FrameType | None) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def render(
    settings: Settings,
    blend: Path,
    req: submission.RenderRequest,
    workers: int,
    stream: TextIO,
    *,
    keep_dir: Path | None = None,
) -> RenderOutcome:
    """Render ``blend`` on a farm that lives for this call: check, inspect, queue, watch."""
    submission.check_request(req)
    check_blend(blend)
    blend = blend.resolve()
    source = BlendSource("path", str(blend), sha256_file(blend), blend.name)
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="tessera-"))
    try:
        with _signals_stop():
            redis_server = RedisServer(root / "redis")
            local = settings.with_(
                redis_url=redis_server.url,  # its socket's path, known before it starts
                storage_dir=root / "storage",
                storage_url="",  # tiles stay in this private folder; frames go to the output
                work_dir=root / "work",
                device=req.device,
                cpu_threads=settings.cpu_threads or threads_per_worker(workers),
                # the local workers split the cores between them: one render slot each
                cpu_render_slots=settings.cpu_render_slots or workers,
                # this farm's workers are the job's own: they have whatever tags it asks for
                worker_tags=",".join(
                    sorted(worker_tags(settings.worker_tags) | set(parse_tags(req.tags or "")))
                ),
            )
            (root / "logs").mkdir()
            pool = LocalWorkers(local, workers, root / "logs", (req.project, blend.parent))
            done = False
            try:
                # The workers first: each Blender child imports bpy while Redis starts (a
                # worker asks Redis nothing before its child is ready, and rides out a Redis
                # that is not up yet like one that restarts).
                pool.start()
                redis_server.start()
                outcome = _run(local, source, req, pool, stream, t0)
                done = True
                return outcome
            except QueueError as exc:
                raise QueueError(f"{exc.message}\n{pool.log_tail()}") from exc
            finally:
                pool.stop(grace_s=0 if done else 5.0)
                # nothing of this farm outlives the call: no clean shutdown to wait for
                redis_server.discard()
    finally:
        if keep_dir is not None:
            shutil.copytree(root / "logs", keep_dir, dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)


def _run(
    settings: Settings,
    source: BlendSource,
    req: submission.RenderRequest,
    pool: LocalWorkers,
    stream: TextIO,
    t0: float,
) -> RenderOutcome:
    store = jobstore.JobStore(jobstore.connect(settings.redis_url), settings.lease_ttl_s)
    render_queue = queue.RenderQueue(queue.connect(settings.redis_url), settings.device)
    accepted = accept(
        settings,
        store,
        render_queue,
        req,
        source,
        # the workers start meanwhile
        inspect_timeout_s=settings.inspect_timeout_s + STARTUP_S,
        on_wait=lambda: pool.check(lambda line: print(line, file=stream)),
    )
    job_id, spec, warnings = accepted.job_id, accepted.spec, accepted.warnings
    bar = ProgressBar(stream, len(spec.frames) * spec.tasks_per_frame, len(spec.frames))
    for w in warnings:
        bar.note(f"warning: {w}")
    try:
        status = watch(store, job_id, bar, on_tick=lambda: pool.check(bar.note))
    except (KeyboardInterrupt, _Stop):
        store.end_job(job_id, JobState.CANCELED, "canceled by the user")
        bar.close("canceled")
        raise JobCanceled(
            f"job {job_id} canceled; nothing was delivered after the cancel"
        ) from None
    return RenderOutcome(status, accepted.report, warnings, time.monotonic() - t0, pool.restarts)


def watch(
    store: jobstore.JobStore,
    job_id: str,
    bar: ProgressBar,
    on_tick: Callable[[], None] | None = None,
) -> JobStatus:
    """Follow the job's events into ``bar`` until it ends; raises JobFailed / JobCanceled."""
    tiles_done = frames_done = failures = 0
    after, ended = "0", False
    while not ended:
        batch = store.events(job_id, after, block_ms=int(WORKER_CHECK_S * 1000))
        for event in batch:
            after = event.id
            if event.type == "tile_state":
                if event.state == "done":
                    tiles_done += 1
                elif event.state in ("queued", "failed") and event.message:
                    failures += 1
                    bar.note(f"frame {event.frame} tile {event.tile}: {event.message}")
            elif event.type == "frame_done":
                frames_done += 1
            elif event.type == "warning":
                bar.note(f"warning: {event.message}")
            elif event.type == "job_state" and JobState(event.state) in JOB_FINAL:
                ended = True
        bar.update(tiles_done, frames_done, failures)
        if on_tick is not None:
            on_tick()
        if not batch and store.state(job_id) in JOB_FINAL:
            ended = True
    status = store.status(job_id)
    if status.state == JobState.DONE.value:
        bar.close(f"done: {status.frames_done} frame(s) in {status.spec.output}")
        return status
    bar.close(status.state)
    if status.state == JobState.CANCELED.value:
        raise JobCanceled(f"job {job_id} was canceled: {status.reason or 'by request'}")
    raise JobFailed(f"job {job_id} failed: {status.reason}", job_id=job_id)
