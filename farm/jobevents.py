"""Following a job's events from its start until it ends, or a project's jobs' events
(`farm watch --json`)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from farm import keys
from farm.errors import JobCanceled, JobFailed
from farm.jobstore import JobStore
from farm.models import Event, JobStatus
from farm.redisclient import guard
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


#: the latest jobs of a project looked at for new ones, each time the streams are read
PROJECT_JOBS = 100


def follow_project(store: JobStore, project: str) -> Iterator[Event]:
    """Every event of the project's jobs running now and of those submitted from now on, each
    job from its start, until the caller stops; a job's end is its last event here."""
    started_s = time.time()
    after: dict[str, str] = {}
    seen: set[str] = set()
    while True:
        rows = store.project_job_ids(project, PROJECT_JOBS)
        fresh = [(job_id, created) for job_id, created in rows if job_id not in seen]
        states = store.states([job_id for job_id, _ in fresh])
        for (job_id, created), state in zip(fresh, states, strict=True):
            seen.add(job_id)
            # a job submitted since the watch began counts even if it has already ended
            if state is not None and (created >= started_s or JobState(state) not in JOB_FINAL):
                after[job_id] = "0"
        if not after:
            time.sleep(BLOCK_MS / 1000)
            continue
        streams = {keys.events(job_id): at for job_id, at in after.items()}
        reply = guard(store.conn.xread, streams, count=1000, block=BLOCK_MS)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                event = Event.from_fields(entry_id, fields)
                after[event.job_id] = entry_id
                yield event
                if event.type == "job_state" and JobState(event.state) in JOB_FINAL:
                    del after[event.job_id]


def outcome(store: JobStore, job_id: str) -> JobStatus:
    """The ended job's status; raises JobFailed or JobCanceled (the CLI's exit status) for
    those ends, as `farm watch` without --json does."""
    status = store.status(job_id)
    if status.state == JobState.CANCELED.value:
        raise JobCanceled(f"job {job_id} was canceled: {status.reason or 'by request'}")
    if status.state == JobState.FAILED.value:
        raise JobFailed(f"job {job_id} failed: {status.reason}", job_id=job_id)
    return status
