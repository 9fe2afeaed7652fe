"""A session's Xvfb and app together in one sandbox instance (farm/sandbox.py), reached by the
service only through the display's own X socket.

Inside, Xvfb listens on ``/tmp/.X11-unix/X<N>``, a folder bound from a host folder of the
session's own; the host name ``/tmp/.X11-unix/X<N>`` is a link to it, so the service's capture
(x11grab) and input (XTest) connect with ``DISPLAY=:N`` like to any display. The sandbox has its
own network namespace, so Xvfb's abstract socket is out of everyone else's reach, and its own
/tmp, so no other session's socket folder is there. ``N`` is held by an X lock file
(``/tmp/.X<N>-lock``, as X servers do) for the session's life.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from encoder import audio, gamepad
from encoder.catalog import App
from encoder.display import APP_MARK
from encoder.resize import largest, open_screen
from farm import sandbox
from farm.errors import SourceFailed
from farm.sandbox import Limits, Sandboxed, SandboxSpec
from farm.settings import Settings

log = logging.getLogger("tessera.stream")

#: the host's folder of X sockets (X clients look for display N here)
X11_DIR = Path("/tmp/.X11-unix")
#: where the app finds input devices (its virtual gamepads)
INPUT_DIR = Path("/dev/input")
#: the service's folder of sessions' X socket folders (its own; mode 0700)
SOCKETS = Path(tempfile.gettempdir()) / f"tessera-x11-{os.geteuid()}"
#: display numbers sandboxed sessions take, above what a desktop or `xvfb-run` would use
FIRST_DISPLAY, LAST_DISPLAY = 100, 999
#: how long Xvfb may take to announce its display number
START_TIMEOUT_S = 10.0
#: the sandbox's first program: Xvfb in the background (it writes N on stdout once it serves),
#: the session's sound server where $PULSE_SOCKET is set (encoder/audio.py), then, once the
#: service answers on stdin, the app with the session's stdio closed; "missing" on stdout
#: where the app's program is not in the sandbox
LAUNCHER = (
    'command -v "$3" >/dev/null || { echo missing; exit 127; }; '
    f'[ -z "$PULSE_SOCKET" ] || {audio.SERVER} </dev/null >/dev/null 2>&1 & '
    'Xvfb ":$1" -displayfd 1 -screen 0 "$2" -nolisten tcp -nolisten local -noreset '
    "+extension XTEST -ac </dev/null 2>/dev/null & "
    'exec >/dev/null; read -r _; shift 2; exec "$@" </dev/null'
)


MISSING = b"missing\n"


def limits(settings: Settings, app: App) -> Limits:
    """The app's own limits where its catalog entry gives them, else the settings'."""
    return Limits(
        memory_mib=settings.stream_memory_mib if app.memory_mib is None else app.memory_mib,
        pids=settings.stream_pids if app.pids is None else app.pids,
        cpu_cores=settings.stream_cpu_cores if app.cpu_cores is None else app.cpu_cores,
    )


def session_spec(
    settings: Settings,
    app: App,
    x11_dir: Path,
    display: int,
    name: str,
    home: Path | None = None,
    input_dir: Path | None = None,
) -> SandboxSpec:
    """The sandbox a session's display and app run in (the security tests run probes in it);
    ``home``, a host folder, is its home folder (the session's files come and go there). With
    sound (the app's ``audio`` and FARM_STREAM_AUDIO) its pulse server's socket is in the X
    socket folder and the app finds it through PULSE_SERVER. ``input_dir``, a host folder only
    the service writes, is the sandbox's ``/dev/input``: the service puts a virtual gamepad's
    device nodes there when the controlling viewer plugs one in (encoder/gamepad.py)."""
    ro = sandbox.runtime_binds("encoder")
    if app.network:
        ro += sandbox.network_binds()
    rw: tuple[tuple[Path, Path], ...] = ((x11_dir, X11_DIR),)
    if home is not None:
        rw += ((home, sandbox.HOME),)
    env = {"DISPLAY": f":{display}", APP_MARK: str(os.getpid()), **_pulse_env(settings, app)}
    if input_dir is not None:
        # no udev in the sandbox: SDL finds pads by watching /dev/input itself
        env["SDL_JOYSTICK_DISABLE_UDEV"] = "1"
        if gamepad.SHIM.is_file():
            # the pads of a host without uinput are sockets the shim opens as their nodes
            env["LD_PRELOAD"] = str(gamepad.SHIM)
    return SandboxSpec(
        name=name,
        ro_binds=ro,
        rw_binds=rw,
        device_dirs=((input_dir, INPUT_DIR),) if input_dir is not None else (),
        env=env,
        network=app.network,
        limits=limits(settings, app),
        uid=settings.sandbox_uid,
        gid=settings.sandbox_gid,
    )


def has_audio(settings: Settings, app: App) -> bool:
    return app.audio and settings.stream_audio != 0


def _pulse_env(settings: Settings, app: App) -> dict[str, str]:
    if not has_audio(settings, app):
        return {}
    sock = X11_DIR / audio.SOCKET_NAME
    return {
        "PULSE_SOCKET": str(sock),
        "PULSE_SERVER": f"unix:{sock}",
        "PULSE_RUNTIME_PATH": "/tmp/pulse-runtime",
    }


def _claim_display() -> tuple[int, Path]:
    """A display number free on the host, held by its X lock file (created exclusively)."""
    X11_DIR.mkdir(mode=0o1777, exist_ok=True)
    for number in range(FIRST_DISPLAY, LAST_DISPLAY + 1):
        lock, link = Path(f"/tmp/.X{number}-lock"), X11_DIR / f"X{number}"
        if _stale(lock):
            # left by a service that died: its sandbox died with it
            for path in (link, lock):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if link.exists() or link.is_symlink():
            continue
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid():10d}\n")
        return number, lock
    raise SourceFailed(f"no free X display number from {FIRST_DISPLAY} to {LAST_DISPLAY}")


def _stale(lock: Path) -> bool:
    """The X lock file names a process that is gone (an X server's or a dead service's)."""
    try:
        pid = int(lock.read_text().strip())
    except (OSError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class SandboxedApp:
    """Xvfb plus the app of one session in one sandbox; ``proc`` ends when the app does."""

    def __init__(self, settings: Settings, app: App, name: str, home: Path | None = None) -> None:
        self.settings, self.app, self.name = settings, app, name
        #: the home folder a restarted session hands on (its files stay), else made at start
        self._given_home = home
        self.number: int | None = None
        self.box: Sandboxed | None = None
        self._lock: Path | None = None
        self._dir: Path | None = None
        self._link: Path | None = None
        #: the session's home folder on the host (owned by the sandbox's uid), once started
        self.home: Path | None = None
        #: the host folder that is the sandbox's /dev/input (the service's own: the app may
        #: read its device nodes, never add or replace one), once started
        self.input_dir: Path | None = None
        #: the largest the display may be resized to (Xvfb's framebuffer)
        self.framebuffer = largest(
            app.width, app.height, settings.stream_resize_max_width,
            settings.stream_resize_max_height,
        )  # fmt: skip

    @property
    def display(self) -> str:
        if self.number is None:
            raise SourceFailed("the X display is not running")
        return f":{self.number}"

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        if self.box is None:
            raise SourceFailed("the app is not running")
        return self.box.proc

    def spec(self) -> SandboxSpec:
        assert self._dir is not None and self.number is not None
        return session_spec(
            self.settings, self.app, self._dir, self.number, self.name, self.home, self.input_dir
        )

    def start(self) -> None:
        try:
            self.number, self._lock = _claim_display()
            # a root-only parent keeps host users other than the service off the socket
            SOCKETS.mkdir(mode=0o700, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=SOCKETS))
            homes = self.settings.work_dir / "stream-homes"
            homes.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.home = self._given_home or Path(
                tempfile.mkdtemp(prefix=f"{self.name}-", dir=homes)
            )
            self.input_dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-input-", dir=SOCKETS))
            self.input_dir.chmod(0o755)
            spec = self.spec()
            sandbox.owned_dir(self._dir, spec)
            sandbox.owned_dir(self.home, spec)
            self._link = X11_DIR / f"X{self.number}"
            self._link.symlink_to(self._dir / f"X{self.number}")
            ready_r, ready_w = os.pipe()
            go_r, go_w = os.pipe()
            try:
                size = "{}x{}x24".format(*self.framebuffer)
                argv = ["/bin/sh", "-c", LAUNCHER, "launcher", str(self.number), size]
                self.box = sandbox.spawn(
                    self.settings, spec, [*argv, *self.app.command],
                    stdin=go_r, stdout=ready_w, stderr=subprocess.DEVNULL,
                )  # fmt: skip
                os.close(ready_w)
                ready_w = -1
                self._await_display(ready_r)
                if self.pulse_socket is not None:
                    # the app's first sound must find the server
                    audio.wait_for_socket(self.pulse_socket, self.box.proc)
                if self.framebuffer != (self.app.width, self.app.height):
                    # the app starts on a screen of the session's size, not the framebuffer's
                    open_screen(self.display, self.app.width, self.app.height)
                os.write(go_w, b"go\n")
            finally:
                for fd in (ready_r, ready_w, go_r, go_w):
                    if fd >= 0:
                        os.close(fd)
        except OSError as exc:
            self.stop()
            raise SourceFailed(f"app {self.app.name} could not start: {exc}") from exc
        except BaseException:
            self.stop()
            raise
        log.info("event=app_started app=%s display=%s sandbox=%s pid=%d", self.app.name,
                 self.display, self.box.name, self.box.pid)  # fmt: skip

    def _await_display(self, fd: int) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        data = b""
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise SourceFailed("Xvfb did not start in the sandbox (no display announced)")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 64)
                if not chunk:
                    raise SourceFailed("Xvfb exited in the sandbox before serving its display")
                data += chunk
        if data == MISSING:
            raise SourceFailed(
                f"app {self.app.name} could not start ({self.app.command[0]}): no such program "
                "in its sandbox",
                app=self.app.name,
            )
        if int(data.strip()) != self.number:
            raise SourceFailed(f"Xvfb took display {data.strip()!r}, not :{self.number}")

    @property
    def pulse_socket(self) -> Path | None:
        """The host path of the session's sound server's socket (None: no sound)."""
        if self._dir is None or not has_audio(self.settings, self.app):
            return None
        return self._dir / audio.SOCKET_NAME

    def pids(self) -> list[int]:
        return self.box.pids() if self.box is not None else []

    def join_ipc(self) -> None:
        """Join this thread to the sandbox's IPC namespace (x11grab's MIT-SHM then works:
        without it every frame is copied through the X socket, several times the CPU)."""
        path = self.box.ipc_namespace() if self.box is not None else None
        if path is None:
            log.warning("event=capture_without_shm app=%s reason=no_ipc_namespace", self.app.name)
            return
        try:
            sandbox.join_ipc_namespace(path)
        except OSError as exc:
            log.warning("event=capture_without_shm app=%s error=%s", self.app.name, exc)

    def stop(self, keep_home: bool = False) -> None:
        """Kill every process of the sandbox and free the display; safe to call twice.

        ``keep_home``: the home folder stays, with the user's and the app's files (a restart
        hands it to the next sandbox); a later plain stop still removes it."""
        if self.box is not None:
            self.box.close()
        for path in (self._link, self._lock):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        for folder in (self._dir, None if keep_home else self.home, self.input_dir):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._link = self._lock = self._dir = self.input_dir = None
        if not keep_home:
            self.home = None
        self.number = None
