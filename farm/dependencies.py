"""Jobs that wait for other jobs (``depends_on``): checking, linking and releasing them.

A job with dependencies is accepted ``waiting``: its tiles exist but are not in the queue. The
Lua that ends a job (``job_move`` in farm.jobscripts) counts its waiting dependents down and
releases them (or fails them: "dependency JOB failed") in the same step that marks it done, so
no end is missed; a released job's tiles are pushed by whoever made the move
(``push_released``), else by the recovery sweep, which also counts waiting jobs again
(``recheck``) so that a move lost in between is healed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from farm import jobscripts, keys
from farm.errors import BadParameter, NotFound
from farm.frames import ordered_frames
from farm.jobstore import JobStore
from farm.models import JobSpec, TileTask
from farm.redisclient import Redis, guard

log = logging.getLogger("tessera.dependencies")

#: released jobs one ``push_released`` call pushes at most (the rest wait for the next call)
PUSH_LIMIT = 100
#: waiting jobs one sweep pass counts again at most
RECHECK_LIMIT = 1000


def check(store: JobStore, spec: JobSpec) -> None:
    """Refuse a dependency that is no job of the same project (another project's job is
    "no job" as well: its id says nothing to this project)."""
    for job_id in spec.depends_on:
        try:
            project = store.spec(job_id).project
        except NotFound:
            project = None
        if project != spec.project:
            raise BadParameter(
                f"depends_on: there is no job {job_id} in project {spec.project}",
                field="depends_on",
                job_id=job_id,
            )


def in_queue_order(spec: JobSpec, tasks: Iterable[TileTask]) -> list[TileTask]:
    """``tasks`` in the order the job's frame order queues them (tiles of a frame in order)."""
    rank = {f: i for i, f in enumerate(ordered_frames(spec.frames, spec.frame_order))}
    return sorted(tasks, key=lambda t: (rank.get(t.frame, len(rank)), t.index))


def link(conn: Redis, pipe: Any, job_id: str, now: float) -> None:
    """Add the linking of a waiting job to its dependencies to ``pipe``, the transaction that
    creates it: it waits, or is released (all done) or failed (one failed) at once."""
    script = conn.register_script(jobscripts.LINK_DEPENDENCIES)
    script(keys=[keys.job(job_id)], args=[job_id, now], client=pipe)


def push_released(store: JobStore, rq_conn: Redis, limit: int = PUSH_LIMIT) -> list[str]:
    """Push the tiles of jobs released since the last call into their queues; returns their ids.

    A crash between the pop and the push loses nothing: the tiles are in the sweep's requeued
    index until ``confirm_pushed``, and the sweep pushes them."""
    from farm.queue import RenderQueue  # rq is imported only where tiles are pushed

    released: list[str] = []
    for _ in range(limit):
        job_id = guard(store.conn.lpop, keys.RELEASED)
        if job_id is None:
            break
        try:
            spec = store.spec(job_id)
        except NotFound:
            continue
        tasks = in_queue_order(spec, store.queued_tasks(job_id))
        RenderQueue(rq_conn, spec.device).stage_tiles(tasks, spec.tile_timeout_s)
        store.confirm_pushed(tasks)
        log.info("event=job_released job=%s tiles=%d", job_id, len(tasks))
        released.append(job_id)
    return released


def recheck(store: JobStore, limit: int = RECHECK_LIMIT) -> int:
    """Count every waiting job's dependencies again (the sweep's pass): returns how many
    were released or failed."""
    script = store.conn.register_script(jobscripts.RECHECK_WAITING)
    return int(guard(script, keys=[], args=[store.clock(), limit]))
