"""A private X display for one stream session: an Xvfb on a free display number."""

from __future__ import annotations

import logging
import os
import select
import shutil
import subprocess
import time

from encoder.resize import open_screen
from farm.errors import SetupError, SourceFailed
from farm.lifetime import die_with_parent, stop

log = logging.getLogger("tessera.stream")

#: variable in every app's environment: the pid of the stream service that started it
APP_MARK = "TESSERA_STREAM_SERVICE_PID"
#: how long Xvfb may take to announce its display number
START_TIMEOUT_S = 10.0


class XDisplay:
    """An Xvfb server of ``width`` x ``height`` (24-bit), dying with this process; RandR may
    resize it up to ``framebuffer`` (default: its own size).

    Xvfb picks its own free display number and writes it on a pipe (``-displayfd``), so two
    sessions starting at once never race for a number.
    """

    def __init__(self, width: int, height: int, framebuffer: tuple[int, int] | None = None) -> None:
        self.width = width
        self.height = height
        self.framebuffer = framebuffer or (width, height)
        self.number: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        """The DISPLAY value (``:N``) of the running server."""
        if self.number is None:
            raise SourceFailed("the X display is not running")
        return f":{self.number}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        xvfb = shutil.which("Xvfb")
        if xvfb is None:
            raise SetupError("Xvfb is not installed: apt-get install xvfb")
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [
                    xvfb, "-displayfd", str(write_fd), "-screen", "0",
                    "{}x{}x24".format(*self.framebuffer), "-nolisten", "tcp", "-noreset",
                    "+extension", "XTEST", "-ac",
                ],
                pass_fds=(write_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent(),
            )  # fmt: skip
            os.close(write_fd)
            write_fd = -1
            self.number = self._read_number(read_fd)
            if self.framebuffer != (self.width, self.height):
                open_screen(self.name, self.width, self.height)
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(read_fd)
            if write_fd >= 0:
                os.close(write_fd)
        log.info("event=display_started display=:%d pid=%d size=%dx%d", self.number,
                 self.proc.pid, self.width, self.height)  # fmt: skip

    def _read_number(self, fd: int) -> int:
        deadline = time.monotonic() + START_TIMEOUT_S
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or (self.proc is not None and self.proc.poll() is not None):
                raise SourceFailed("Xvfb did not start (no display number announced)")
            ready, _, _ = select.select([fd], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(fd, 64)
                if not chunk:
                    raise SourceFailed("Xvfb exited before announcing its display")
                data += chunk
        return int(data.strip())

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace_s=3.0)
            log.info("event=display_stopped display=:%s pid=%d", self.number, self.proc.pid)
        self.proc = None
        self.number = None
