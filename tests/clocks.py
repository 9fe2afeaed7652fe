"""A host whose clock is wrong, played by this test process: for the tests of farm.redisclock
(every time that crosses hosts is on Redis's clock)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest

from farm import redisclock
from farm.redisclient import Redis

#: this machine's clock, as it is before a test sets this process's clock wrong
REAL_TIME = time.time


def off_by(skew_s: float) -> Callable[[], float]:
    """A clock ``skew_s`` ahead of this machine's (behind when negative)."""
    return lambda: REAL_TIME() + skew_s


def host_clock(conn: Redis, clock: Callable[[], float]) -> None:
    """``conn``'s farm.redisclock as on a host whose clock is ``clock``: its offset to the
    server read with that clock, as that host would have read it from its start."""
    reader = redisclock.clock_for(conn)
    reader.local = clock
    reader.sync()


@contextlib.contextmanager
def process_clock(monkeypatch: pytest.MonkeyPatch, clock: Callable[[], float]) -> Iterator[None]:
    """Inside, ``time.time`` is ``clock``: what this process does then, a host with that clock
    does (farm.redisclock's readers keep the clocks they were given)."""
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", clock)
        yield
