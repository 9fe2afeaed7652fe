"""A session's picture source: an app in its own X display (captured with x11grab, driven
with XTest), or the test pattern; everything it starts dies with it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from encoder.appbox import SandboxedApp
from encoder.audio import AudioFeed, PulseCapture
from encoder.capture import FrameSlot, Grabber, PatternGrabber
from encoder.catalog import App
from encoder.display import APP_MARK, XDisplay
from encoder.resize import ResizingGrabber, largest, open_screen
from encoder.xinput import XInput
from farm.errors import SourceFailed
from farm.lifetime import die_with_parent
from farm.settings import Settings

__all__ = ["APP_MARK", "PatternSource", "SandboxedSource", "Source", "XAppSource", "make_source"]

log = logging.getLogger("tessera.stream")

#: how long an app may take to quit after SIGTERM before its whole group is killed
APP_STOP_GRACE_S = 3.0


class Source:
    """What a session captures from; ``input`` is None where there is nothing to drive."""

    input_format = "yuv420p"

    def __init__(self, app: App) -> None:
        self.app = app
        self.slot = FrameSlot()
        self.input: XInput | None = None
        self.grabber: Grabber | None = None

    def start(self, on_exit: Callable[[str], None]) -> None:
        raise NotImplementedError

    def stop(self, keep_home: bool = False) -> None:
        """Stop everything the source started. ``keep_home``: leave the session's home folder
        (a restart hands it to the next source; sources without one ignore it)."""
        raise NotImplementedError

    def pids(self) -> list[int]:
        """The processes this source started (the tests check none outlives the session)."""
        return []

    @property
    def home(self) -> Path | None:
        """The session's home folder on the host, where files are exchanged (None: none)."""
        return None

    @property
    def pad_devices(self) -> tuple[Path, int, int] | None:
        """Where a virtual gamepad's device nodes go for the app to see them, and the uid and
        gid to own them (None: the app sees the host's /dev/input, or no display at all)."""
        return None

    @property
    def has_audio(self) -> bool:
        """The app plays into a sound server of the session's (start_audio captures it)."""
        return False

    def start_audio(self, feed: AudioFeed) -> None:
        """Capture the app's sound into ``feed`` (once started, where ``has_audio``)."""
        raise NotImplementedError

    def resize(self, width: int, height: int) -> tuple[int, int] | None:
        """Make the display ``width`` x ``height`` (within its framebuffer); the size it now
        has, or None where there is no display to resize (the encoder scales the video)."""
        return None


def _resize_display(
    name: str, grabber: Grabber | None, framebuffer: tuple[int, int], width: int, height: int
) -> tuple[int, int]:
    width, height = min(width, framebuffer[0]), min(height, framebuffer[1])
    if isinstance(grabber, ResizingGrabber):
        grabber.expect_resize()
    open_screen(name, width, height)
    if isinstance(grabber, ResizingGrabber):
        grabber.resize(width, height)
    return width, height


class PatternSource(Source):
    def start(self, on_exit: Callable[[str], None]) -> None:
        self.grabber = PatternGrabber(self.slot, self.app.width, self.app.height, self.app.fps)

    def stop(self, keep_home: bool = False) -> None:
        if self.grabber is not None:
            self.grabber.stop()


class XAppSource(Source):
    """Xvfb at the app's size, the app's command inside it in its own process group."""

    input_format = "bgr0"

    def __init__(self, app: App, framebuffer: tuple[int, int] | None = None) -> None:
        super().__init__(app)
        self.framebuffer = framebuffer or (app.width, app.height)
        self.display = XDisplay(app.width, app.height, self.framebuffer)
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def start(self, on_exit: Callable[[str], None]) -> None:
        try:
            self.display.start()
            # the service's pid marks the app and everything it starts as this service's
            env = {**os.environ, "DISPLAY": self.display.name, APP_MARK: str(os.getpid())}
            env.pop("WAYLAND_DISPLAY", None)
            try:
                self.proc = subprocess.Popen(
                    list(self.app.command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=die_with_parent(signal.SIGKILL),
                )
            except OSError as exc:
                raise SourceFailed(
                    f"app {self.app.name} could not start ({self.app.command[0]}): {exc.strerror}",
                    app=self.app.name,
                ) from exc
            threading.Thread(
                target=self._watch, args=(self.proc, on_exit), name="app-watch", daemon=True
            ).start()
            self.input = XInput(self.display.name)
            self.grabber = ResizingGrabber(
                self.slot, self.display.name, self.app.width, self.app.height, self.app.fps
            )
        except BaseException:
            self.stop()
            raise
        log.info("event=app_started app=%s display=%s pid=%d", self.app.name, self.display.name,
                 self.proc.pid)  # fmt: skip

    def _watch(self, proc: subprocess.Popen[bytes], on_exit: Callable[[str], None]) -> None:
        code = proc.wait()
        if not self._stopping:
            on_exit(f"app {self.app.name} exited with status {code}")

    def stop(self, keep_home: bool = False) -> None:
        self._stopping = True
        if self.grabber is not None:
            self.grabber.stop()
        if self.input is not None:
            self.input.close()
            self.input = None
        if self.proc is not None:
            _stop_group(self.proc)
        self.display.stop()

    def pids(self) -> list[int]:
        return [p for p in (self.display.pid, self.proc.pid if self.proc else None) if p]

    def resize(self, width: int, height: int) -> tuple[int, int] | None:
        return _resize_display(self.display.name, self.grabber, self.framebuffer, width, height)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the app's whole process group (a desktop is several programs), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(APP_STOP_GRACE_S)
            # the leader is gone; stragglers of its group get the same signal once more
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


class SandboxedSource(Source):
    """Xvfb and the app in one sandbox (encoder/appbox.py): the app's own uid, files, network
    and limits; the service captures and injects input through the display's socket only."""

    input_format = "bgr0"

    def __init__(self, app: App, settings: Settings, name: str, home: Path | None = None) -> None:
        super().__init__(app)
        self.box = SandboxedApp(settings, app, name, home)
        self._stopping = False
        self.audio: PulseCapture | None = None

    def start(self, on_exit: Callable[[str], None]) -> None:
        try:
            self.box.start()
            threading.Thread(
                target=self._watch, args=(self.box.proc, on_exit), name="app-watch", daemon=True
            ).start()
            self.input = XInput(self.box.display)
            self.grabber = ResizingGrabber(
                self.slot, self.box.display, self.app.width, self.app.height, self.app.fps,
                before=self.box.join_ipc,
            )  # fmt: skip
        except BaseException:
            self.stop()
            raise

    def _watch(self, proc: subprocess.Popen[bytes], on_exit: Callable[[str], None]) -> None:
        code = proc.wait()
        if not self._stopping:
            on_exit(f"app {self.app.name} exited with status {code}")

    @property
    def has_audio(self) -> bool:
        return self.box.pulse_socket is not None

    def start_audio(self, feed: AudioFeed) -> None:
        socket = self.box.pulse_socket
        assert socket is not None
        self.audio = PulseCapture(socket, feed)

    def stop(self, keep_home: bool = False) -> None:
        self._stopping = True
        if self.grabber is not None:
            self.grabber.stop()
        if self.audio is not None:
            self.audio.stop()
            self.audio = None
        if self.input is not None:
            self.input.close()
            self.input = None
        self.box.stop(keep_home)

    def pids(self) -> list[int]:
        return self.box.pids()

    def resize(self, width: int, height: int) -> tuple[int, int] | None:
        return _resize_display(self.box.display, self.grabber, self.box.framebuffer, width, height)

    @property
    def home(self) -> Path | None:
        return self.box.home

    @property
    def pad_devices(self) -> tuple[Path, int, int] | None:
        folder, settings = self.box.input_dir, self.box.settings
        return None if folder is None else (folder, settings.sandbox_uid, settings.sandbox_gid)


def make_source(
    app: App, settings: Settings | None = None, name: str = "session", home: Path | None = None
) -> Source:
    """The source of ``app``: sandboxed unless FARM_SANDBOX=none (or no settings: tests of
    parts that start a display of the service's own); ``home``: a restarted session's home
    folder, kept."""
    if not app.needs_display:
        return PatternSource(app)
    if settings is None:
        return XAppSource(app)
    framebuffer = largest(
        app.width, app.height, settings.stream_resize_max_width, settings.stream_resize_max_height
    )
    if settings.sandbox == "none":
        return XAppSource(app, framebuffer)
    return SandboxedSource(app, settings, name, home)
