"""A private redis-server child process for the embedded farm and tests (never the shared 6379)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from farm import lifetime
from farm.errors import BadParameter, SetupError

#: sun_path holds 108 bytes including the terminating NUL
UNIX_PATH_MAX_BYTES = 107
#: attempts to find a free TCP port when another process grabs the one we picked first
PORT_ATTEMPTS = 5
#: how often start() looks for readiness or an early exit while waiting
POLL_INTERVAL_S = 0.01
STOP_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 8
INSTALL_HINT = "redis-server is not installed: run `make setup` (or `apt-get install redis-server`)"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ready_pid(address: str | tuple[str, int], timeout_s: float) -> int | None:
    """The pid of the Redis answering at address once it accepts commands (AOF loaded), else None.

    The pid tells our server apart from another one already listening on the same port.
    """
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(address)
            sock.sendall(b"INFO\r\n")
            reply = sock.recv(65536)
            if not reply.startswith(b"$"):
                return None
            header, _, body = reply.partition(b"\r\n")
            while len(body) < int(header[1:]):
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                body += chunk
    except (OSError, ValueError, OverflowError):
        return None
    info = dict(
        line.split(":", 1) for line in body.decode(errors="replace").splitlines() if ":" in line
    )
    if info.get("loading") != "0" or not info.get("process_id", "").isdigit():
        return None
    return int(info["process_id"])


class RedisServer(lifetime.ChildHandle):
    """One redis-server child bound to loopback (or a unix socket), with its data in ``work_dir``.

    The server receives SIGTERM when the thread that started it exits (PR_SET_PDEATHSIG), so
    start it from the main thread or a thread that lives as long as the server should.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        unix_socket: bool = True,
        port: int | None = None,
        appendonly: bool = False,
        binary: str = "redis-server",
    ) -> None:
        self.work_dir = Path(work_dir)
        self.unix_socket = unix_socket
        self.appendonly = appendonly
        self.binary = binary
        self.log_path = self.work_dir / "redis.log"
        if port is not None and not 0 < port < 65536:
            raise BadParameter(f"Redis port {port} is not between 1 and 65535")
        self._port_fixed = port is not None
        # With a unix socket and no port asked for, TCP stays off (port 0).
        self._port = port if port is not None else (0 if unix_socket else None)
        self._short_dir: Path | None = None
        self._socket_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # --- addresses ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.unix_socket:
            return f"unix://{self._unix_path()}"
        if not self._port:
            raise SetupError("the Redis server has no port yet: call start() first")
        return f"redis://127.0.0.1:{self._port}/0"

    @property
    def port(self) -> int | None:
        """The TCP port, or None while none is picked (or TCP is off with a unix socket)."""
        return self._port or None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _unix_path(self) -> Path:
        if self._socket_path is None:
            path = self.work_dir.absolute() / "redis.sock"
            if len(os.fsencode(path)) > UNIX_PATH_MAX_BYTES:
                self._short_dir = Path(tempfile.mkdtemp(prefix="tessera-redis-", dir="/tmp"))
                path = self._short_dir / "redis.sock"
            self._socket_path = path
        return self._socket_path

    # --- life cycle ---------------------------------------------------------------------------

    def start(self, timeout_s: float = 10.0) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        if shutil.which(self.binary) is None:
            raise SetupError(INSTALL_HINT, binary=self.binary)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout_s
        for attempt in range(PORT_ATTEMPTS):
            if not self._port_fixed and not self.unix_socket:
                self._port = _free_port()
            if self._launch(deadline):
                return
            # Only a port we picked ourselves may be retried; somebody took it in between.
            if self._port_fixed or self.unix_socket or attempt == PORT_ATTEMPTS - 1:
                break
        raise self._early_exit_error()

    def _command(self) -> list[str]:
        command = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self._port or 0),
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--dir", str(self.work_dir.absolute()),
            "--daemonize", "no",
            "--logfile", str(self.log_path.absolute()),
        ]  # fmt: skip
        if self.unix_socket:
            command += ["--unixsocket", str(self._unix_path()), "--unixsocketperm", "700"]
        return command

    def _launch(self, deadline: float) -> bool:
        """Start the process and wait for PONG; False when it exited before answering."""
        if self.unix_socket:
            self._unix_path().unlink(missing_ok=True)
        address: str | tuple[str, int] = (
            str(self._unix_path()) if self.unix_socket else ("127.0.0.1", self._port or 0)
        )
        # Config errors are printed to stderr before the logfile is opened: keep them in the log.
        with self.log_path.open("ab") as log:
            try:
                self._proc = subprocess.Popen(
                    self._command(),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    preexec_fn=lifetime.die_with_parent(signal.SIGTERM),
                    # Own session: a terminal's Ctrl-C goes to the farm, which stops Redis last.
                    start_new_session=True,
                )
            except FileNotFoundError:
                raise SetupError(INSTALL_HINT, binary=self.binary) from None
        proc = self._proc
        while True:
            if _ready_pid(address, timeout_s=1.0) == proc.pid:
                return True
            try:
                proc.wait(timeout=POLL_INTERVAL_S)
            except subprocess.TimeoutExpired:
                pass
            else:
                return False
            if time.monotonic() > deadline:
                lifetime.stop(proc, STOP_TIMEOUT_S)
                self._proc = None
                raise SetupError(
                    "redis-server did not answer PING in time; see its log",
                    log=str(self.log_path),
                    log_tail=self._log_tail(),
                )

    def _early_exit_error(self) -> SetupError:
        status = self._proc.returncode if self._proc is not None else None
        self._proc = None
        tail = self._log_tail()
        last = " | ".join(tail.splitlines()[-3:]) or "no log output"
        return SetupError(
            f"redis-server exited before it was ready: {last}",
            exit_status=status,
            log=str(self.log_path),
            log_tail=tail,
        )

    def _log_tail(self) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line for line in lines[-LOG_TAIL_LINES:] if line.strip())

    def _stop_process(self) -> None:
        if self._proc is not None:
            # SIGTERM makes Redis shut down cleanly: it fsyncs the AOF and saves nothing
            lifetime.stop(self._proc, STOP_TIMEOUT_S)
            self._proc = None
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Stop the server at once, keeping nothing: for a server whose folder goes next (the
        embedded farm's). SIGTERM's clean stop waits for Redis's next cron tick (up to 100 ms
        at its default hz of 10) and fsyncs an AOF that nobody will read."""
        if self._proc is not None:
            lifetime.stop(self._proc, STOP_TIMEOUT_S, signal.SIGKILL)
            self._proc = None
        self.stop()

    def stop(self) -> None:
        """Stop the server and remove its socket; calling it again does nothing."""
        self._stop_process()
        if self._short_dir is not None:
            with contextlib.suppress(OSError):
                self._short_dir.rmdir()
            self._short_dir = None
            self._socket_path = None

    def restart(self, timeout_s: float = 10.0) -> None:
        """Stop and start again on the same port or socket and data dir (AOF replays on start)."""
        self._stop_process()
        was_fixed = self._port_fixed
        self._port_fixed = True
        try:
            self.start(timeout_s)
        finally:
            self._port_fixed = was_fixed
