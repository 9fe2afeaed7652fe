"""The pace of grabs on damage (encoder.capture.GrabPace), driven with explicit times: an app
drawing at the session's rate is grabbed as it draws, even after grabs came late; one drawing
faster is grabbed at the session's rate."""

from __future__ import annotations

import itertools
import random

import pytest

from encoder.capture import GrabPace

FPS = 60
INTERVAL_S = 1.0 / FPS


def holds(drawn_s: list[float], late_s: list[float]) -> list[float | None]:
    """How long the grab of each drawing was held by the pace: the k-th drawing's grab is asked
    for ``late_s[k]`` after it (the capture thread's delay); a drawing made before the previous
    grab is shown by that grab and asks for none of its own (its hold: None)."""
    pace = GrabPace(FPS)
    out: list[float | None] = []
    last_s = -1.0
    for t, late in zip(drawn_s, late_s, strict=True):
        if t < last_s:
            out.append(None)
            continue
        asked_s = t + late
        hold = pace.hold_s(asked_s)
        last_s = asked_s + hold
        pace.grabbed(last_s)
        out.append(hold)
    return out


@pytest.mark.parametrize("late_frames", [0.6, 0.9, 1.5, 3.2])
def test_a_late_grab_does_not_hold_the_frames_after_it(late_frames: float) -> None:
    # an app drawing at exactly the session's rate; one grab is late (a tolerance of half a
    # frame held every later frame by the lateness beyond it)
    drawn = [k * INTERVAL_S for k in range(600)]
    late = [0.0] * 600
    late[100] = late_frames * INTERVAL_S
    held = [h for h in holds(drawn, late)[101:] if h is not None]
    # the grab after the late one may keep the minimum gap from it; none after that is held
    assert held[0] <= GrabPace.MIN_GAP * INTERVAL_S
    assert max(held[1:]) == 0, f"held {sum(h > 0 for h in held[1:])} of the frames after"


def test_an_app_with_a_jittery_clock_on_a_busy_capture_thread_is_never_held_for_long() -> None:
    rng = random.Random(7)
    # the app's timer fires up to 0.4 frames late, the capture thread takes up to 0.8 frames
    drawn = [(k + 0.4 * rng.random()) * INTERVAL_S for k in range(6000)]
    late = [0.8 * INTERVAL_S * rng.random() ** 3 for _ in range(6000)]
    held = [h for h in holds(drawn, late) if h is not None]
    # only the minimum gap holds a grab (after a late one), briefly and never for long: with
    # half a frame's tolerance 74 % of these frames were held, 3.8 ms on average, 31 in a row
    assert max(held) <= GrabPace.MIN_GAP * INTERVAL_S
    assert sum(held) / len(held) < 0.05 * INTERVAL_S
    in_a_row = longest = 0
    for h in held:
        in_a_row = in_a_row + 1 if h > 0 else 0
        longest = max(longest, in_a_row)
    assert longest <= 2


def test_an_app_drawing_faster_is_grabbed_at_the_session_rate() -> None:
    drawn = [k / 250 for k in range(2500)]  # 250 drawings a second for 10 s
    held = holds(drawn, [0.0] * len(drawn))
    # a drawing made while the previous grab was held is shown by that grab
    grabs = [t + h for t, h in zip(drawn, held, strict=True) if h is not None]
    span_s = grabs[-1] - grabs[0]
    # the session's rate, and at most a burst of two frames ahead of it at the start
    assert FPS * span_s * 0.98 <= len(grabs) <= FPS * span_s + 3
    gaps = [b - a for a, b in itertools.pairwise(grabs)]
    assert min(gaps) >= 0.5 * INTERVAL_S - 1e-9
