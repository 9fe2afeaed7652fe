"""The headless Chromium the stream tests drive: the system's /usr/bin/chromium, never one a
tool downloads, with the flags a closed network and autoplaying sound need."""

from __future__ import annotations

import re
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--autoplay-policy=no-user-gesture-required",
]
TIMEOUT_MS = 20_000
#: an arrow function's head: ``(a, b) =>``, ``x =>`` or ``async () =>``
ARROW = re.compile(r"\s*(async\s+)?(\([^()]*\)|[A-Za-z_$][\w$]*)\s*=>")


def until(expression: str) -> str:
    """``expression`` as a predicate for ``page.wait_for_function``: a function, which the
    player's CSP (script-src 'self') allows; a bare expression is polled through eval().

    A function is refused: wrapped, the predicate would return the function itself, which is
    truthy, and the wait would end at once (a test waiting so for the app's clipboard echo
    raced the app and failed under load). Pass a function to ``wait_for_function`` as it is."""
    if ARROW.match(expression):
        raise ValueError(f"until() takes an expression, not a function: {expression!r}")
    return f"() => ({expression})"


#: a pad plugged into the page: the Gamepad API's standard mapping, moved by window.movePad
FAKE_PAD_JS = """
(() => {
  const pad = {
    index: 0, id: "Test pad (STANDARD GAMEPAD)", mapping: "standard", connected: true,
    buttons: Array.from({ length: 17 }, () => ({ pressed: false, touched: false, value: 0 })),
    axes: [0, 0, 0, 0], timestamp: 0,
  };
  navigator.getGamepads = () => [pad, null, null, null];
  window.movePad = (button, axis0) => {
    pad.buttons[button] = { pressed: true, touched: true, value: 1 };
    pad.axes[0] = axis0;
    pad.timestamp += 1;
  };
  window.plugPad = () => {
    const event = new Event("gamepadconnected");
    event.gamepad = pad;
    window.dispatchEvent(event);
  };
})();
"""
