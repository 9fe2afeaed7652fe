"""Following one job's events from its start until it ends (`farm watch --json`)."""

from __future__ import annotations

from collections.abc import Iterator

from farm.errors import JobCanceled, JobFailed
from farm.jobstore import JobStore
from farm.models import Event, JobStatus
from farm.states import JOB_FINAL, JobState

#: longest one read of the job's stream waits before the job's state is looked at again
BLOCK_MS = 2000


def follow(store: JobStore, job_id: str, after: str = "0") -> Iterator[Event]:
    """Every event of the job after ``after``, as it happens, ending with the event that ends
    the job (or when the job is found ended without one: its events were trimmed)."""
    store.status(job_id)  # NotFound for an unknown id
    while True:
        batch = store.events(job_id, after, block_ms=BLOCK_MS)
        for event in batch:
            after = event.id
            yield event
            if event.type == "job_state" and JobState(event.state) in JOB_FINAL:
                return
        if not batch and store.state(job_id) in JOB_FINAL:
            return


def outcome(store: JobStore, job_id: str) -> JobStatus:
    """The ended job's status; raises JobFailed or JobCanceled (the CLI's exit status) for
    those ends, as `farm watch` without --json does."""
    status = store.status(job_id)
    if status.state == JobState.CANCELED.value:
        raise JobCanceled(f"job {job_id} was canceled: {status.reason or 'by request'}")
    if status.state == JobState.FAILED.value:
        raise JobFailed(f"job {job_id} failed: {status.reason}", job_id=job_id)
    return status
