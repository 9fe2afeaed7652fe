"""A test app that says what it receives, over the display's clipboard: text pasted to it comes
back as ``echo:<text>`` (after writing a file in its home for ``file:<name>=<text>``, or a
link for ``link:<name>=<target>``), and a new screen size (RandR) as
``size:<width>x<height>``.

It also fills its screen with one colour, so the video shows where the screen ends. Run it
with ``python -m encoder.probeapp`` and DISPLAY set.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from Xlib import X, display, error

from encoder.clipboard import Clipboard

#: what the app copies starts with one of these (it never echoes its own reports)
REPORTS = ("echo:", "size:")
BACKGROUND = 0x2050A0


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
