"""The built-in game: a green square on a dark field that arrow keys or WASD move, a mouse
click places, and a gamepad's d-pad or left stick steers while held; a plain X11 client
(python-xlib), run in a session's display as its own process.

The pad is the session's first (``/dev/input/js0``, the joystick API), from whichever of uinput
or the pad shim makes it (encoder/gamepad.py); plugged in at any time, unplugged when its
node goes.

Run it with ``python -m encoder.game`` (or this file) and DISPLAY set.
"""

from __future__ import annotations

import select
import signal
import sys
import time
from pathlib import Path
from typing import Any

from Xlib import XK, X, display, error

from encoder.gamepad import JsReader

#: colours as 24-bit TrueColor pixels: the tests find the sprite by its pure green
BACKGROUND = 0x141C28
SPRITE = 0x00FF00
SPRITE_PX = 32
STEP_PX = 24

_MOVES = {
    XK.XK_Left: (-1, 0), XK.XK_a: (-1, 0), XK.XK_A: (-1, 0),
    XK.XK_Right: (1, 0), XK.XK_d: (1, 0), XK.XK_D: (1, 0),
    XK.XK_Up: (0, -1), XK.XK_w: (0, -1), XK.XK_W: (0, -1),
    XK.XK_Down: (0, 1), XK.XK_s: (0, 1), XK.XK_S: (0, 1),
}  # fmt: skip

#: the pad the game reads, and how often it looks for one while none is plugged in
PAD = Path("/dev/input/js0")
PAD_LOOK_S = 0.5
#: the axes that steer (the kernel's numbering of the virtual pad: left stick 0/1, hat 6/7)
STICK_X, STICK_Y, HAT_X, HAT_Y = 0, 1, 6, 7
#: a stick past half way steers; a held direction moves the sprite this far per tick
STICK_DEAD = 16384
PAD_STEP_PX = 6
PAD_TICK_S = 1 / 30


def direction(pad: JsReader | None) -> tuple[int, int]:
    """Which way ``pad`` steers now: its d-pad, else its left stick past half way."""
    if pad is None:
        return 0, 0

    def steer(stick: int, hat: int) -> int:
        value = pad.axes.get(hat, 0) or pad.axes.get(stick, 0)
        return (value > STICK_DEAD) - (value < -STICK_DEAD)

    return steer(STICK_X, HAT_X), steer(STICK_Y, HAT_Y)


class Game:
    def __init__(self, disp: display.Display) -> None:
        self.disp = disp
        screen = disp.screen()
        self.width, self.height = screen.width_in_pixels, screen.height_in_pixels
        self.window = screen.root.create_window(
            0, 0, self.width, self.height, 0, screen.root_depth,
            X.InputOutput, X.CopyFromParent,
            background_pixel=BACKGROUND,
            override_redirect=True,
            event_mask=X.ExposureMask | X.KeyPressMask | X.ButtonPressMask
            | X.StructureNotifyMask,
        )  # fmt: skip
        self.window.set_wm_name("Tessera game")
        self.sprite_gc = self.window.create_gc(foreground=SPRITE)
        self.clear_gc = self.window.create_gc(foreground=BACKGROUND)
        self.x = (self.width - SPRITE_PX) // 2
        self.y = (self.height - SPRITE_PX) // 2

    def move_to(self, x: int, y: int) -> None:
        x = max(0, min(self.width - SPRITE_PX, x))
        y = max(0, min(self.height - SPRITE_PX, y))
        if (x, y) == (self.x, self.y):
            return
        self.window.fill_rectangle(self.clear_gc, self.x, self.y, SPRITE_PX, SPRITE_PX)
        self.x, self.y = x, y
        self.draw()

    def draw(self) -> None:
        self.window.fill_rectangle(self.sprite_gc, self.x, self.y, SPRITE_PX, SPRITE_PX)
        self.disp.flush()

    def run(self) -> None:
        self.window.map()
        self.disp.flush()
        pad: JsReader | None = None
        looked = moved = 0.0
        while True:
            now = time.monotonic()
            if pad is None and now - looked >= PAD_LOOK_S:
                looked, pad = now, JsReader.open(PAD)
            dx, dy = direction(pad)
            steering = (dx, dy) != (0, 0)
            if steering and now - moved >= PAD_TICK_S:
                moved = now
                self.move_to(self.x + dx * PAD_STEP_PX, self.y + dy * PAD_STEP_PX)
            # X events as they come; the pad's while it steers, or a look for one meanwhile
            wait_s = PAD_TICK_S if steering else PAD_LOOK_S if pad is None else None
            fds = [self.disp.fileno()] + ([pad.fd] if pad is not None else [])
            if not self.disp.pending_events():
                ready, _, _ = select.select(fds, [], [], wait_s)
                if pad is not None and pad.fd in ready and not pad.read():
                    pad.close()
                    pad = None
            while self.disp.pending_events():
                self._handle(self.disp.next_event())

    def _handle(self, event: Any) -> None:
        if event.type == X.MapNotify:
            # no window manager gives us the keyboard: take it
            self.window.set_input_focus(X.RevertToParent, X.CurrentTime)
            self.draw()
        elif event.type == X.Expose and event.count == 0:
            self.draw()
        elif event.type == X.KeyPress:
            keysym = self.disp.keycode_to_keysym(event.detail, 0)
            dx, dy = _MOVES.get(keysym, (0, 0))
            self.move_to(self.x + dx * STEP_PX, self.y + dy * STEP_PX)
        elif event.type == X.ButtonPress and event.detail == 1:
            self.move_to(event.event_x - SPRITE_PX // 2, event.event_y - SPRITE_PX // 2)


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        Game(display.Display()).run()
    except (error.ConnectionClosedError, error.DisplayError):
        # the session's display went away: so does the game
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
