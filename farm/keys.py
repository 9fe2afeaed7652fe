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


# --- the slot allocator ------------------------------------------------------------------------

#: set of every registered device id
DEVICES = f"{PREFIX}:devices"
#: sorted set: lease id -> expiry (epoch ms), so expired leases are found without a scan
LEASE_EXPIRY = f"{PREFIX}:lease-expiry"
#: pub/sub channel announcing revoked leases (message: lease id)
LEASE_REVOKED = f"{PREFIX}:lease-revoked"


def device(device_id: str) -> str:
    """Hash: capacity, labels, agent, use counters and the fencing token of one device."""
    return f"{PREFIX}:device:{device_id}"


def device_leases(device_id: str) -> str:
    """Set of the lease ids held on one device."""
    return f"{PREFIX}:device:{device_id}:leases"


def agent(name: str) -> str:
    """String with a TTL: the agent is alive while it exists (renewed by heartbeats)."""
    return f"{PREFIX}:agent:{name}"


def host(name: str) -> str:
    """Hash: the host's NVENC session budget (consumer drivers cap sessions per system) and use."""
    return f"{PREFIX}:host:{name}"


def lease(lease_id: str) -> str:
    """Hash: holder, kind, device, amounts, token, expiry of one lease."""
    return f"{PREFIX}:lease:{lease_id}"


def lease_gone(lease_id: str) -> str:
    """Why a lease ended (released, expired, revoked: ...), kept a while for its late holder."""
    return f"{PREFIX}:lease:{lease_id}:gone"


def project_policy(project: str) -> str:
    """Hash: role -> comma-separated device classes the role may use in that project."""
    return f"{PREFIX}:project:{project}:policy"
