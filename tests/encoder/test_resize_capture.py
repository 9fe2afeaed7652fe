"""A capture survives its screen changing size under it: a grab that RandR breaks is reopened
at the new size, never taken for a capture error (which restarts the whole session)."""

from __future__ import annotations

import time

from encoder.capture import FrameSlot
from encoder.display import XDisplay
from encoder.resize import ResizingGrabber, open_screen
from encoder.source import _resize_display

SIZES = [(320, 240), (160, 120), (640, 480), (200, 100)]
FRAMEBUFFER = (640, 480)


def _frame_at(slot: FrameSlot, grabber: ResizingGrabber, width: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        taken = slot.take(timeout_s=0.2)
        assert grabber.error is None, grabber.error
        if taken is not None and taken.frame.width == width:
            return True
    return False


def test_back_to_back_resizes_never_fail_the_capture() -> None:
    screen = XDisplay(320, 240, FRAMEBUFFER)
    screen.start()
    slot = FrameSlot()
    grabber = ResizingGrabber(slot, screen.name, 320, 240, 60)
    grabber.start()
    try:
        assert _frame_at(slot, grabber, 320, 10.0), "no first frame"
        # shrinking while a grab of the old size is in flight is what broke sessions: each
        # size at once after the last, many times, with the grab running at 60 fps
        for round_ in range(6):
            for width, height in SIZES:
                _resize_display(screen.name, grabber, FRAMEBUFFER, width, height)
                assert _frame_at(slot, grabber, width, 10.0), (round_, width, height)
    finally:
        grabber.stop()
        slot.close()
        screen.stop()
    assert grabber.error is None, grabber.error


#: what a loaded machine put between RandR changing the screen and the grabber hearing of it:
#: several 60 fps refreshes, each a grab of the old size outside the new screen
NOTICE_DELAY_S = 0.25


def test_a_grab_the_screen_shrank_under_is_reopened_not_failed() -> None:
    screen = XDisplay(320, 240, FRAMEBUFFER)
    screen.start()
    slot = FrameSlot()
    grabber = ResizingGrabber(slot, screen.name, 320, 240, 60)
    grabber.start()
    try:
        assert _frame_at(slot, grabber, 320, 10.0), "no first frame"
        for width, height in [(160, 120), (320, 240), (100, 80)]:
            grabber.expect_resize()
            open_screen(screen.name, width, height)
            time.sleep(NOTICE_DELAY_S)
            grabber.resize(width, height)
            assert _frame_at(slot, grabber, width, 10.0), (width, height)
    finally:
        grabber.stop()
        slot.close()
        screen.stop()
    assert grabber.error is None, grabber.error
