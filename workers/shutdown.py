"""How a render worker stops on SIGTERM/SIGINT: no new tiles, a grace period, then abandon.

Spot and preemptible machines get a SIGTERM some seconds before they vanish. The first signal
stops the worker taking work; the tile it is rendering gets ``grace_s`` to finish and commit.
When the grace runs out, or a second signal comes, the tile is abandoned: the Blender child is
killed, the tile goes back to the queue without counting as a failure, the lease is released and
the worker exits 0. An abandoned tile never commits: its output is written only after a render
that completed, and the commit is fenced by the tile's lease.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from farm.errors import TileAbandoned

log = logging.getLogger("tessera.worker")


class _Interruptible(Protocol):
    def interrupt(self) -> None: ...


class Shutdown:
    """The stop state of one worker process, shared by the signal handler and the tile.

    The signal handler only records the signal (``on_signal``): it runs between any two
    bytecodes of the main thread, which may at that moment hold a lock that Redis's connection
    pool, a log file or thread start-up needs, so a handler that logged, wrote to Redis or
    started a timer could wait on its own thread for ever (a worker once sat 30 s past its
    SIGTERM). A watcher thread of its own does the rest: the log line, the grace period, the
    abandonment.
    """

    def __init__(self, child: _Interruptible, grace_s: float) -> None:
        self.child = child
        self.grace_s = grace_s
        self.requested = threading.Event()
        self.abandoned = threading.Event()
        self._lock = threading.Lock()
        self._rendering = False
        #: the signals received, by name; appended by the handler (an atomic append)
        self._signals: list[str] = []
        #: set by the handler, waited on and cleared by the watcher: the main thread's own code
        #: never takes its lock, so the handler waits at most for the watcher's moment
        self._signalled = threading.Event()
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="shutdown", daemon=True)
        self._watcher.start()

    def on_signal(self, signum: int) -> None:
        """Called by the worker's signal handler (main thread), once per signal: records it."""
        self._signals.append(signal.Signals(signum).name)
        self._signalled.set()

    def _watch(self) -> None:
        self._signalled.wait()
        self._signalled.clear()
        if self._closed.is_set():
            return
        self.requested.set()
        log.warning("event=worker_stopping signal=%s grace_s=%g", self._signals[0], self.grace_s)
        if len(self._signals) < 2:
            self._signalled.wait(self.grace_s)
        if self._closed.is_set():
            return
        self.abandon(why=f"second {self._signals[1]}" if len(self._signals) > 1 else "grace")

    def abandon(self, why: str = "grace") -> None:
        """Give up the tile being rendered (if any): kill the child so the render returns now."""
        with self._lock:
            if self.abandoned.is_set():
                return
            self.abandoned.set()
            rendering = self._rendering
        log.warning("event=tile_abandon why=%r rendering=%s", why, rendering)
        if rendering:
            self.child.interrupt()

    @contextmanager
    def rendering(self) -> Iterator[None]:
        """Marks a Blender render in progress: only a render is abandoned, never a commit.

        Raises TileAbandoned at once when the worker already gave up its work.
        """
        with self._lock:
            if self.abandoned.is_set():
                raise TileAbandoned("the worker is stopping; the tile was not started")
            self._rendering = True
        try:
            yield
        finally:
            with self._lock:
                self._rendering = False

    def close(self) -> None:
        """The worker is done: a grace running out from now on abandons nothing."""
        self._closed.set()
