"""A test app that says what it receives, over the display's clipboard: text pasted to it comes
back as ``echo:<text>`` (after writing a file in its home for ``file:<name>=<text>``, or a
link for ``link:<name>=<target>``), a new screen size (RandR) as ``size:<width>x<height>``,
and its first gamepad (``/dev/input/js0``, read with the joystick API, from whichever of the
kernel or the pad shim makes it) as ``pad:buttons=<pressed>;axes=<values>`` on each change.

It also fills its screen with one colour, so the video shows where the screen ends. Run it
with ``python -m encoder.probeapp`` and DISPLAY set.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from Xlib import X, display, error

from encoder.clipboard import Clipboard
from encoder.gamepad import JsReader

#: what the app copies starts with one of these (it never echoes its own reports)
REPORTS = ("echo:", "size:", "pad:")
BACKGROUND = 0x2050A0
#: the pad the app reads
PAD = Path("/dev/input/js0")


def watch_pad(report: Callable[[str], None]) -> None:
    """Once the pad is plugged in, report its whole state each time it changes."""
    while (pad := JsReader.open(PAD, blocking=True)) is None:
        time.sleep(0.1)
    while pad.read():
        pressed = ",".join(str(n) for n, value in sorted(pad.buttons.items()) if value)
        axes = ",".join(str(value) for _, value in sorted(pad.axes.items()))
        report(f"pad:buttons={pressed};axes={axes}")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        disp = display.Display()
        screen = disp.screen()
        clipboard: Clipboard | None = None

        def heard(text: str) -> None:
            if clipboard is None or text.startswith(REPORTS):
                return
            command, _, arg = text.partition(":")
            name, _, value = arg.partition("=")
            # "file:NAME=TEXT" writes a file in the app's home, "link:NAME=TARGET" a link there
            if command == "file" and name:
                (Path.home() / name).write_text(value)
            elif command == "link" and name:
                (Path.home() / name).symlink_to(value)
            clipboard.paste(f"echo:{text}")

        clipboard = Clipboard(disp.get_display_name(), heard, name="probe-clipboard").start()
        threading.Thread(target=watch_pad, args=(clipboard.paste,), daemon=True).start()
        root = screen.root
        root.change_attributes(event_mask=X.StructureNotifyMask)
        window = root.create_window(
            0, 0, 3840, 2160, 0, screen.root_depth, X.InputOutput, X.CopyFromParent,
            background_pixel=BACKGROUND, override_redirect=True,
        )  # fmt: skip
        window.map()
        disp.flush()
        size = (screen.width_in_pixels, screen.height_in_pixels)
        while True:
            ev = disp.next_event()
            configured = ev.type == X.ConfigureNotify and ev.window.id == root.id
            if configured and (ev.width, ev.height) != size:
                size = (ev.width, ev.height)
                clipboard.paste(f"size:{ev.width}x{ev.height}")
    except (error.ConnectionClosedError, error.DisplayError):
        # the session's display went away: so does the app
        return 0


if __name__ == "__main__":
    sys.exit(main())
