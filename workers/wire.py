"""The framing of the render worker's talk with its Blender child, used by both processes.

Each message is a JSON object: a 4-byte big-endian length, then that many bytes of UTF-8 JSON,
on a pipe per direction (requests one way, replies the other). Neither side imports the other:
the worker (workers/child.py) never imports bpy, the child (workers/blender/) never imports rq.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

HEADER = struct.Struct(">I")

#: the largest message body either side sends or accepts, in bytes. Real ones are far smaller
#: (an inspection report of a file with thousands of missing paths is well under 1 MiB); the
#: limit turns a corrupt length into an error instead of a wait for up to 4 GiB that never comes.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class WireError(Exception):
    """A message that cannot be framed or read: truncated, over the size limit, or not a JSON
    object. The stream is out of step after it: the reader stops talking to that process."""


def encode(message: dict[str, Any]) -> bytes:
    """``message`` framed: its length, then its JSON."""
    body = json.dumps(message).encode("utf-8")
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(
            f"a message of {len(body)} bytes is over the {MAX_MESSAGE_BYTES}-byte limit"
        )
    return HEADER.pack(len(body)) + body


def body_size(header: bytes) -> int:
    """The body length a frame's header announces; refused over the size limit."""
    (size,) = HEADER.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise WireError(
            f"a message announces {size} bytes, over the {MAX_MESSAGE_BYTES}-byte limit "
            "(a corrupt frame)"
        )
    return int(size)


def decode(body: bytes) -> dict[str, Any]:
    """The message a frame's body holds."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"a message of {len(body)} bytes is not UTF-8 JSON: {exc}") from None
    if not isinstance(message, dict):
        raise WireError(f"a message is a JSON {type(message).__name__}, not an object")
    return message


def write_message(fd: int, message: dict[str, Any]) -> None:
    """Write ``message`` whole to ``fd`` (a blocking pipe); nothing is written if it is refused."""
    view = memoryview(encode(message))
    while view:
        view = view[os.write(fd, view) :]


def read_message(fd: int) -> dict[str, Any] | None:
    """The next message on ``fd`` (a blocking pipe), or None when the writer closed it between
    messages; closed in the middle of one is a WireError."""
    header = _read_exact(fd, HEADER.size, "header")
    if not header:
        return None
    return decode(_read_exact(fd, body_size(header), "body"))


def _read_exact(fd: int, size: int, part: str) -> bytes:
    """``size`` bytes of ``fd``; none when it closed before the first of a header."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            if part == "header" and not data:
                return b""
            raise WireError(
                f"the pipe closed {len(data)} bytes into a message's {size}-byte {part} "
                "(a truncated frame)"
            )
        data += chunk
    return bytes(data)


class Decoder:
    """Messages out of a stream read in pieces as they arrive (the worker's polled reads)."""

    def __init__(self) -> None:
        self._data = bytearray()
        self._size: int | None = None

    def feed(self, chunk: bytes) -> dict[str, Any] | None:
        """Add ``chunk``; the first message once it is whole, else None (more bytes to come)."""
        self._data += chunk
        if self._size is None:
            if len(self._data) < HEADER.size:
                return None
            self._size = body_size(bytes(self._data[: HEADER.size]))
        end = HEADER.size + self._size
        if len(self._data) < end:
            return None
        body = bytes(self._data[HEADER.size : end])
        del self._data[:end]
        self._size = None
        return decode(body)
