"""A worker's stop signal handler records the signal, takes no lock and starts no thread: it
runs between any two bytecodes of the main thread, which may hold, at that moment, the lock of
the Redis pool's queue, a log handler's or the one that starting a thread needs. rq's own
handler wrote the request's date to Redis and the farm's logged and started a timer there, and a
worker once sat 30 s past its SIGTERM. Here the handler runs on a thread of its own while the
test holds the pool's and the log handlers' locks: it must return at once (a handler that needed
one would wait for ever), and leave as many threads as it found."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from rq import Queue
from rq.exceptions import StopRequested
from rq.worker import WorkerStatus

from farm import keys, queue
from farm.queue import _FarmWorker
from workers.shutdown import Shutdown

#: a handler that returns takes microseconds; one that waits for a held lock never returns
RETURN_S = 2.0


class _Child:
    def __init__(self) -> None:
        self.interrupted = threading.Event()

    def interrupt(self) -> None:
        self.interrupted.set()


@contextmanager
def _locks_held(conn: Any) -> Iterator[None]:
    """Hold what the main thread may hold when a signal comes: the Redis pool's queue and
    every log handler (thread start-up's lock cannot be held here: the handler's own thread
    needs it to start; the thread count stands for it)."""
    with ExitStack() as stack:
        stack.enter_context(conn.connection_pool.pool.mutex)
        for handler in logging.getLogger().handlers + logging.getLogger("tessera").handlers:
            if handler.lock is not None:
                stack.enter_context(handler.lock)
        yield


def _returns(handler: Callable[[], object]) -> BaseException | None:
    """Run ``handler`` on its own thread; fail unless it returns (or raises) within RETURN_S.
    Returns what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            handler()
        except BaseException as exc:  # the idle worker's handler raises StopRequested
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    before = threading.active_count()
    thread.start()
    thread.join(RETURN_S)
    assert not thread.is_alive(), "the stop signal's handler waited for a lock the worker held"
    assert threading.active_count() <= before, "the stop signal's handler started a thread"
    return raised[0] if raised else None


@pytest.mark.parametrize("state", [WorkerStatus.BUSY, WorkerStatus.IDLE])
def test_the_workers_stop_handler_takes_no_lock_and_stops_the_loop(
    redis_url: str, state: WorkerStatus
) -> None:
    conn = queue.connect(redis_url)
    try:
        conn.ping()  # the pool holds a connection to hand out
        worker = _FarmWorker([Queue(keys.render_queue("cpu"), connection=conn)],
                             connection=conn, name="stop-handler")  # fmt: skip
        shutdown = Shutdown(_Child(), grace_s=60)
        worker.on_signal = shutdown.on_signal
        worker.set_state(state)
        with _locks_held(conn):
            raised = _returns(lambda: worker._farm_stop(signal.SIGTERM, None))
        # busy: stops after the task; idle: out of the take at once, and the loop stops anyway
        assert worker._stop_requested
        assert isinstance(raised, StopRequested) == (state == WorkerStatus.IDLE)
        shutdown.close()
    finally:
        conn.close()


def test_the_grace_and_a_second_signal_are_kept_off_the_handler() -> None:
    child = _Child()
    shutdown = Shutdown(child, grace_s=60)
    rendering = shutdown.rendering()
    rendering.__enter__()
    _returns(lambda: shutdown.on_signal(signal.SIGTERM))
    assert shutdown.requested.wait(RETURN_S), "the first signal asks the worker to stop"
    assert not shutdown.abandoned.is_set(), "the tile has its grace period"
    _returns(lambda: shutdown.on_signal(signal.SIGTERM))
    assert child.interrupted.wait(RETURN_S), "a second signal abandons the tile at once"
    assert shutdown.abandoned.is_set()


def test_a_closed_shutdown_abandons_nothing_when_the_grace_runs_out() -> None:
    child = _Child()
    shutdown = Shutdown(child, grace_s=0.1)
    rendering = shutdown.rendering()
    rendering.__enter__()
    shutdown.on_signal(signal.SIGTERM)
    assert shutdown.requested.wait(RETURN_S)
    shutdown.close()
    assert not child.interrupted.wait(0.5)
