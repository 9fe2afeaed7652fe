"""A render worker's rq pub/sub thread (how `rq` sends a worker "stop this job" or "shut down")
stops within a second when the worker stops, whichever redis-py runs it.

rq unsubscribes, then stops the thread. Once the thread has read the unsubscription's reply it
waits for a new subscription, up to the sleep time it was started with (rq: 60 s), and redis-py
from 8.2 joins the thread without a timeout when it is stopped: a worker stopped right after a
task (SIGTERM, the end of `--burst`) hung for up to a minute."""

from __future__ import annotations

import time

from rq import Queue

from farm import keys, queue
from farm.queue import PUBSUB_WAKE_S, _FarmWorker
from tests.farmprocs import until


def test_the_pubsub_thread_stops_at_once_after_its_unsubscription_was_read(
    redis_url: str,
) -> None:
    conn = queue.connect(redis_url)
    worker = _FarmWorker([Queue(keys.render_queue("cpu"), connection=conn)],
                         connection=conn, name="pubsub-stop")  # fmt: skip
    try:
        worker.subscribe()
        assert worker.pubsub is not None and worker.pubsub_thread is not None
        thread = worker.pubsub_thread
        pubsub = worker.pubsub
        until(lambda: pubsub.subscribed, 5, "the worker's subscription")
        # rq's own order: unsubscribe first; the thread reads the reply and starts waiting
        pubsub.unsubscribe()
        time.sleep(0.5)
        t0 = time.monotonic()
        worker.unsubscribe()
        stopped_s = time.monotonic() - t0
        assert stopped_s <= PUBSUB_WAKE_S + 0.5, f"stopping took {stopped_s:.1f} s"
        thread.join(PUBSUB_WAKE_S + 1)
        assert not thread.is_alive(), "the pub/sub thread outlived its worker"
    finally:
        conn.close()
