"""Accepting a render job: the one way a request becomes a queued job, for every client."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from farm import budget, delivery, dependencies, estimaterecords, submission
from farm.alloc.allocator import SlotAllocator
from farm.errors import BadParameter, FarmError
from farm.estimate import Estimate
from farm.jobstore import JobStore
from farm.models import BlendSource, InspectionReport, JobSpec
from farm.queue import RenderQueue
from farm.quote import quote
from farm.settings import Settings

log = logging.getLogger("tessera.accept")

#: ``admit(tasks, create)`` runs ``create`` (the job's transaction) if the farm takes ``tasks``
#: more tiles now (the web holds a project to its budget of queued tiles); returns its job id
Admit = Callable[[int, Callable[[], str]], str]


@dataclass(frozen=True)
class Accepted:
    """A job that is queued: its id, what it renders, and what the user should hear."""

    job_id: str
    spec: JobSpec
    warnings: list[str]
    report: InspectionReport
    #: the estimate shown for it (kept with the job, checked when it is done); None: none
    estimate: Estimate | None = None


def accept(
    settings: Settings,
    store: JobStore,
    queue: RenderQueue,
    req: submission.RenderRequest,
    source: BlendSource,
    report: InspectionReport | None = None,
    *,
    inspect_timeout_s: float | None = None,
    on_wait: Callable[[], None] | None = None,
    max_tasks: int | None = None,
    admit: Admit | None = None,
    role: str = "",
    allocator: SlotAllocator | None = None,
    probe: bool = False,
) -> Accepted:
    """Check ``req`` (every bound), inspect the file (unless its ``report`` is at hand: the
    web caches one per upload), plan its tiles, check its output, then create the job in one
    transaction: the job, its tiles, its project's index and its priority's band.

    Raises before anything is written when any step refuses: nothing is half-accepted. A
    client that must refuse bad options before it starts anything (a private Redis, an upload)
    calls ``submission.check_request`` first; the second check here costs nothing.

    With ``allocator`` the job is estimated where its report has the probe (``probe``: the
    inspection renders one), held to its project's budget (a project with one always gets
    the probe), and the estimate is kept with the job to be checked once it is done.
    """
    submission.check_request(req)
    limited = allocator is not None and budget.get(store.conn, req.project) is not None
    if report is None:
        report = submission.inspect(
            store.conn,
            queue,
            source,
            settings.inspect_timeout_s if inspect_timeout_s is None else inspect_timeout_s,
            on_wait,
            project=req.project,
            probe=probe or limited,
        )
    spec, warnings = submission.plan_job(
        req, report, source, settings.job_max_tiles if max_tasks is None else max_tasks
    )
    # the submitter's role in the project: every tile's lease obeys its device policy
    spec = dataclasses.replace(spec, role=role)
    delivery.check_output(spec, settings)
    dependencies.check(store, spec)
    est = None
    if allocator is not None and (report.probe is not None or limited):
        est = quote(store.conn, settings, allocator, report, spec)
        budget.check(store, settings, spec.project, est, spec.device)
    scripts_blocked = report.autoexec_fail

    def create() -> str:
        return submission.submit(queue.conn, store, queue, spec, warnings, scripts_blocked)

    tasks = len(spec.frames) * spec.tasks_per_frame
    job_id = create() if admit is None else admit(tasks, create)
    if est is not None:
        try:
            estimaterecords.save(store.conn, job_id, est)
        except FarmError as exc:  # the estimate informs; the job is queued
            log.warning("event=estimate_not_saved job=%s error=%r", job_id, exc.message)
    return Accepted(job_id, spec, warnings, report, est)


@dataclass(frozen=True)
class Quoted:
    """A job estimated, not queued: what it would render, its estimate, its budget's state."""

    spec: JobSpec
    warnings: list[str]
    report: InspectionReport
    estimate: Estimate
    budget: budget.Standing | None


def estimate_job(
    settings: Settings,
    store: JobStore,
    queue: RenderQueue,
    req: submission.RenderRequest,
    source: BlendSource,
    allocator: SlotAllocator,
    report: InspectionReport | None = None,
    *,
    role: str = "",
    max_tasks: int | None = None,
) -> Quoted:
    """The job ``req`` would be, estimated (the inspection renders the probe unless
    ``report`` has one), with its project's budget: nothing is queued."""
    submission.check_request(req)
    if report is None or report.probe is None:
        report = submission.inspect(store.conn, queue, source, settings.inspect_timeout_s,
                                    project=req.project, probe=True)  # fmt: skip
    if report.probe is None:
        raise BadParameter(f"the farm could not estimate {source.name}: {report.probe_error}")
    spec, warnings = submission.plan_job(
        req, report, source, settings.job_max_tiles if max_tasks is None else max_tasks
    )
    spec = dataclasses.replace(spec, role=role)
    est = quote(store.conn, settings, allocator, report, spec)
    return Quoted(spec, warnings, report, est, budget.standing(store, settings, spec.project))
