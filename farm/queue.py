"""The rq adapter: a render queue per device class, tile/assembly/inspection jobs, the worker.

This is the only module that imports rq. rq's own job status is not the record of a tile: the
farm's job store is (``farm.jobstore``); rq only carries the work to a worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from rq import Queue, SimpleWorker
from rq.job import Job

from farm import keys, redisclient
from farm.models import BlendSource, TileTask
from farm.redisclient import Redis, guard

TILE_TASK = "workers.tasks.render_tile"
ASSEMBLE_TASK = "workers.tasks.assemble_frame"
INSPECT_TASK = "workers.tasks.inspect_blend"

#: how long rq keeps a failed task's traceback (the farm keeps its own record of failures)
FAILURE_TTL_S = 24 * 3600
#: seconds between a worker's passes over rq's registries (the farm's own recovery sweep runs
#: on its own thread, see workers.worker)
MAINTENANCE_INTERVAL_S = 10
#: a worker's heartbeat TTL; rq waits for new work this long minus 15 s per blocking pop
WORKER_TTL_S = 35


def connect(url: str) -> Redis:
    """A Redis client for rq (binary replies, as rq requires)."""
    return redisclient.connect(url, text=False)


class RenderQueue:
    """The queue of one device class (``cpu``, ``gpu``, later ``t4``, ``l4``...)."""

    def __init__(self, conn: Redis, device_class: str) -> None:
        self.conn = conn
        self.device_class = device_class
        self.queue = Queue(keys.render_queue(device_class), connection=conn)

    def stage_tiles(
        self, tasks: Iterable[TileTask], timeout_s: float, pipeline: Any = None
    ) -> None:
        """Push tile attempts; with ``pipeline`` the pushes join the caller's transaction."""
        datas = [
            Queue.prepare_data(
                TILE_TASK,
                args=(t.job_id, t.frame, t.index, t.attempt),
                timeout=_rq_timeout(timeout_s),
                result_ttl=0,
                failure_ttl=FAILURE_TTL_S,
                job_id=t.rq_id,
                description=f"job {t.job_id} frame {t.frame} tile {t.index} attempt {t.attempt}",
            )
            for t in tasks
        ]
        if datas:
            guard(self.queue.enqueue_many, datas, pipeline=pipeline)

    def enqueue_assembly(self, job_id: str, frame: int, timeout_s: float) -> None:
        # at the front: a finished frame is worth more to the user than one more tile
        guard(
            self.queue.enqueue_call,
            ASSEMBLE_TASK,
            args=(job_id, frame),
            timeout=_rq_timeout(timeout_s),
            result_ttl=0,
            failure_ttl=FAILURE_TTL_S,
            job_id=f"assemble-{job_id}-{frame}",
            at_front=True,
            description=f"job {job_id} assemble frame {frame}",
        )

    def enqueue_inspection(self, source: BlendSource, reply_key: str, timeout_s: float) -> None:
        guard(
            self.queue.enqueue_call,
            INSPECT_TASK,
            args=(source.to_dict(), reply_key),
            timeout=_rq_timeout(timeout_s),
            result_ttl=0,
            failure_ttl=FAILURE_TTL_S,
            at_front=True,
            description=f"inspect {source.name}",
        )

    def depth(self) -> int:
        return int(self.queue.count)

    def missing(self, tasks: Sequence[TileTask]) -> list[TileTask]:
        """The tile attempts that have no task in rq (lost between a state change and a push)."""
        pipe = self.conn.pipeline(transaction=False)
        for t in tasks:
            pipe.exists(Job.key_for(t.rq_id))
        found = guard(pipe.execute) if tasks else []
        return [t for t, exists in zip(tasks, found, strict=True) if not exists]


class _FarmWorker(SimpleWorker):
    """rq's in-process worker (no fork per job: the Blender child must outlive each tile)."""


def run_worker(
    conn: Redis,
    device_class: str,
    name: str,
    *,
    burst: bool = False,
    log_level: str = "INFO",
) -> None:
    """Serve the device class's queue until stopped (SIGINT/SIGTERM) or, with ``burst``, empty."""
    worker = _FarmWorker(
        [RenderQueue(conn, device_class).queue],
        name=name,
        connection=conn,
        maintenance_interval=MAINTENANCE_INTERVAL_S,
        worker_ttl=WORKER_TTL_S,
        log_job_description=False,
    )
    logging.getLogger("rq.worker").setLevel(log_level)
    guard(worker.work, burst=burst, logging_level=log_level, with_scheduler=False)


def _rq_timeout(timeout_s: float) -> int:
    # The worker enforces the real limit by killing its Blender child; rq's own alarm is a
    # backstop well past it, so it never fires first.
    return int(timeout_s * 2 + 120)
