"""Input injection into a session's X display with XTest: pointer, buttons, wheel, keys by DOM
``KeyboardEvent.code``."""

from __future__ import annotations

import logging

from Xlib import XK, X, display, error
from Xlib.ext import xtest

from farm.errors import SourceFailed

log = logging.getLogger("tessera.stream")

#: DOM codes that are not a letter, digit or F-key, and the X keysym each presses
_NAMED = {
    "ArrowLeft": "Left", "ArrowRight": "Right", "ArrowUp": "Up", "ArrowDown": "Down",
    "Enter": "Return", "NumpadEnter": "KP_Enter", "Escape": "Escape", "Space": "space",
    "Backspace": "BackSpace", "Tab": "Tab", "Delete": "Delete", "Insert": "Insert",
    "Home": "Home", "End": "End", "PageUp": "Prior", "PageDown": "Next",
    "ShiftLeft": "Shift_L", "ShiftRight": "Shift_R", "ControlLeft": "Control_L",
    "ControlRight": "Control_R", "AltLeft": "Alt_L", "AltRight": "Alt_R",
    "MetaLeft": "Super_L", "MetaRight": "Super_R", "CapsLock": "Caps_Lock",
    "Minus": "minus", "Equal": "equal", "BracketLeft": "bracketleft",
    "BracketRight": "bracketright", "Backslash": "backslash", "Semicolon": "semicolon",
    "Quote": "apostrophe", "Backquote": "grave", "Comma": "comma", "Period": "period",
    "Slash": "slash", "ContextMenu": "Menu",
}  # fmt: skip

#: X pointer buttons of a wheel step: up, down, left, right
_WHEEL = {(0, -1): 4, (0, 1): 5, (-1, 0): 6, (1, 0): 7}


def keysym_name(code: str) -> str | None:
    """The X keysym name a DOM ``KeyboardEvent.code`` presses (layout-independent), or None."""
    if code.startswith("Key") and len(code) == 4 and code[3].isalpha():
        return code[3].lower()
    if code.startswith("Digit") and len(code) == 6 and code[5].isdigit():
        return code[5]
    if code.startswith("Numpad") and len(code) == 7 and code[6].isdigit():
        return f"KP_{code[6]}"
    if code.startswith("F") and code[1:].isdigit() and 1 <= int(code[1:]) <= 24:
        return code
    return _NAMED.get(code)


class XInput:
    """XTest on one display; remembers what is held so it can let go of everything at once."""

    def __init__(self, display_name: str) -> None:
        try:
            self.disp = display.Display(display_name)
        except (error.DisplayError, error.ConnectionClosedError, OSError) as exc:
            raise SourceFailed(f"cannot open X display {display_name} for input: {exc}") from exc
        if not self.disp.has_extension("XTEST"):
            self.disp.close()
            raise SourceFailed(f"X display {display_name} has no XTEST extension")
        self.held_keys: set[int] = set()
        self.held_buttons: set[int] = set()

    def _send(self, event_type: int, detail: int = 0, x: int = 0, y: int = 0) -> None:
        xtest.fake_input(self.disp, event_type, detail, x=x, y=y)
        self.disp.flush()

    def move(self, x: int, y: int) -> None:
        self._send(X.MotionNotify, x=x, y=y)

    def button(self, button: int, down: bool) -> None:
        if button not in (1, 2, 3):
            return
        self._send(X.ButtonPress if down else X.ButtonRelease, button)
        (self.held_buttons.add if down else self.held_buttons.discard)(button)

    def wheel(self, dx: int, dy: int) -> None:
        for axis in ((0, (dy > 0) - (dy < 0)), ((dx > 0) - (dx < 0), 0)):
            button = _WHEEL.get(axis)
            if button is not None:
                self._send(X.ButtonPress, button)
                self._send(X.ButtonRelease, button)

    def key(self, code: str, down: bool) -> bool:
        """Press or release the key of a DOM code; False for a code with no X key."""
        name = keysym_name(code)
        keysym = XK.string_to_keysym(name) if name else 0
        keycode = self.disp.keysym_to_keycode(keysym) if keysym else 0
        if not keycode:
            return False
        self._send(X.KeyPress if down else X.KeyRelease, keycode)
        (self.held_keys.add if down else self.held_keys.discard)(keycode)
        return True

    def release_all(self) -> None:
        """Let go of every held key and button (control changed hands, or the viewer left)."""
        for keycode in sorted(self.held_keys):
            self._send(X.KeyRelease, keycode)
        for button in sorted(self.held_buttons):
            self._send(X.ButtonRelease, button)
        self.held_keys.clear()
        self.held_buttons.clear()

    def close(self) -> None:
        try:
            self.release_all()
            self.disp.close()
        except (error.ConnectionClosedError, OSError) as exc:
            log.debug("event=input_close_failed error=%r", exc)
