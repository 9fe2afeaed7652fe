"""A failed task's short cause, first and in words a user acts on: missing file X, out of
memory on device Y, Blender crashed in frame F, timed out after T s, corrupt file X.

Pure text work: the worker hands in what the error says (its code, message and fields, and
Blender's last log lines) and gets one short line back; the full story stays in the attempt's
own log. Only the farm's own words and bare file names come out, never a path, a hash or
another job's text (those are cut here too, as a second guard behind workers.redaction).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Cycles' and the system's words for memory that ran out (Cycles device_impl and
#: device/memory; CUDA/HIP/OptiX/Metal drivers; std::bad_alloc; Python's MemoryError; ENOMEM)
_OOM = re.compile(
    r"out of (?:gpu |device |host |shared host |video |cuda )?memory"
    r"|out of gpu and shared host memory"
    r"|CUDA_ERROR_OUT_OF_MEMORY|hipErrorOutOfMemory|OPTIX_ERROR_\w*OUT_OF_MEMORY"
    r"|std::bad_alloc|MemoryError|Cannot allocate memory|failed to allocate",
    re.IGNORECASE,
)
#: a file the render needs and cannot find or read; group 1 (or 2) names it
_MISSING = re.compile(
    r"cannot (?:read|open|find) (?:file )?['\"]?([^'\":;\s][^'\":;]*?)['\"]?(?::| \(|;|$)"
    r".*?(?:no such file|not found|does not exist|permission denied)"
    r"|['\"]?([^'\"\s]+?)['\"]? (?:is not readable|not found|does not exist|is missing)",
    re.IGNORECASE,
)
_NO_SUCH = re.compile(r"no such file or directory|not found|does not exist", re.IGNORECASE)
_CORRUPT = re.compile(
    r"corrupt|truncated|not a blend file|file format is not supported|unknown file header"
    r"|failed to read blend file|unexpected end of file",
    re.IGNORECASE,
)
_FILE_NAME = re.compile(r"[\w+@-][\w.+@-]*\.[A-Za-z0-9]{1,8}")
#: Blender's log lines for a file it needed and did not find (Cycles' images, libraries)
_LOG_MISSING = re.compile(
    r"Image file ['\"]([^'\"]+)['\"] does not exist"
    r"|Cannot read file ['\"]([^'\"]+)['\"]: No such file"
    r"|(?:library|lib) ['\"]?([^'\"\s]+\.blend)['\"]? (?:not found|does not exist)",
    re.IGNORECASE,
)
_HEX = re.compile(r"[0-9a-fA-F]{24,}")


@dataclass(frozen=True)
class Failure:
    """The kind of failure (a fixed word for filters and tests) and its short cause."""

    kind: str
    cause: str


def classify(
    code: str,
    message: str,
    fields: Mapping[str, Any] | None = None,
    *,
    frame: int,
    device: str,
    log_tail: Sequence[str] = (),
) -> Failure:
    """The short cause of a failed render attempt of ``frame`` on ``device``.

    ``code`` and ``message`` are the farm error's (farm.errors), ``fields`` its fields
    (signal, exit_code, timeout_s, child_error), ``log_tail`` Blender's last log lines: read
    for the cause, never repeated.
    """
    fields = fields or {}
    text = "\n".join([message, *log_tail])
    if code == "tile_timeout":
        limit = fields.get("timeout_s")
        after = f"{float(limit):g} s" if isinstance(limit, int | float) else "its time limit"
        return Failure("timeout", f"timed out after {after} in frame {frame}")
    signal = str(fields.get("signal") or "")
    if _OOM.search(text):
        return Failure("out_of_memory", f"out of memory on {device} in frame {frame}")
    if code == "blender_crashed" and signal == "SIGKILL":
        # nothing of the farm's kills Blender with SIGKILL without saying so (a timeout, a
        # cancel): the kernel's OOM killer or the memory limit (FARM_BLENDER_MEMORY_MIB) did
        return Failure(
            "out_of_memory",
            f"Blender was killed (SIGKILL) in frame {frame}, most likely out of memory on {device}",
        )
    missing = _MISSING.search(message)
    if missing and (
        _NO_SUCH.search(message) or "not readable" in message or "is missing" in message
    ):
        return Failure(
            "missing_file", f"missing file {_name(missing.group(1) or missing.group(2))}"
        )
    if code == "bad_blend_file" or _CORRUPT.search(message):
        name = _first_name(message)
        return Failure("corrupt_file", f"corrupt or unreadable file {name}".rstrip())
    if code == "blender_crashed":
        if signal:
            return Failure("crash", f"Blender crashed ({signal}) in frame {frame}")
        status = fields.get("exit_code")
        return Failure("crash", f"Blender exited with status {status} in frame {frame}")
    for line in reversed(log_tail):
        m = _LOG_MISSING.search(line)
        if m:
            named = next(g for g in m.groups() if g)
            return Failure("missing_file", f"missing file {_name(named)}")
    if code == "no_camera":
        return Failure("no_camera", "the scene has no camera")
    if code == "device_unavailable":
        return Failure("device", f"{device} could not render")
    if code.startswith("storage"):
        return Failure("storage", "the farm's storage failed")
    if code == "lease_lost":
        return Failure("requeued", "its device was needed for a stream; requeued")
    return Failure("error", _first_sentence(message))


def _name(text: str) -> str:
    """The bare file name of ``text`` (a path, or a Blender-relative ``//tex/a.png``)."""
    name = re.split(r"[/\\]", text.strip().strip("'\""))[-1]
    return _HEX.sub("…", name) or "(unnamed)"


def _first_name(message: str) -> str:
    m = _FILE_NAME.search(re.sub(r"\S*/", "", message))
    return _name(m.group(0).strip()) if m else ""


def _first_sentence(message: str, limit: int = 120) -> str:
    first = re.split(r"(?<=[.;])\s|\n", message.strip(), maxsplit=1)[0].rstrip(".;")
    return first if len(first) <= limit else first[: limit - 1] + "…"


def shown(cause: str, detail: str) -> str:
    """The reason a user reads: the cause first, then the detail when it adds anything."""
    if not detail:
        return cause
    if detail.startswith(cause):
        # the detail already reads cause first: all of it, or the rest would be cut off
        return detail
    return f"{cause} — {detail}"
