"""A session display's size following its viewer: the X screen resized with RandR (up to the
framebuffer Xvfb was started with), and the capture reopened at the new size."""

from __future__ import annotations

import logging
import time
from typing import Any

from Xlib import display, error
from Xlib.ext import randr

from encoder.capture import X11Grabber
from farm.errors import SourceFailed

log = logging.getLogger("tessera.stream")

#: the physical size Xvfb reports at its default 96 dpi, in mm per pixel
MM_PER_PX = 25.4 / 96


def largest(width: int, height: int, max_width: int, max_height: int) -> tuple[int, int]:
    """The framebuffer a display is started with: the session's size or the resize limit,
    whichever is larger on each side (a session is never smaller than it asked)."""
    return max(width, max_width), max(height, max_height)


def set_screen_size(disp: display.Display, width: int, height: int) -> None:
    """Make the X screen of ``disp`` ``width`` x ``height`` (its one output gets that mode).

    Apps see the root window's ConfigureNotify, as on a monitor change. Raises SourceFailed
    where the server has no RandR or the size is above its framebuffer.
    """
    if not disp.has_extension("RANDR"):
        raise SourceFailed("the X display has no RandR: it cannot be resized")
    root = disp.screen().root
    try:
        limits = randr.get_screen_size_range(root)
        if not (
            limits.min_width <= width <= limits.max_width
            and limits.min_height <= height <= limits.max_height
        ):
            raise SourceFailed(
                f"{width}x{height} is outside the display's {limits.max_width}x{limits.max_height}"
            )
        res = randr.get_screen_resources(root)
        output, crtc = res.outputs[0], res.crtcs[0]
        mode = _mode(disp, root, res, output, width, height)
        now = disp.screen()
        # the screen must hold the CRTC at every step: grow it first, shrink it last
        grown = (max(width, now.width_in_pixels), max(height, now.height_in_pixels))
        if grown != (now.width_in_pixels, now.height_in_pixels):
            _screen(root, *grown)
        randr.set_crtc_config(
            disp, crtc, res.config_timestamp, 0, 0, mode, randr.Rotate_0, [output]
        )
        if grown != (width, height):
            _screen(root, width, height)
        disp.sync()
    except error.XError as exc:
        raise SourceFailed(
            f"the X display could not be resized to {width}x{height}: {exc}"
        ) from exc


def _screen(root: Any, width: int, height: int) -> None:
    randr.set_screen_size(root, width, height, round(width * MM_PER_PX), round(height * MM_PER_PX))


def _mode(disp: display.Display, root: Any, res: Any, output: int, width: int, height: int) -> int:
    """The RandR mode of that size on ``output``, created and added the first time."""
    for info in res.modes:
        if (info.width, info.height) == (width, height):
            mode = int(info.id)
            break
    else:
        name = f"{width}x{height}"
        info = {
            "id": 0, "width": width, "height": height, "dot_clock": 0,
            "h_sync_start": 0, "h_sync_end": 0, "h_total": width, "h_skew": 0,
            "v_sync_start": 0, "v_sync_end": 0, "v_total": height,
            "name_length": len(name), "flags": 0,
        }  # fmt: skip
        mode = int(randr.create_mode(root, info, name).mode)
    if mode not in randr.get_output_info(disp, output, res.config_timestamp).modes:
        randr.add_output_mode(disp, output, mode)
    return mode


def open_screen(name: str, width: int, height: int) -> None:
    """Resize the screen of display ``name`` (a connection of its own, closed again)."""
    try:
        disp = display.Display(name)
    except (error.DisplayError, error.ConnectionClosedError, OSError) as exc:
        raise SourceFailed(f"cannot open X display {name} to resize it: {exc}") from exc
    try:
        set_screen_size(disp, width, height)
    finally:
        disp.close()


class ResizingGrabber(X11Grabber):
    """x11grab of a display whose size may change: ``resize`` ends the current grab and the
    next one opens at the new size (the frame slot, and so the encoder, carry on)."""

    #: how long after a resize began a failed grab is taken for the resize's doing, s
    RESIZE_SETTLE_S = 2.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reopen = False
        self._resizing_since = -self.RESIZE_SETTLE_S

    @property
    def stopping(self) -> bool:
        # the grab loop of X11Grabber ends on this; a resize ends it too, and run() reopens
        return self._stop.is_set() or self._reopen

    def expect_resize(self) -> None:
        """The screen is about to change size: a grab it breaks meanwhile is reopened, not
        taken for a capture error (x11grab answers EACCES when its area leaves the screen)."""
        self._resizing_since = time.monotonic()

    def resize(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self._resizing_since = time.monotonic()
        self._reopen = True

    def run(self) -> None:
        while not self._stop.is_set():
            self._reopen = False
            try:
                super().run()
            except (OSError, ValueError) as exc:
                # the screen shrank under a grab of the old size (x11grab: EACCES) or is not
                # yet the size opened (EINVAL): try again at the size asked, while the resize
                # settles
                if time.monotonic() - self._resizing_since > self.RESIZE_SETTLE_S:
                    raise
                log.info("event=capture_reopen display=%s reason=%r", self.display, str(exc))
                self._stop.wait(0.05)
                self._reopen = True
            # what ``before`` did (joining the sandbox's IPC namespace) holds for this thread
            self.before = None
            if self._reopen:
                log.info("event=capture_resized display=%s size=%dx%d", self.display,
                         self.width, self.height)  # fmt: skip
