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


class TooLarge(InputError):
    """An upload, or what it unpacks to, is over the configured limit."""

    code = "too_large"


class BadArchive(InputError):
    """A zip upload that cannot be unpacked safely (paths leaving it, links, no .blend)."""

    code = "bad_archive"


# --- state and lookups -------------------------------------------------------------------------


class NotFound(FarmError):
    code = "not_found"
    exit_status = 3


class Unauthorized(FarmError):
    """No valid API token or session: log in, or send ``Authorization: Bearer <token>``."""

    code = "unauthorized"


class Forbidden(FarmError):
    """The user is known but their role in the project does not allow this."""

    code = "forbidden"


class WrongCell(FarmError):
    """The project lives in another cell of the farm: ask the farm's front door, which sends the
    request there (farm.cells)."""

    code = "wrong_cell"


class Conflict(FarmError):
    """The request does not fit the object's current state (an upload offset, a job state)."""

    code = "conflict"


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


class TileAbandoned(RenderError):
    """The worker stopped (SIGTERM past its grace period) before the tile finished."""

    code = "tile_abandoned"


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


class StorageUnavailable(StorageError):
    """The store could not be reached or kept failing (5xx, resets, timeouts) after retries,
    or its disk is full or failing (ENOSPC, EIO): a transient fault, not the file's. Workers
    retry what raised it with back-off (FARM_STORAGE_RETRY_S), never counting an attempt."""

    code = "storage_unavailable"


class StorageDenied(StorageError):
    """Missing or refused credentials, or a permission the store's policy does not grant."""

    code = "storage_denied"


class StorageNotFound(StorageError):
    """The bucket or the object is not there."""

    code = "storage_not_found"


class AlreadyCommitted(StorageError):
    """An object written once (a frame) already exists with other bytes; it is never replaced."""

    code = "already_committed"


class StorageCorrupt(StorageError):
    """What the store holds after an upload is not what was sent (size or checksum differ)."""

    code = "storage_corrupt"


class OutputExists(InputError):
    """The job's output already holds frames it would write; outputs are never overwritten."""

    code = "output_exists"


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


class OverLimit(FarmError):
    """A project is at one of its limits (uploads in flight, inspections, queued tiles, stored
    bytes); ``limit`` names it and ``allowed`` gives its value. Retry when work has finished."""

    code = "over_limit"
    exit_status = 5


class OverBudget(FarmError):
    """A job's estimated cost is more than its project's budget has left in this period;
    ``estimate``, ``left``, ``budget``, ``spent`` and ``committed`` give the numbers."""

    code = "over_budget"
    exit_status = 5


class NoWorker(NoCapacity):
    """No render worker of the device class asked for is online; nothing was queued."""

    code = "no_worker"


class NeverFits(InputError):
    """No device in the pool could ever take the request (too large, or a forbidden class)."""

    code = "never_fits"


class LeaseLost(FarmError):
    """The lease expired, was released, or was revoked (preempted by a stream)."""

    code = "lease_lost"


# --- streams -----------------------------------------------------------------------------------


class StreamError(FarmError):
    """A stream session could not start or keep running."""

    code = "stream_error"


class SourceFailed(StreamError):
    """The session's display, app or capture failed (the message names which)."""

    code = "source_failed"


class EncoderUnavailable(StreamError):
    """No video encoder could be opened for the session (FARM_NVENC names the policy)."""

    code = "encoder_unavailable"
