"""Child processes that never outlive the process that started them, and their orderly stop."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

_PR_SET_PDEATHSIG = 1


def _load_libc() -> ctypes.CDLL | None:
    # Loaded in the parent: a forked child should not have to dlopen between fork and exec.
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()


def arm_parent_death_signal(sig: int) -> None:
    """Have Linux send ``sig`` to this process when the thread that spawned it exits."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that has Linux send ``sig`` to the child when its parent thread dies."""
    parent_pid = os.getpid()

    def preexec() -> None:
        arm_parent_death_signal(sig)
        # The parent may have died between fork and prctl; then nobody would ever signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def spawn_farm(
    args: Sequence[str], env: Mapping[str, str], log_path: Path
) -> subprocess.Popen[bytes]:
    """``farm ARGS...`` as a child process, its output appended to ``log_path``.

    It gets its own session, so a terminal's Ctrl-C reaches only this process, which stops it
    (``stop_all``), and it receives SIGTERM if this process dies first.
    """
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "farm", *args],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )


def stop_all(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """Signal every process at once (SIGTERM; SIGKILL when ``grace_s`` is 0), then reap them
    all within one shared ``grace_s``, SIGKILLing those still running past it."""
    procs = list(procs)
    sig = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        stop(proc, max(0.1, deadline - time.monotonic()))


def stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0, sig: int = signal.SIGTERM) -> int:
    """Ask ``proc`` to stop with ``sig``, SIGKILL it after ``grace_s``; always reaps it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    return proc.returncode


class ChildHandle:
    """Base of a handle on a child process: ``with handle:`` starts it, and stops it however
    the block ends. Subclasses define ``start`` and ``stop``."""

    def start(self) -> object:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
