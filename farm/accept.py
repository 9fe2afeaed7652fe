"""Accepting a render job: the one way a request becomes a queued job, for every client."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from farm import delivery, dependencies, submission
from farm.jobstore import JobStore
from farm.models import BlendSource, InspectionReport, JobSpec
from farm.queue import RenderQueue
from farm.settings import Settings

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
) -> Accepted:
    """Check ``req`` (every bound), inspect the file (unless its ``report`` is at hand: the
    web caches one per upload), plan its tiles, check its output, then create the job in one
    transaction: the job, its tiles, its project's index and its priority's band.

    Raises before anything is written when any step refuses: nothing is half-accepted. A
    client that must refuse bad options before it starts anything (a private Redis, an upload)
    calls ``submission.check_request`` first; the second check here costs nothing.
    """
    submission.check_request(req)
    if report is None:
        report = submission.inspect(
            store.conn,
            queue,
            source,
            settings.inspect_timeout_s if inspect_timeout_s is None else inspect_timeout_s,
            on_wait,
            project=req.project,
        )
    spec, warnings = submission.plan_job(
        req, report, source, settings.job_max_tiles if max_tasks is None else max_tasks
    )
    # the submitter's role in the project: every tile's lease obeys its device policy
    spec = dataclasses.replace(spec, role=role)
    delivery.check_output(spec, settings)
    dependencies.check(store, spec)
    scripts_blocked = report.autoexec_fail

    def create() -> str:
        return submission.submit(queue.conn, store, queue, spec, warnings, scripts_blocked)

    tasks = len(spec.frames) * spec.tasks_per_frame
    job_id = create() if admit is None else admit(tasks, create)
    return Accepted(job_id, spec, warnings, report)
