"""Where the farm keeps things in its store: the key of every tile, log and frame."""

from __future__ import annotations

#: an upload that is a set of files (a zip's .blend and its textures) keeps them under here
ZIP_FILES = "/files/"


def tile_key(job_id: str, frame: int, index: int, attempt: int) -> str:
    # per attempt: a late upload from a holder that lost its lease never overwrites the
    # output of the attempt that was committed
    return f"jobs/{job_id}/tiles/{frame}/{index}-a{attempt}.exr"


def tile_log_key(job_id: str, frame: int, index: int, attempt: int) -> str:
    """An attempt's own log: a failed one's full story (error fields, Blender's log tail), a
    committed one's figures and Blender's lines while it rendered; the job's project's."""
    return f"jobs/{job_id}/logs/{frame}/{index}-a{attempt}.log"


def frame_tiles_key(job_id: str, frame: int) -> str:
    return f"jobs/{job_id}/tiles/{frame}"


def frame_file_name(frame: int, ext: str) -> str:
    return f"frame_{frame:04d}{ext}"


def preview_prefix(job_id: str) -> str:
    """Where an animation's preview stills (8-bit PNG, one a frame) wait for its MP4; kept with
    the job, so that a requeue can rebuild the MP4 around its new frames."""
    return f"jobs/{job_id}/preview"


def preview_still_key(job_id: str, frame: int) -> str:
    return f"{preview_prefix(job_id)}/{frame_file_name(frame, '.png')}"
