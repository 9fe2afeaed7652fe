"""The framing between the render worker and its Blender child, over real pipes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest

from workers import wire


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):  # the test closed it
            os.close(fd)


def test_messages_round_trip_and_a_closed_pipe_ends_the_stream(pipe: tuple[int, int]) -> None:
    r, w = pipe
    sent: list[dict[str, Any]] = [
        {"op": "render", "path": "/job/scène.blend", "rect": [0, 0, 16, 9]},
        {"op": "quit"},
    ]
    for message in sent:
        wire.write_message(w, message)
    os.close(w)
    assert wire.read_message(r) == sent[0]
    assert wire.read_message(r) == sent[1]
    assert wire.read_message(r) is None


def test_the_worker_decodes_a_reply_that_arrives_in_pieces() -> None:
    reply = {"ok": True, "result": {"width": 67, "height": 41, "layers": ["ViewLayer"]}}
    frame = wire.encode(reply)
    decoder = wire.Decoder()
    got = [decoder.feed(frame[i : i + 1]) for i in range(len(frame))]
    assert got[:-1] == [None] * (len(got) - 1)
    assert got[-1] == reply


@pytest.mark.parametrize("cut", [2, 4 + 5], ids=["in the header", "in the body"])
def test_a_truncated_frame_is_a_clear_error(pipe: tuple[int, int], cut: int) -> None:
    r, w = pipe
    frame = wire.encode({"op": "ping", "padding": "x" * 20})
    os.write(w, frame[:cut])
    os.close(w)
    with pytest.raises(wire.WireError, match="truncated frame"):
        wire.read_message(r)


def test_an_oversize_length_is_refused_without_reading_the_body(pipe: tuple[int, int]) -> None:
    r, w = pipe
    header = wire.HEADER.pack(wire.MAX_MESSAGE_BYTES + 1)
    # a reader that trusted the length would wait for 64 MiB (here: meet a truncated frame)
    os.write(w, header + b"{}")
    os.close(w)
    with pytest.raises(wire.WireError, match="over the 67108864-byte limit"):
        wire.read_message(r)
    with pytest.raises(wire.WireError, match="over the 67108864-byte limit"):
        wire.Decoder().feed(header)


def test_an_oversize_message_is_refused_before_a_byte_is_written(
    pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    r, w = pipe
    monkeypatch.setattr(wire, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(wire.WireError, match="over the 100-byte limit"):
        wire.write_message(w, {"ok": True, "result": {"missing_files": ["x" * 100]}})
    wire.write_message(w, {"ok": True})
    os.close(w)
    assert wire.read_message(r) == {"ok": True}, "the refused message left bytes on the pipe"


@pytest.mark.parametrize("body", [b"[1, 2]", b"\xff{}", b"{not json"])
def test_a_body_that_is_not_a_json_object_is_a_clear_error(body: bytes) -> None:
    with pytest.raises(wire.WireError, match=r"not an object|not UTF-8 JSON"):
        wire.Decoder().feed(wire.HEADER.pack(len(body)) + body)
