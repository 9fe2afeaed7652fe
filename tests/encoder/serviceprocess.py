"""A stream service in a child process (ours: `farm stream`; or the plain aiortc baseline), its
URL read from the one JSON line it prints when it serves, and its CPU time read from /proc."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from farm import lifetime

REPO = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STOP_TIMEOUT_S = 10.0


def ours_command() -> list[str]:
    return [str(Path(sys.executable).with_name("farm")), "stream"]


def plain_command(source: str = "live") -> list[str]:
    return [sys.executable, "-m", "tests.encoder.plainservice", "--source", source]


class ServiceProcess(lifetime.ChildHandle):
    """Runs `command`, waits for its {"url": ...} line; stops it (SIGTERM, then SIGKILL)."""

    def __init__(
        self, command: list[str], env: dict[str, str] | None = None, log: Path | None = None
    ) -> None:
        self.command = command
        self.env = {**os.environ, **(env or {})}
        self.log = log
        self.url = ""
        self.info: dict[str, object] = {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        stderr = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=self.env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                preexec_fn=lifetime.die_with_parent(signal.SIGKILL),
            )
        finally:
            if self.log:
                stderr.close()  # type: ignore[union-attr]
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.command} did not print its URL (see {self.log})")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    continue
                line += chunk
        self.info = json.loads(line.splitlines()[0])
        self.url = str(self.info["url"])
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_s(self) -> float:
        """CPU time (user + system) of the service and its live children so far, seconds."""
        return sum(_cpu_s(pid) for pid in [self.pid, *_descendants(self.pid)])

    def stop(self) -> None:
        if self.proc is None:
            return
        lifetime.stop(self.proc, STOP_TIMEOUT_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # after the command: state is [0]; utime, stime, cutime, cstime are [11]..[14] (man 5 proc);
    # cutime/cstime hold children already exited and reaped (live ones are counted themselves)
    return sum(int(f) for f in fields[11:15]) / CLOCK_TICKS


def _descendants(pid: int) -> list[int]:
    kids: list[str] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids.extend((task / "children").read_text().split())
    except OSError:
        return []
    out: list[int] = []
    for kid in kids:
        out.append(int(kid))
        out.extend(_descendants(int(kid)))
    return out
