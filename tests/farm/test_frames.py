"""Tests of frame lists: parsing what users type, and formatting frames back for display."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from farm.errors import BadFrameList
from farm.frames import MAX_FRAME, MAX_FRAMES, MIN_FRAME, format_frames, parse_frames


def test_the_documented_example() -> None:
    assert parse_frames("1-10,20,30-40x2") == [
        *range(1, 11),
        20,
        *range(30, 41, 2),
    ]


@pytest.mark.parametrize(
    ("text", "frames"),
    [
        ("7", [7]),
        ("0", [0]),
        ("10,1-3", [10, 1, 2, 3]),  # the order given is kept
        ("3,1-4,2", [3, 1, 2, 4]),  # duplicates dropped where they repeat
        ("1-10x3", [1, 4, 7, 10]),
        ("1-10X4", [1, 5, 9]),
        ("1-10:5", [1, 6]),
        ("5-5", [5]),
        (" 1 - 3 , 9 ", [1, 2, 3, 9]),
        ("-5..-3", [-5, -4, -3]),
        ("-2..2", [-2, -1, 0, 1, 2]),
        ("-2 .. 2 x 2", [-2, 0, 2]),
        ("-3--1", [-3, -2, -1]),
        ("-7", [-7]),
        (f"{MIN_FRAME},{MAX_FRAME}", [MIN_FRAME, MAX_FRAME]),
    ],
)
def test_parse(text: str, frames: list[int]) -> None:
    assert parse_frames(text) == frames


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("1-", "not N, A-B or A-BxSTEP"),
        ("a", "not N, A-B or A-BxSTEP"),
        ("1,,2", "not N, A-B or A-BxSTEP"),
        ("1-10,", "not N, A-B or A-BxSTEP"),
        ("1-10x", "not N, A-B or A-BxSTEP"),
        ("1x2", "not N, A-B or A-BxSTEP"),
        ("1.5", "not N, A-B or A-BxSTEP"),
        ("1-10x-2", "not N, A-B or A-BxSTEP"),
        ("5-3", "ends before it starts"),
        ("-1..-3", "ends before it starts"),
        ("1-10x0", "step"),
        (f"{MAX_FRAME + 1}", "outside Blender's range"),
        (f"{MIN_FRAME - 1}..0", "outside Blender's range"),
        ("1-99999999999999999999", "outside Blender's range"),
        (f"1-{MAX_FRAMES + 1}", f"more than {MAX_FRAMES} frames"),
        (f"1-{MAX_FRAMES // 2},{MAX_FRAMES}-{MAX_FRAMES * 2}", f"more than {MAX_FRAMES} frames"),
    ],
)
def test_errors(text: str, says: str) -> None:
    with pytest.raises(BadFrameList) as raised:
        parse_frames(text)
    assert says in raised.value.message
    assert raised.value.fields["frames"] == text


def test_the_frame_limit_itself_is_allowed() -> None:
    assert len(parse_frames(f"1-{MAX_FRAMES}")) == MAX_FRAMES


def test_repeated_frames_do_not_count_toward_the_limit() -> None:
    half = MAX_FRAMES * 3 // 5
    assert len(parse_frames(f"1-{half},1-{half}")) == half


@pytest.mark.parametrize(
    ("frames", "text"),
    [
        ([], ""),
        ([4], "4"),
        ([1, 2, 3, 5], "1-3,5"),
        ([5, 3, 2, 1, 3], "1-3,5"),
        ([-3, -2, -1, 4], "-3--1,4"),
        ([-1, 0, 1], "-1-1"),
    ],
)
def test_format(frames: list[int], text: str) -> None:
    assert format_frames(frames) == text


frame = st.integers(MIN_FRAME, MAX_FRAME)


@given(st.lists(frame, min_size=1, max_size=60))
def test_format_round_trips_any_frame_set(frames: list[int]) -> None:
    assert set(parse_frames(format_frames(frames))) == set(frames)


@st.composite
def frame_lists(draw: st.DrawFn) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(-300, 300))
        kind = draw(st.sampled_from(["single", "range", "step"]))
        end = start + draw(st.integers(0, 200))
        sep = "-" if start >= 0 else ".."
        if kind == "single":
            parts.append(str(start))
        elif kind == "range":
            parts.append(f"{start}{sep}{end}")
        else:
            parts.append(f"{start}{sep}{end}x{draw(st.integers(1, 9))}")
    return ",".join(parts)


@given(frame_lists())
def test_parse_format_parse_keeps_the_set(text: str) -> None:
    frames = parse_frames(text)
    assert len(frames) == len(set(frames))
    assert set(parse_frames(format_frames(frames))) == set(frames)
    # format_frames is the shortest form: no two of its parts could be merged
    parts = format_frames(frames).split(",")
    assert len(parts) == len(set(parts))
