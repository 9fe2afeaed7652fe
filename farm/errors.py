"""The one tree of Tessera's errors: a message a user can act on, plus structured fields."""

from __future__ import annotations

from typing import Any


class FarmError(Exception):
    """Base of every error Tessera raises on purpose.

    ``message`` is one line a user can act on; ``fields`` holds structured detail (paths, ids,
    limits) for logs, JSON output and API bodies.
    """

    code = "farm_error"
    #: process exit status the CLI uses for this kind of error
    exit_status = 1

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.fields}


def error_class(code: str, default: type[FarmError] | None = None) -> type[FarmError]:
    """The class whose ``code`` is ``code`` (undoing ``to_dict`` across a process boundary);
    ``default`` (FarmError when None) for a code this tree does not know."""
    stack: list[type[FarmError]] = [FarmError]
    while stack:
        cls = stack.pop()
        if cls.code == code:
            return cls
        stack.extend(cls.__subclasses__())
    return default or FarmError


# --- the user's input is wrong: CLI exit 2, API 4xx -------------------------------------------


class InputError(FarmError):
    """Something the user gave us is unusable; nothing was queued."""

    code = "bad_input"
    exit_status = 2


class BadParameter(InputError):
    code = "bad_parameter"


class BadFrameList(InputError):
    code = "bad_frame_list"


class BadTileGrid(InputError):
    code = "bad_tile_grid"


class BadBlendFile(InputError):
    """Not a .blend, truncated, corrupt, or unreadable by this Blender."""

    code = "bad_blend_file"


class MissingFiles(InputError):
    """Textures, libraries or other external files the scene needs are not there."""

    code = "missing_files"


class NoCamera(InputError):
    code = "no_camera"


# --- state and lookups -------------------------------------------------------------------------


class NotFound(FarmError):
    code = "not_found"
    exit_status = 3


class IllegalTransition(FarmError):
    """A job or tile was asked to move between states the transition table forbids."""

    code = "illegal_transition"


# --- rendering ---------------------------------------------------------------------------------


class RenderError(FarmError):
    """A tile or frame could not be rendered; the tile may be retried."""

    code = "render_failed"


class BlenderCrashed(RenderError):
    """The Blender child process died (a signal or an exit) while working."""

    code = "blender_crashed"


class TileTimeout(RenderError):
    """The tile outlived its time limit; the Blender child was killed with it."""

    code = "tile_timeout"


class DeviceUnavailable(RenderError):
    """The device asked for (a GPU backend, a GPU index) is not present or not usable."""

    code = "device_unavailable"


# --- the machine and outside systems ------------------------------------------------------------


class SetupError(FarmError):
    """A program or package the farm needs is missing; the message names the set-up command."""

    code = "setup_missing"
    exit_status = 4


class StorageError(FarmError):
    code = "storage_error"


class QueueError(FarmError):
    """Redis or the queue could not be reached or answered unexpectedly."""

    code = "queue_error"


class JobFailed(FarmError):
    """A job ended failed; ``reason`` says why (raised by the CLI's waiting commands)."""

    code = "job_failed"


class JobCanceled(FarmError):
    code = "job_canceled"
    exit_status = 130


# --- devices and the slot allocator -------------------------------------------------------------


class NvmlError(FarmError):
    """NVML (the NVIDIA driver's management library) failed or a GPU fell off the bus."""

    code = "nvml_error"


class NoCapacity(FarmError):
    """No device can take the request now; it could later (or by preempting)."""

    code = "no_capacity"
    exit_status = 5


class NeverFits(InputError):
    """No device in the pool could ever take the request (too large, or a forbidden class)."""

    code = "never_fits"


class LeaseLost(FarmError):
    """The lease expired, was released, or was revoked (preempted by a stream)."""

    code = "lease_lost"
