"""Every Redis key name Tessera uses, in one place."""

from __future__ import annotations

PREFIX = "tessera"

#: sorted set of job ids by creation time
JOBS = f"{PREFIX}:jobs"


def job(job_id: str) -> str:
    """Hash: spec, state, reason, timestamps and counters of one job."""
    return f"{PREFIX}:job:{job_id}"


def tiles(job_id: str) -> str:
    """Hash: ``frame:index`` -> state; ``:a`` attempt, ``:f`` failures, ``:d`` lease deadline."""
    return f"{PREFIX}:job:{job_id}:tiles"


def frame_counts(job_id: str) -> str:
    """Hash: frame -> number of its tiles done."""
    return f"{PREFIX}:job:{job_id}:framecount"


def assembling(job_id: str) -> str:
    """Hash: frame -> assembly deadline (epoch seconds) of frames whose tiles are all in."""
    return f"{PREFIX}:job:{job_id}:assembling"


def events(job_id: str) -> str:
    """Stream of the job's progress events."""
    return f"{PREFIX}:job:{job_id}:events"


def reply(token: str) -> str:
    """List a worker pushes one answer onto (inspection results)."""
    return f"{PREFIX}:reply:{token}"


def inspection(sha256: str) -> str:
    """Cached inspection report of an upload, by content hash."""
    return f"{PREFIX}:inspect:{sha256}"


def render_queue(device_class: str) -> str:
    """Name of the rq queue for one device class (rq adds its own prefix)."""
    return f"{PREFIX}-render-{device_class}"
