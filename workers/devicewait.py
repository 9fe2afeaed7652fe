"""A started tile waiting for its device: the tile's own lease is kept alive meanwhile (a busy
device is not a lost worker), and the wait ends early when the worker is told to stop or the
tile is no longer this worker's."""

from __future__ import annotations

import logging
import threading
import time

from farm.alloc.allocator import Lease, LeaseBeside, Request, SlotAllocator
from farm.errors import FarmError
from farm.jobstore import JobStore
from farm.models import TileTask

log = logging.getLogger("tessera.worker")

#: how often the waiter looks at the worker's stop signal
POLL_S = 0.1


def acquire_for_tile(
    store: JobStore,
    allocator: SlotAllocator,
    holder: str,
    task: TileTask,
    request: Request,
    wait_s: float,
    stopping: threading.Event | None = None,
    beside: LeaseBeside | None = None,
) -> Lease:
    """The device lease for ``task`` (already marked rendering), waiting up to ``wait_s``;
    NoCapacity when there is no room by then, when ``stopping`` is set (a SIGTERM's grace ran
    out) or when the tile was taken over. Meanwhile the tile's lease is renewed every third of
    its period, as during the render, so the recovery sweep does not count the wait as a
    failed attempt. ``beside``: writes that go with the grant (``SlotAllocator.acquire``)."""
    give_up = threading.Event()
    done = threading.Event()

    def keep() -> None:
        every_s = store.tile_lease_s / 3
        touch_at = time.monotonic() + every_s
        while not done.wait(POLL_S):
            if stopping is not None and stopping.is_set():
                give_up.set()
            if time.monotonic() < touch_at:
                continue
            touch_at += every_s
            try:
                if not store.touch_tile(task):
                    log.warning("event=lease_lost job=%s frame=%d tile=%d why=%r", task.job_id,
                                task.frame, task.index, "taken over meanwhile")  # fmt: skip
                    give_up.set()
            except FarmError as exc:  # Redis away for a moment: the next beat tries again
                log.warning("event=renew_failed job=%s frame=%d tile=%d error=%r", task.job_id,
                            task.frame, task.index, exc.message)  # fmt: skip

    thread = threading.Thread(target=keep, name="tile-wait", daemon=True)
    thread.start()
    try:
        return allocator.acquire(holder, request, wait_s=wait_s, stop=give_up, beside=beside)
    finally:
        done.set()
        thread.join()
