"""Capture on X damage: a drawing reaches the session's frame slot at once, not at the next tick
of the frame clock; a still screen keeps its frame rate."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from Xlib import display as xdisplay

from encoder.capture import FrameSlot, X11Grabber
from encoder.display import XDisplay

WIDTH, HEIGHT = 320, 240


@pytest.fixture
def screen() -> Iterator[XDisplay]:
    server = XDisplay(WIDTH, HEIGHT)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def white_share(slot: FrameSlot, timeout_s: float) -> tuple[float, float] | None:
    """(share of white pixels, when it was taken) of the next frame; None at the time-out."""
    captured = slot.take(timeout_s)
    if captured is None:
        return None
    rgb = captured.frame.to_ndarray(format="rgb24")
    return float(np.mean(rgb.min(axis=2) > 200)), time.monotonic()


def test_a_drawing_is_captured_at_once_not_at_the_next_frame_tick(screen: XDisplay) -> None:
    # one frame a second: polling would show the drawing up to a second late (half on average)
    slot = FrameSlot()
    grabber = X11Grabber(slot, screen.name, WIDTH, HEIGHT, fps=1)
    app = xdisplay.Display(screen.name)
    try:
        grabber.start()
        assert white_share(slot, 10.0) is not None, grabber.error
        assert grabber.mode == "damage"
        root = app.screen().root
        gc = root.create_gc(foreground=app.screen().white_pixel)
        delays_s = []
        for i in range(5):
            # a still screen is refreshed each second; drawing 0.6 s after a refresh, the
            # next refresh (what polling would show) is 0.4 s away
            refreshed = slot.take(2.0)
            assert refreshed is not None and not grabber._rephase
            draw_at_s = refreshed.capture_us / 1e6 + 0.6
            while time.time() < draw_at_s:  # a point in time to draw at, not a synchronisation
                time.sleep(0.01)
            drawn_s = time.monotonic()
            root.fill_rectangle(gc, 0, 0, WIDTH, (i + 1) * HEIGHT // 5)
            app.flush()
            while True:
                seen = white_share(slot, 2.0)
                assert seen is not None, "no frame after the drawing"
                if seen[0] >= (i + 1) / 5 - 0.01:
                    delays_s.append(seen[1] - drawn_s)
                    break
        assert max(delays_s) < 0.2, f"drawing to captured frame: {delays_s} s"
        assert grabber.damage_grabs >= 5
    finally:
        app.close()
        grabber.stop()


def test_a_still_screen_keeps_the_session_frame_rate(screen: XDisplay) -> None:
    slot = FrameSlot()
    grabber = X11Grabber(slot, screen.name, WIDTH, HEIGHT, fps=20)
    try:
        grabber.start()
        assert slot.take(10.0) is not None, grabber.error
        started, before = time.monotonic(), grabber.frames
        deadline = started + 1.0
        while time.monotonic() < deadline:
            slot.take(0.2)
        rate = (grabber.frames - before) / (time.monotonic() - started)
        assert 14 <= rate <= 26, f"{rate:.1f} fps on a still screen at 20"
    finally:
        grabber.stop()


def test_an_app_drawing_faster_than_the_session_is_grabbed_at_the_session_rate(
    screen: XDisplay,
) -> None:
    slot = FrameSlot()
    grabber = X11Grabber(slot, screen.name, WIDTH, HEIGHT, fps=20)
    app = xdisplay.Display(screen.name)
    try:
        grabber.start()
        assert slot.take(10.0) is not None, grabber.error
        root = app.screen().root
        gcs = [root.create_gc(foreground=c) for c in (0xFFFFFF, 0x000000)]
        started, before = time.monotonic(), grabber.frames
        drawn = 0
        while time.monotonic() < started + 1.5:
            # about 100 drawings a second, each a damage event
            root.fill_rectangle(gcs[drawn % 2], 0, 0, WIDTH, HEIGHT)
            app.sync()
            drawn += 1
            slot.take(0.01)
        rate = (grabber.frames - before) / (time.monotonic() - started)
        assert drawn / 1.5 > 40, "the app did not draw fast enough to test the limit"
        assert rate <= 22, f"{rate:.1f} grabs a second at 20 fps (the app drew {drawn})"
        assert rate >= 14, f"{rate:.1f} grabs a second while the app draws"
    finally:
        app.close()
        grabber.stop()
