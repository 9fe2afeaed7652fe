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
    """The stop state of one worker process, shared by the signal handler and the tile."""

    def __init__(self, child: _Interruptible, grace_s: float) -> None:
        self.child = child
        self.grace_s = grace_s
        self.requested = threading.Event()
        self.abandoned = threading.Event()
        self._lock = threading.Lock()
        self._rendering = False
        self._timer: threading.Timer | None = None

    def on_signal(self, signum: int) -> None:
        """Called by the worker's signal handler (main thread), once per signal."""
        name = signal.Signals(signum).name
        if not self.requested.is_set():
            self.requested.set()
            log.warning("event=worker_stopping signal=%s grace_s=%g", name, self.grace_s)
            self._timer = threading.Timer(self.grace_s, self.abandon, kwargs={"why": "grace"})
            self._timer.daemon = True
            self._timer.start()
        else:
            self.abandon(why=f"second {name}")

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
        if self._timer is not None:
            self._timer.cancel()
