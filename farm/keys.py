"""Every Redis key name Tessera uses, in one place (Lua scripts get them through ``lua``)."""

from __future__ import annotations

import inspect
import re

PREFIX = "tessera"

#: sorted set of job ids by creation time
JOBS = f"{PREFIX}:jobs"
#: sorted set: ``job|frame:index`` -> lease deadline (epoch s) of every rendering tile
TILE_DEADLINES = f"{PREFIX}:tile-deadlines"
#: sorted set: ``job|frame`` -> assembly deadline (epoch s) of every frame whose tiles are in
FRAME_DEADLINES = f"{PREFIX}:frame-deadlines"
#: sorted set: ``job|frame:index`` -> when requeued (epoch s), until its push to rq is confirmed
REQUEUED = f"{PREFIX}:requeued"
#: string with a TTL: the worker that runs the recovery sweep (one at a time)
SWEEPER = f"{PREFIX}:sweeper"
#: sorted set: job id -> when it ended (epoch s), of ended jobs whose records are not yet
#: trimmed to their summary (the sweep trims those older than FARM_JOB_RETENTION_S)
JOBS_ENDED = f"{PREFIX}:jobs-ended"
#: counter written only to mark a point in the replication stream: WAIT after it confirms
#: that a replica holds every write before it (farm.redisclient.confirm_replicated)
REPLICATION_FENCE = f"{PREFIX}:replication-fence"


def job(job_id: str) -> str:
    """Hash: spec, state, reason, timestamps and counters of one job."""
    return f"{PREFIX}:job:{job_id}"


def tiles(job_id: str) -> str:
    """Hash: ``frame:index`` -> state; ``:a`` attempt, ``:f`` failures, ``:d`` lease deadline,
    ``:r<attempt>`` that attempt's record (JSON, farm.taskrecords), ``:h`` the attempt a worker
    held back because the job was suspended (farm.jobcontrol)."""
    return f"{PREFIX}:job:{job_id}:tiles"


def frame_counts(job_id: str) -> str:
    """Hash: frame -> number of its tiles done."""
    return f"{PREFIX}:job:{job_id}:framecount"


def assembling(job_id: str) -> str:
    """Hash: frame -> assembly deadline (epoch seconds) of frames whose tiles are all in;
    ``:a`` the assembly attempt, ``:last`` the last attempt issued once ``:a`` is gone (a
    requeued frame's next assembly goes above it), ``:c`` 1 while the frame counts as done."""
    return f"{PREFIX}:job:{job_id}:assembling"


def events(job_id: str) -> str:
    """Stream of the job's progress events."""
    return f"{PREFIX}:job:{job_id}:events"


def project_events(project_id: str) -> str:
    """Stream of what changed in a project's jobs (state moves, frames done, users' actions):
    the jobs list's live feed (a client reads the list again when it connects, so a short
    backlog is enough: capped at about 1000 entries)."""
    return f"{PREFIX}:project:{project_id}:events"


def live_frame(job_id: str, frame: int) -> str:
    """Hash with a TTL: tile index -> JSON of the tile's latest live-preview pass (its 8-bit
    JPEG, where it lies, samples so far): a viewer joining mid-frame starts from it."""
    return f"{PREFIX}:job:{job_id}:live:{frame}"


def live_passes(job_id: str) -> str:
    """Stream with a TTL, capped: one entry per live-preview pass as it lands (the same JSON),
    which viewers follow with XREAD BLOCK."""
    return f"{PREFIX}:job:{job_id}:live"


def delivered(job_id: str) -> str:
    """Hash: frame -> JSON list of the files delivered for it (name, size, sha256, url)."""
    return f"{PREFIX}:job:{job_id}:delivered"


def reply(token: str) -> str:
    """List a worker pushes one answer onto (inspection results)."""
    return f"{PREFIX}:reply:{token}"


def inspection(sha256: str) -> str:
    """Cached inspection report of an upload, by content hash."""
    return f"{PREFIX}:inspect:{sha256}"


def render_queue(device_class: str) -> str:
    """Name of the rq queue for one device class (rq adds its own prefix)."""
    return f"{PREFIX}-render-{device_class}"


def rq_maintenance(queues: str) -> str:
    """String with a TTL: the worker that runs rq's registry maintenance of these queues (their
    names, comma-separated) in this interval (one worker of the farm per interval, farm.queue)."""
    return f"{PREFIX}:rq-maintenance:{queues}"


def render_bands(device_class: str) -> str:
    """Sorted set: rq queue key of each non-empty priority band of a class -> its priority
    (the class's own queue is band 0 and is not listed)."""
    return f"{PREFIX}:bands:{device_class}"


# --- scheduling: dependencies, blocklists, tag limits ------------------------------------------

#: sorted set: job id -> when accepted, of jobs waiting for their dependencies (the sweep
#: re-checks them)
WAITING = f"{PREFIX}:waiting"
#: list of job ids whose dependencies are all done: their tiles are to be pushed to the queue
#: (whoever made the move pushes them at once; the sweep pushes them if it did not)
RELEASED = f"{PREFIX}:released"


def dependents(job_id: str) -> str:
    """Set: the waiting jobs that depend on this job."""
    return f"{PREFIX}:job:{job_id}:dependents"


def blocklist(job_id: str) -> str:
    """Hash: worker -> counted tile failures of the job on it; ``worker:b`` -> when it was
    blocklisted (epoch s) once the failures reached FARM_BLOCKLIST_FAILURES."""
    return f"{PREFIX}:job:{job_id}:blocklist"


def worker_blocked(worker: str) -> str:
    """Set: the jobs a worker is blocklisted for (its queue pick skips their tiles)."""
    return f"{PREFIX}:worker:{worker}:blocked"


def worker_tags(worker: str) -> str:
    """String with a TTL: a live worker's tags (comma-separated), renewed by its sweep."""
    return f"{PREFIX}:worker:{worker}:tags"


def tag_slots(tag: str) -> str:
    """Sorted set: the tile attempts of jobs with this tag that hold one of its FARM_TAG_LIMITS
    slots -> the slot's expiry (epoch s), renewed with the tile's lease."""
    return f"{PREFIX}:tag-slots:{tag}"


# --- the slot allocator ------------------------------------------------------------------------

#: set of every registered device id
DEVICES = f"{PREFIX}:devices"
#: sorted set: lease id -> expiry (epoch ms), so expired leases are found without a scan
LEASE_EXPIRY = f"{PREFIX}:lease-expiry"
#: pub/sub channel announcing revoked leases (message: lease id)
LEASE_REVOKED = f"{PREFIX}:lease-revoked"
#: sorted set: device id -> alive until (epoch ms), so silent devices are found without a scan
DEVICE_ALIVE = f"{PREFIX}:device-alive"
#: set of the device classes ever registered
DEVICE_CLASSES = f"{PREFIX}:classes"
#: hash: ``class|vram|enc|slots`` -> number of devices of that shape ("could this ever fit?")
DEVICE_SHAPES = f"{PREFIX}:shapes"


def placement(device_class: str, kind: str) -> str:
    """Sorted set: the live, available devices of a class by preference for a lease kind
    (render: least free share first; stream: least loaded encoder first; no room: last)."""
    return f"{PREFIX}:place:{device_class}:{kind}"


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


def host_devices(name: str) -> str:
    """Set of the device ids on one host (moved together when its encoder budget fills)."""
    return f"{PREFIX}:host:{name}:devices"


def lease(lease_id: str) -> str:
    """Hash: holder, kind, device, amounts, token, expiry of one lease."""
    return f"{PREFIX}:lease:{lease_id}"


def lease_gone(lease_id: str) -> str:
    """Why a lease ended (released, expired, revoked: ...), kept a while for its late holder."""
    return f"{PREFIX}:lease:{lease_id}:gone"


def project_policy(project: str) -> str:
    """Hash: role -> comma-separated device classes the role may use in that project
    (farm.alloc.policy says what the names mean)."""
    return f"{PREFIX}:project:{project}:policy"


# --- accounts, projects and the web API ----------------------------------------------------------

#: set of every user name
USERS = f"{PREFIX}:users"
#: set of every project id
PROJECTS = f"{PREFIX}:projects"
#: hash: token id -> sha256 of the token (revoking by id without knowing the token)
TOKEN_IDS = f"{PREFIX}:token-ids"


def user(name: str) -> str:
    """Hash: ``admin`` (0/1) and ``created`` of one user."""
    return f"{PREFIX}:user:{name}"


def user_projects(name: str) -> str:
    """Hash: project id -> the user's role there (admin, member, viewer)."""
    return f"{PREFIX}:user:{name}:projects"


def project(project_id: str) -> str:
    """Hash: ``name`` and ``created`` of one project."""
    return f"{PREFIX}:project:{project_id}"


def project_members(project_id: str) -> str:
    """Hash: user name -> role in the project."""
    return f"{PREFIX}:project:{project_id}:members"


def token(token_sha256: str) -> str:
    """Hash: ``id``, ``user``, ``created`` of an API token, found by the token's sha256."""
    return f"{PREFIX}:token:{token_sha256}"


def web_session(session_sha256: str) -> str:
    """Hash with a TTL: ``user``, ``token_id`` (the token it was made with), ``created`` and
    ``expires`` of a browser session cookie (by its sha256)."""
    return f"{PREFIX}:websession:{session_sha256}"


def user_sessions(name: str) -> str:
    """Sorted set: session sha256 -> expiry (epoch s) of one user's browser sessions."""
    return f"{PREFIX}:user:{name}:sessions"


def token_sessions(token_id: str) -> str:
    """Set: the sha256 of every browser session made with one API token (ended with it)."""
    return f"{PREFIX}:token-sessions:{token_id}"


def project_inflight(project_id: str, kind: str) -> str:
    """Sorted set: holder id -> expiry (epoch ms) of a project's work in flight of one kind
    (``uploads``, ``inspections``, ``checks``); its size is held to the project's limit."""
    return f"{PREFIX}:project:{project_id}:inflight:{kind}"


def project_limits(project_id: str) -> str:
    """Hash: limit name -> the project's own value (a farm admin's), over the settings'."""
    return f"{PREFIX}:project:{project_id}:limits"


def project_submit_lock(project_id: str) -> str:
    """Lock held while a job of the project is checked against its budget and created, so two
    submissions at once cannot both fit in the room for one."""
    return f"{PREFIX}:project:{project_id}:submit-lock"


def project_stored_bytes(project_id: str) -> str:
    """String (integer): bytes of the project's upload records (each counted once)."""
    return f"{PREFIX}:project:{project_id}:stored-bytes"


def stored_upload(sha256: str) -> str:
    """String: JSON of what storage holds for an upload's bytes (kind, .blend key, files)."""
    return f"{PREFIX}:stored-upload:{sha256}"


def upload_bytes_lock(sha256: str) -> str:
    """Lock held while an upload's stored bytes are taken into a project (stored or reused,
    then recorded) or deleted, so a deletion never removes bytes a record has just named."""
    return f"{PREFIX}:stored-upload:{sha256}:lock"


#: set of the projects that have recorded an upload in this Redis (a cell's projects, in a farm
#: of cells): whose records an upload's deletion checks before removing the shared bytes
UPLOAD_PROJECTS = f"{PREFIX}:upload-projects"


def upload(project_id: str, sha256: str) -> str:
    """String: JSON record of an upload as the project sees it (name, kind, files, created)."""
    return f"{PREFIX}:project:{project_id}:upload:{sha256}"


def project_uploads(project_id: str) -> str:
    """Sorted set: upload sha256 -> creation time, of one project."""
    return f"{PREFIX}:project:{project_id}:uploads"


def upload_session(session_id: str) -> str:
    """Hash: project, user, name, size and offset of a resumable upload in progress."""
    return f"{PREFIX}:uploadsession:{session_id}"


def project_jobs(project_id: str) -> str:
    """Sorted set: job id -> creation time, of one project."""
    return f"{PREFIX}:project:{project_id}:jobs"


def stream_owner(session_id: str) -> str:
    """String: JSON {project, user} of a stream session started through the web API."""
    return f"{PREFIX}:streamowner:{session_id}"


# --- streams -----------------------------------------------------------------------------------

#: hash: device id -> JSON {url, device_id, pid, host, started, alive_until} of the stream service
#: serving that device (entries whose alive_until has passed are stale)
STREAM_SERVICES = f"{PREFIX}:stream:services"


# --- the workers' registry (farm.workerstate) ----------------------------------------------------

#: sorted set: worker or stream service name -> its last heartbeat (epoch s); names silent past
#: FARM_WORKER_RETENTION_S are trimmed by the beats themselves
WORKERS = f"{PREFIX}:workers"
#: hash: name -> JSON {by, at} of every worker an operator disabled (it takes no new tasks)
WORKERS_DISABLED = f"{PREFIX}:workers-disabled"


def worker(name: str) -> str:
    """Hash with a TTL (the retention): host, pid, kind, device, state, current task, last beat
    of one render worker or stream service."""
    return f"{PREFIX}:worker:{name}"


def worker_tiles(name: str, day: str) -> str:
    """Hash with a TTL: ``done`` and ``failed`` tiles of one worker on one UTC day
    (``day``: days since the epoch)."""
    return f"{PREFIX}:worker:{name}:tiles:{day}"


# --- usage accounting (written by the allocator's scripts, read by farm.alloc.usage) -------------

#: set of the projects with recorded usage
USAGE_PROJECTS = f"{PREFIX}:usage-projects"


def usage(project: str) -> str:
    """Stream: one entry per ended lease of the project (class, start, end, energy, job)."""
    return f"{PREFIX}:usage:{project}"


def usage_totals(project: str) -> str:
    """Hash: the project's all-time totals; ``m|class|kind`` ms of leases with an energy
    counter, ``u|class|kind`` ms of those without, ``j|class`` measured joules (earlier
    versions wrote ``s|class|kind`` and ``u|class`` in seconds; both are read)."""
    return f"{PREFIX}:usage:{project}:totals"


def usage_day(project: str, day: str) -> str:
    """Hash: one UTC day (``day``: days since the epoch) of the project's usage, rolled up from
    raw entries older than FARM_USAGE_RAW_RETENTION_S: ``hour|class|kind|job|metric`` -> value,
    metric ``ms`` (ms of leases in that hour), ``u`` (those ms without an energy counter),
    ``j`` (measured joules in it), ``n`` (leases in it), ``c`` (those also in the hour
    before)."""
    return f"{PREFIX}:usage:{project}:day:{day}"


def usage_days(project: str) -> str:
    """Sorted set: day (days since the epoch) -> the same, of the project's rolled-up days."""
    return f"{PREFIX}:usage:{project}:days"


def usage_rolled(project: str) -> str:
    """String: id of the last raw usage entry rolled up into the days (and trimmed)."""
    return f"{PREFIX}:usage:{project}:rolled"


# --- estimates before submit (farm.estimaterecords, farm.budget) -------------------------------

#: stream: one entry per finished job that had an estimate (its error), capped at
#: FARM_ESTIMATE_ERRORS_MAX entries
ESTIMATE_ERRORS = f"{PREFIX}:estimate-errors"
#: hash: ``from>to|log`` (sum of log(time on to / estimate on from)) and ``from>to|n`` (jobs),
#: the farm's measured speed ratios between device classes
ESTIMATE_RATIOS = f"{PREFIX}:estimate-ratios"


def project_budget(project: str) -> str:
    """Hash: the project's budget, ``amount`` (currency of FARM_USAGE_PRICES) per ``period_s``."""
    return f"{PREFIX}:project:{project}:budget"


# --- webhooks (farm.webhooks) -------------------------------------------------------------------

#: set of the projects with at least one webhook: job events of others go to no outbox
WEBHOOK_PROJECTS = f"{PREFIX}:webhook-projects"
#: stream: one entry per job event a webhook may want (job.submitted, frame.done, job.<end>),
#: written in the script that makes the event; the dispatcher reads it as a consumer group
WEBHOOK_OUTBOX = f"{PREFIX}:webhook-outbox"
#: string with a TTL: the web process whose dispatcher sends webhooks (one at a time)
WEBHOOK_DISPATCHER = f"{PREFIX}:webhook-dispatcher"
#: sorted set: delivery id -> when its next attempt is due (epoch s), of pending deliveries
WEBHOOK_DUE = f"{PREFIX}:webhook-due"


def webhooks(project_id: str) -> str:
    """Hash: hook id -> JSON record (url, events, secret, created_s, created_by) of a project."""
    return f"{PREFIX}:project:{project_id}:webhooks"


def webhook_deliveries(hook_id: str) -> str:
    """Sorted set: delivery id -> creation time (epoch s), the hook's latest deliveries."""
    return f"{PREFIX}:webhook:{hook_id}:deliveries"


def webhook_delivery(delivery_id: str) -> str:
    """Hash: hook, project, event, body, state, attempts, next_s, last result of a delivery."""
    return f"{PREFIX}:webhook-delivery:{delivery_id}"


# --- the same names in Lua ---------------------------------------------------------------------

#: what a key's fixed parts may hold, so that they need no escaping inside a Lua string
_LUA_PLAIN = re.compile(r"[A-Za-z0-9:_.|*-]*")


def lua(*names: str) -> str:
    """A Lua prelude that defines the named keys of this module in a table ``keys``: a
    constant as ``keys.JOBS``, a key function as ``keys.job(job_id)``, each spelled by calling
    the Python definition, so a script names a key as Python does and spells none itself."""
    lines = ["local keys = {}"]
    for name in names:
        value = globals()[name]
        if isinstance(value, str):
            lines.append(f"keys.{name} = {_lua_text(value)}")
            continue
        params = list(inspect.signature(value).parameters)
        # each argument becomes a marker in the spelled key, then a Lua parameter
        parts = re.split("\0([0-9]+)\0", value(*(f"\0{i}\0" for i in range(len(params)))))
        pieces = [params[int(p)] if i % 2 else _lua_text(p) for i, p in enumerate(parts) if p]
        lines.append(f"function keys.{name}({', '.join(params)}) return {' .. '.join(pieces)} end")
    return "\n".join(lines) + "\n"


def _lua_text(text: str) -> str:
    if not _LUA_PLAIN.fullmatch(text):
        raise ValueError(f"key part {text!r} would need escaping in Lua")
    return f"'{text}'"
