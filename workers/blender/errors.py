"""The Blender child's error replies, and Blender's exceptions turned into messages for users."""

from __future__ import annotations

from typing import Any

from workers import redaction
from workers.blender.process import log


class ChildError(Exception):
    """An error reply: ``code`` is a farm.errors code the parent maps back to its class."""

    def __init__(self, code: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields


def blender_message(exc: BaseException) -> str:
    """Blender's message for the user: its lines joined, paths cut to file names (the full
    text is in this child's log, for operators)."""
    text = str(exc).strip()
    log("blender_error", text=text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    joined = "; ".join(line.removeprefix("Error: ") for line in lines)
    return redaction.public(joined) or type(exc).__name__
