"""The headless Chromium the stream tests drive: the system's /usr/bin/chromium, never one a
tool downloads, with the flags a closed network and autoplaying sound need."""

from __future__ import annotations

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


def until(expression: str) -> str:
    """``expression`` as a predicate for ``page.wait_for_function``: a function, which the
    player's CSP (script-src 'self') allows; a bare expression is polled through eval()."""
    return f"() => ({expression})"
