"""The Blender child as a process: its set-up before bpy is imported, and its log lines."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

from farm.lifetime import arm_parent_death_signal

_IOLBF = 1


def prepare(cmd_fd: int, reply_fd: int) -> None:
    """Set the process up before bpy is imported: it dies with its parent, Blender's C output
    is line-buffered, and the protocol pipes are its own."""
    arm_parent_death_signal(signal.SIGKILL)
    _line_buffer_c_stdout()
    # Anything Blender spawns must not hold our protocol pipes open after we die.
    os.set_inheritable(cmd_fd, False)
    os.set_inheritable(reply_fd, False)


def log(event: str, **fields: Any) -> None:
    """One key=value line on stderr (line-buffered), so the parent's log tail shows our steps."""
    parts = " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items())
    print(f"tessera-child event={event} {parts}", file=sys.stderr, flush=True)


def _line_buffer_c_stdout() -> None:
    """Blender prints through C stdio; line-buffer it so a crash's last lines reach the log."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        c_stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.setvbuf(c_stdout, None, _IOLBF, 0)
    except (OSError, ValueError):
        pass
