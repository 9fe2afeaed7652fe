"""A probe app for latency: it draws, at its own frame clock, a frame counter and the time of the
drawing (epoch microseconds) as the test pattern's stamp (encoder/testpattern.py's layout), so a
viewer reads off the decoded video when each change was made on the X display, by the app and
not by the service; a plain X11 client (python-xlib).

    DISPLAY=:N python -m encoder.timecode [fps]   (default 60)
"""

from __future__ import annotations

import signal
import sys
import time

from Xlib import X, display, error

from encoder.testpattern import BITS_PER_ROW, ORIGIN, SQUARE_PX, stamp_words

BACKGROUND = 0x202020


def cells(counter: int, drawn_us: int) -> tuple[list[tuple[int, int, int, int]], ...]:
    """(set, clear) squares of the stamp as X rectangles."""
    on: list[tuple[int, int, int, int]] = []
    off: list[tuple[int, int, int, int]] = []
    for row, word in enumerate(stamp_words(counter, drawn_us)):
        for bit in range(BITS_PER_ROW):
            square = (
                ORIGIN[0] + bit * SQUARE_PX,
                ORIGIN[1] + row * SQUARE_PX,
                SQUARE_PX,
                SQUARE_PX,
            )
            (on if word >> bit & 1 else off).append(square)
    return on, off


def run(disp: display.Display, fps: int) -> None:
    screen = disp.screen()
    window = screen.root.create_window(
        0, 0, screen.width_in_pixels, screen.height_in_pixels, 0, screen.root_depth,
        X.InputOutput, X.CopyFromParent, background_pixel=BACKGROUND, override_redirect=True,
    )  # fmt: skip
    window.map()
    white = window.create_gc(foreground=screen.white_pixel)
    black = window.create_gc(foreground=screen.black_pixel)
    interval_s = 1.0 / fps
    next_s = time.monotonic()
    counter = 0
    while True:
        on, off = cells(counter, time.time_ns() // 1000)
        window.poly_fill_rectangle(white, on)
        window.poly_fill_rectangle(black, off)
        # sync, not flush: the drawing is on the display when the next frame's time is taken
        disp.sync()
        counter += 1
        next_s += interval_s
        delay_s = next_s - time.monotonic()
        if delay_s < -interval_s:
            next_s = time.monotonic()  # fell behind: skip ahead instead of bursting
        elif delay_s > 0:
            time.sleep(delay_s)  # the app's frame clock


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    try:
        run(display.Display(), fps)
    except (error.ConnectionClosedError, error.DisplayError):
        return 0  # the session's display went away: so does the app
    return 0


if __name__ == "__main__":
    sys.exit(main())
