"""Job and tile states and the explicit tables of transitions allowed between them.

The job scripts enforce these tables inside Redis: ``farm.jobscripts`` renders them into its Lua
prelude, so a move the tables forbid is refused by the script that would make it.
"""

from __future__ import annotations

from enum import StrEnum


class TileState(StrEnum):
    QUEUED = "queued"
    RENDERING = "rendering"
    DONE = "done"
    FAILED = "failed"
    CANCELED = "canceled"


class JobState(StrEnum):
    # waits for the jobs it depends on (depends_on); its tiles are not in the queue yet
    WAITING = "waiting"
    QUEUED = "queued"
    RUNNING = "running"
    # the user suspended it: no tile starts (a worker that draws one holds it back), those
    # rendering finish; resumed, the held tiles are queued again (farm.jobcontrol)
    SUSPENDED = "suspended"
    # every tile is in; frames are being stitched and delivered
    ASSEMBLING = "assembling"
    DONE = "done"
    FAILED = "failed"
    CANCELED = "canceled"


TILE_TRANSITIONS: dict[TileState, frozenset[TileState]] = {
    TileState.QUEUED: frozenset({TileState.RENDERING, TileState.CANCELED}),
    # RENDERING -> QUEUED: a retry after a failed attempt, or a requeue that is not a failure
    TileState.RENDERING: frozenset(
        {TileState.DONE, TileState.QUEUED, TileState.FAILED, TileState.CANCELED}
    ),
    # DONE -> QUEUED: the user requeues a rendered tile (its frame is rendered and delivered
    # again, under a new attempt)
    TileState.DONE: frozenset({TileState.QUEUED}),
    # FAILED -> QUEUED: the user retries failed tiles
    TileState.FAILED: frozenset({TileState.QUEUED}),
    # CANCELED -> QUEUED: the user retries a failed job, whose end canceled its unfinished tiles
    TileState.CANCELED: frozenset({TileState.QUEUED}),
}

JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # WAITING -> QUEUED once every dependency is done; FAILED when one fails or is canceled
    JobState.WAITING: frozenset({JobState.QUEUED, JobState.FAILED, JobState.CANCELED}),
    JobState.QUEUED: frozenset(
        {JobState.RUNNING, JobState.SUSPENDED, JobState.FAILED, JobState.CANCELED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.ASSEMBLING, JobState.SUSPENDED, JobState.FAILED, JobState.CANCELED}
    ),
    # SUSPENDED -> ASSEMBLING: its last rendering tiles finished while it was suspended;
    # -> QUEUED: resumed before any tile had started
    JobState.SUSPENDED: frozenset(
        {JobState.RUNNING, JobState.QUEUED, JobState.ASSEMBLING, JobState.FAILED, JobState.CANCELED}
    ),
    # ASSEMBLING -> RUNNING: the user requeued tiles while frames were being assembled
    JobState.ASSEMBLING: frozenset(
        {JobState.DONE, JobState.RUNNING, JobState.FAILED, JobState.CANCELED}
    ),
    # DONE, CANCELED -> RUNNING: the user requeues frames or tasks of an ended job
    JobState.DONE: frozenset({JobState.RUNNING}),
    # FAILED -> RUNNING: the user retries the failed tiles of a failed job
    JobState.FAILED: frozenset({JobState.RUNNING}),
    JobState.CANCELED: frozenset({JobState.RUNNING}),
}

TILE_FINAL = frozenset({TileState.DONE, TileState.FAILED, TileState.CANCELED})
JOB_FINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELED})
