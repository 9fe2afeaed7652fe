"""What a viewer may send on its input channel (WebRTC data channel or WebSocket): messages
size-, depth- and shape-limited, input rate-limited per viewer; what breaks a limit is dropped
and counted, never a disconnect."""

from __future__ import annotations

import json
import time
from typing import Any

#: nesting a message may have: an input message is one flat object (a small list at most)
MAX_DEPTH = 4


class Rejected(Exception):
    """A message dropped; ``reason`` is the label it is counted under."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def nesting(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (strings skipped), scanned
    without parsing: a deeply nested message costs a scan, not the parser's recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse(raw: object, max_bytes: int) -> dict[str, Any]:
    """The message ``raw`` as an object with a string ``t``; Rejected otherwise."""
    if isinstance(raw, bytes | bytearray):
        if len(raw) > max_bytes:
            raise Rejected("too_large")
        try:
            text = bytes(raw).decode()
        except UnicodeDecodeError:
            raise Rejected("malformed") from None
    elif isinstance(raw, str):
        text = raw
        # a character is at most 4 bytes: measure only when it may be over
        if len(text) * 4 > max_bytes and len(text.encode()) > max_bytes:
            raise Rejected("too_large")
    else:
        raise Rejected("malformed")
    if nesting(text) > MAX_DEPTH:
        raise Rejected("too_deep")
    try:
        message = json.loads(text)
    except (ValueError, RecursionError):
        raise Rejected("malformed") from None
    if not isinstance(message, dict) or not isinstance(message.get("t"), str):
        raise Rejected("malformed")
    return message


class RateLimit:
    """A token bucket: ``rate`` messages a second, bursts of as many."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate
        self.at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True
