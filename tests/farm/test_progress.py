"""Tests of the CLI's progress display, with an injected clock and an in-memory stream."""

from __future__ import annotations

import io

import pytest
from hypothesis import given
from hypothesis import strategies as st

from farm.progress import (
    CLEAR_TO_EOL,
    PLAIN_INTERVAL_S,
    ProgressBar,
    eta_text,
    format_duration,
    format_progress,
)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_status_text_and_bar() -> None:
    line = format_progress(12, 36, 2, 9, elapsed_s=20.5, width=80)
    assert line.endswith("] tiles 12/36  frames 2/9  ETA 0:41")
    assert len(line) == 80
    bar = line[1 : line.index("]")]
    assert bar.count("#") == len(bar) // 3  # a third of the tiles
    assert set(bar) == {"#", "."}


def test_eta_is_unknown_before_the_first_tile() -> None:
    assert format_progress(0, 36, 0, 9, elapsed_s=50.0).endswith("ETA --:--")
    assert eta_text(0, 36, 0.0) == "--:--"
    assert eta_text(5, 36, 0.0) == "--:--"


def test_eta_from_the_rate_so_far() -> None:
    assert eta_text(1, 3, 30.0) == "1:00"
    assert eta_text(10, 100, 400.0) == "1:00:00"
    assert eta_text(36, 36, 100.0) == "0:00"


@given(
    st.integers(-5, 500),
    st.integers(0, 500),
    st.floats(-10.0, 1e6, allow_nan=False),
    st.integers(20, 200),
)
def test_eta_never_negative_and_line_fits(
    done: int, total: int, elapsed_s: float, width: int
) -> None:
    eta = eta_text(done, total, elapsed_s)
    assert eta == "--:--" or "-" not in eta
    line = format_progress(done, total, 0, 1, elapsed_s, width=width)
    assert len(line) <= width
    if width >= 60:
        assert line.endswith(f"ETA {eta}")


def test_failed_tiles_are_shown() -> None:
    assert format_progress(5, 10, 0, 1, 3.0, failed_tiles=2).endswith("failed 2")
    assert "failed" not in format_progress(5, 10, 0, 1, 3.0)


def test_narrow_terminal_drops_the_bar() -> None:
    line = format_progress(1, 2, 0, 1, 1.0, width=40)
    assert line == "tiles 1/2  frames 0/1  ETA 0:01"
    assert len(format_progress(1, 2, 0, 1, 1.0, width=10)) == 10


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0:00"), (59.6, "1:00"), (754, "12:34"), (3723, "1:02:03"), (-3, "0:00")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_tty_redraws_in_place() -> None:
    stream, clock = io.StringIO(), Clock()
    bar = ProgressBar(stream, tiles_total=4, frames_total=1, tty=True, clock=clock, width=60)
    clock.now_s += 10
    bar.update(1, 0)
    clock.now_s += 10
    bar.update(2, 0)
    out = stream.getvalue()
    assert "\n" not in out
    draws = out.split("\r")[1:]
    assert len(draws) == 2
    assert all(d.endswith(CLEAR_TO_EOL) for d in draws)
    assert draws[0].endswith(f"tiles 1/4  frames 0/1  ETA 0:30{CLEAR_TO_EOL}")
    assert draws[1].endswith(f"tiles 2/4  frames 0/1  ETA 0:20{CLEAR_TO_EOL}")
    assert all(len(d) - len(CLEAR_TO_EOL) <= 59 for d in draws)


def test_tty_note_keeps_the_bar_below() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, 4, 1, tty=True, clock=Clock(), width=60)
    bar.update(1, 0)
    bar.note("tile 3 failed: Blender crashed, retrying")
    out = stream.getvalue()
    assert f"\r{CLEAR_TO_EOL}tile 3 failed: Blender crashed, retrying\n" in out
    assert out.rsplit("\n", 1)[1].startswith("\r[")  # the bar is drawn again after the note


def test_tty_close_replaces_the_bar() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, 4, 1, tty=True, clock=Clock(), width=60)
    bar.update(4, 1)
    bar.close("done: 1 frame in 0:12")
    bar.update(4, 1)
    bar.close("again")
    out = stream.getvalue()
    assert out.endswith(f"\r{CLEAR_TO_EOL}done: 1 frame in 0:12\n")
    assert "again" not in out


def test_plain_lines_on_frames_and_every_five_seconds() -> None:
    stream, clock = io.StringIO(), Clock()
    bar = ProgressBar(stream, tiles_total=8, frames_total=2, tty=False, clock=clock)
    bar.update(0, 0)  # the first update says the job started
    for tiles in range(1, 4):
        clock.now_s += 1
        bar.update(tiles, 0)
    clock.now_s += 1
    bar.update(4, 1)  # a frame completed: printed at once
    clock.now_s += PLAIN_INTERVAL_S - 0.5
    bar.update(5, 1)
    clock.now_s += 0.5
    bar.update(6, 1)  # 5 s since the last line
    lines = stream.getvalue().splitlines()
    assert lines == [
        "tiles 0/8  frames 0/2  ETA --:--",
        "tiles 4/8  frames 1/2  ETA 0:04",
        "tiles 6/8  frames 1/2  ETA 0:03",
    ]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_plain_note_and_close_are_plain_lines() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, 1, 1, tty=False, clock=Clock())
    bar.note("uploading scene.blend")
    bar.update(1, 1)
    bar.close("done")
    assert stream.getvalue().splitlines() == [
        "uploading scene.blend",
        "tiles 1/1  frames 1/1  ETA 0:00",
        "done",
    ]


def test_tty_is_detected_from_the_stream() -> None:
    # StringIO is not a terminal, so the bar writes plain lines.
    stream = io.StringIO()
    ProgressBar(stream, 1, 1, clock=Clock()).update(0, 0)
    assert stream.getvalue() == "tiles 0/1  frames 0/1  ETA --:--\n"
