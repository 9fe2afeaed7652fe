"""The one settings object of a process, built once from FARM_* environment variables."""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from farm import redisurl
from farm.cells import check_cell, parse_cells
from farm.errors import BadParameter

DEVICE_KINDS = ("cpu", "gpu")


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    """FARM_REDIS_URL: the Redis holding queues, job state and events (redis:// or unix://, or
    redis+sentinel://[:password@]host:port,host:port/service[/db] behind Sentinels)."""

    control_redis_url: str = ""
    """FARM_CONTROL_REDIS_URL: the Redis holding accounts (users, projects, tokens, login
    sessions), shared by every cell of a farm split in cells; empty = FARM_REDIS_URL."""

    cell: str = ""
    """FARM_CELL: this farm's name as one cell of a larger farm (a lowercase letter, then up to
    7 lowercase letters or digits): its job ids begin ``<cell>-``, and it serves only the
    projects pinned to it. Empty = a farm of one cell."""

    cells: str = ""
    """FARM_CELLS: for `farm frontdoor`, every cell's web, first the default one:
    ``c1=http://10.0.1.5:8080,c2=http://10.0.2.5:8080``."""

    storage_dir: Path = Path("/var/lib/tessera/storage")
    """FARM_STORAGE_DIR: the shared folder for uploads, tiles and frames (local storage)."""

    storage_url: str = ""
    """FARM_STORAGE_URL: where uploads and tiles are stored: ``file:///srv/tessera`` or
    ``s3://bucket/prefix``; empty = the folder FARM_STORAGE_DIR."""

    s3_endpoint_url: str = ""
    """FARM_S3_ENDPOINT_URL: an S3-compatible endpoint (MinIO, Ceph, R2); empty = AWS."""

    s3_region: str = ""
    """FARM_S3_REGION: the bucket's region; empty = the AWS chain's (AWS_REGION, config)."""

    s3_addressing_style: str = "auto"
    """FARM_S3_ADDRESSING_STYLE: ``auto``, ``path`` (most MinIO set-ups) or ``virtual``."""

    s3_storage_class: str = ""
    """FARM_S3_STORAGE_CLASS: class of delivered frames and manifests (STANDARD_IA,
    GLACIER_IR, ...); empty = the bucket's default. Tiles and uploads stay STANDARD."""

    s3_sse: str = ""
    """FARM_S3_SSE: server-side encryption of every object: empty (the bucket's default),
    ``AES256`` (SSE-S3) or ``aws:kms`` (SSE-KMS)."""

    s3_kms_key_id: str = ""
    """FARM_S3_KMS_KEY_ID: the KMS key for ``aws:kms``; empty = the account's S3 key."""

    s3_checksum: str = "when_supported"
    """FARM_S3_CHECKSUM: ``when_supported`` (a CRC32 with every upload, checked against the
    one the store answers, or its ETag against our MD5 where it answers none) or
    ``when_required`` for stores that reject CRC32 (Content-MD5 sent, ETag checked)."""

    s3_multipart_threshold_mib: int = 16
    """FARM_S3_MULTIPART_THRESHOLD_MIB: objects this large or larger go up in parts."""

    s3_multipart_chunk_mib: int = 8
    """FARM_S3_MULTIPART_CHUNK_MIB: size of one part (S3 wants 5 MiB or more)."""

    s3_max_concurrency: int = 4
    """FARM_S3_MAX_CONCURRENCY: parts of one object uploaded at the same time."""

    s3_max_attempts: int = 5
    """FARM_S3_MAX_ATTEMPTS: tries per request (botocore standard retry mode)."""

    s3_timeout_s: float = 60.0
    """FARM_S3_TIMEOUT_S: connect and read timeout of one S3 request."""

    presign_expiry_s: int = 86400
    """FARM_PRESIGN_EXPIRY_S: lifetime of presigned download URLs (at most 7 days)."""

    tile_retention: str = "delete"
    """FARM_TILE_RETENTION: ``delete`` a frame's tiles once it is assembled, or ``keep`` them."""

    work_dir: Path = Path("/var/tmp/tessera")
    """FARM_WORK_DIR: this host's scratch space (Blender child logs, tile scratch files)."""

    device: str = "cpu"
    """FARM_DEVICE: what a worker renders on, ``cpu`` or ``gpu``; also its queue's device class."""

    gpu_index: int | None = None
    """FARM_GPU_INDEX: the GPU a worker pins (CUDA_VISIBLE_DEVICES for its Blender child)."""

    gpu_backend: str | None = None
    """FARM_GPU_BACKEND: OPTIX, CUDA, HIP, ONEAPI or METAL; unset picks the best available."""

    cpu_threads: int = 0
    """FARM_CPU_THREADS: Cycles threads per worker; 0 lets Cycles use every core."""

    tile_timeout_s: float = 1800.0
    """FARM_TILE_TIMEOUT_S: a tile rendering longer than this is killed with its Blender child."""

    inspect_timeout_s: float = 120.0
    """FARM_INSPECT_TIMEOUT_S: time allowed to open and inspect a .blend."""

    max_attempts: int = 3
    """FARM_MAX_ATTEMPTS: attempts per tile before the job fails."""

    python: str = field(default_factory=lambda: sys.executable)
    """FARM_BLENDER_PYTHON: the interpreter with ``bpy`` that runs the Blender child."""

    log_level: str = "INFO"
    """FARM_LOG_LEVEL: DEBUG, INFO, WARNING or ERROR."""

    nvml: str = "auto"
    """FARM_NVML: ``auto`` (NVML when a driver answers, else a CPU device) or ``real`` (NVML or
    refuse to start). The fake NVML (``fake:t4,l4``) exists only behind the test suite's entry
    point (tests/doubles.py)."""

    cpu_render_slots: int = 0
    """FARM_CPU_RENDER_SLOTS: concurrent render leases on a CPU device; 0 = one per 2 cores."""

    cpu_encode_sessions: int = 0
    """FARM_CPU_ENCODE_SESSIONS: software (libx264) stream sessions on a CPU device; 0 = derived
    from the core count."""

    gpu_render_slots: int = 2
    """FARM_GPU_RENDER_SLOTS: concurrent render leases per GPU."""

    encoder_sessions_per_engine: int = 8
    """FARM_ENCODER_SESSIONS_PER_ENGINE: stream sessions one NVENC engine is given (720p60)."""

    host_encoder_budget: int = 0
    """FARM_HOST_ENCODER_BUDGET: NVENC sessions this host may run in all (consumer drivers cap
    them per system); 0 = the driver's cap for consumer cards, no cap for data-centre cards."""

    device_overrides: str = ""
    """FARM_DEVICE_OVERRIDES: JSON ``{"<uuid, model or class>": {"vram_mib": N,
    "encoder_sessions": N, "render_slots": N, "device_class": "..."}}`` applied after probing."""

    render_vram_floor_mib: int = 1024
    """FARM_RENDER_VRAM_FLOOR_MIB: the least VRAM a render lease reserves on a GPU."""

    lease_ttl_s: float = 15.0
    """FARM_LEASE_TTL_S: a lease not renewed for this long is reclaimed."""

    storage_retry_s: float = 600.0
    """FARM_STORAGE_RETRY_S: how long a worker retries, with back-off, a tile or frame its
    storage cannot take for a transient reason (full disk, EIO, S3 5xx or timeouts) before the
    attempt fails. Such retries never count as attempts."""

    agent_timeout_s: float = 15.0
    """FARM_AGENT_TIMEOUT_S: an agent silent for this long leaves the pool with its devices."""

    worker_silent_s: float = 30.0
    """FARM_WORKER_SILENT_S: a render worker or stream service whose last heartbeat is older
    than this shows as silent on the workers page (it beats every FARM_AGENT_TIMEOUT_S / 3)."""

    worker_retention_s: float = 86400.0
    """FARM_WORKER_RETENTION_S: how long a silent worker stays listed before its entry (and
    its disabled flag) is trimmed."""

    stop_grace_s: float = 25.0
    """FARM_STOP_GRACE_S: on SIGTERM, how long the tile being rendered may run before the
    worker abandons it (requeued, not counted as a failure). Below Kubernetes' default 30 s
    termination grace and a spot machine's notice."""

    web_host: str = ""
    """FARM_WEB_HOST: address `farm web` binds; empty = 127.0.0.1 without TLS, 0.0.0.0 with."""

    web_port: int = 8080
    """FARM_WEB_PORT: port of the web UI and API (0 = a free port)."""

    tls_cert: Path | None = None
    """FARM_TLS_CERT: PEM certificate chain; with FARM_TLS_KEY the web serves HTTPS (TLS 1.3+)."""

    tls_key: Path | None = None
    """FARM_TLS_KEY: PEM private key of FARM_TLS_CERT."""

    upload_max_bytes: int = 8 << 30
    """FARM_UPLOAD_MAX_BYTES: largest upload accepted (bytes as sent, compressed or zipped)."""

    unpack_max_bytes: int = 32 << 30
    """FARM_UNPACK_MAX_BYTES: most bytes a zip or compressed .blend may expand to."""

    session_ttl_s: float = 12 * 3600.0
    """FARM_SESSION_TTL_S: lifetime of a browser login session (cookie)."""

    upload_session_ttl_s: float = 24 * 3600.0
    """FARM_UPLOAD_SESSION_TTL_S: an unfinished resumable upload is dropped after this long idle."""

    stream_host: str = "127.0.0.1"
    """FARM_STREAM_HOST: address `farm stream` binds."""

    stream_port: int = 8090
    """FARM_STREAM_PORT: port of the stream service's HTTP API (0 = a free port)."""

    stream_url: str = ""
    """FARM_STREAM_URL: the URL the web reaches this stream service at; empty = from host/port."""

    stream_apps: Path | None = None
    """FARM_STREAM_APPS: a JSON or TOML file of apps added to (or replacing) the built-in
    catalog: ``[{"name", "title", "command": [...], "width", "height", "fps"}]``."""

    stream_grace_s: float = 30.0
    """FARM_STREAM_GRACE_S: a session without viewers ends after this long."""

    stream_min_kbps: int = 500
    """FARM_STREAM_MIN_KBPS: the least video bitrate, whatever the receivers estimate."""

    stream_max_kbps: int = 20000
    """FARM_STREAM_MAX_KBPS: the most video bitrate a session sends."""

    stream_vram_mib: int = 512
    """FARM_STREAM_VRAM_MIB: VRAM (host memory on the CPU device) a stream session reserves."""

    nvenc: str = "auto"
    """FARM_NVENC: ``auto`` (h264_nvenc where it opens on the session's GPU, else libx264),
    ``require`` (NVENC or refuse) or ``off`` (libx264). The fake NVENC (``fake``) exists only
    behind the test suite's entry point (tests/doubles.py)."""

    stun_urls: str = ""
    """FARM_STUN_URLS: comma-separated STUN servers given to viewers (``stun:host:3478``)."""

    turn_urls: str = ""
    """FARM_TURN_URLS: comma-separated TURN servers (``turn:host:3478?transport=udp``)."""

    turn_secret: str = ""
    """FARM_TURN_SECRET: the TURN server's REST shared secret (coturn ``static-auth-secret``)."""

    turn_ttl_s: float = 3600.0
    """FARM_TURN_TTL_S: lifetime of the TURN credentials handed to a viewer."""

    # --- H1: stream sandbox and stream service authentication ---------------------------------

    sandbox: str = "bwrap"
    """FARM_SANDBOX: how members' programs (stream apps, the Blender child) are confined:
    ``bwrap`` (bubblewrap namespaces, an unprivileged uid, a cgroup each) or ``none`` (they run
    as the service's own user: only for a single-user machine, logged loudly at start)."""

    sandbox_uid: int = 64000
    """FARM_SANDBOX_UID: the host uid sandboxed programs run as (not the service's)."""

    sandbox_gid: int = 64000
    """FARM_SANDBOX_GID: the host gid sandboxed programs run as."""

    sandbox_cgroup: str = ""
    """FARM_SANDBOX_CGROUP: a delegated cgroup v2 folder holding the sandboxes' cgroups; empty =
    under the service's own cgroup (v1 memory/pids/cpu where mounted, else v2)."""

    stream_memory_mib: int = 2048
    """FARM_STREAM_MEMORY_MIB: memory (RAM + swap) of one stream session's display and app; a
    catalog entry's ``memory_mib`` overrides it; 0 = no limit."""

    stream_pids: int = 256
    """FARM_STREAM_PIDS: processes and threads one stream session's app may have; a catalog
    entry's ``pids`` overrides it; 0 = no limit."""

    stream_cpu_cores: float = 2.0
    """FARM_STREAM_CPU_CORES: CPU one stream session's app may use (cores); a catalog entry's
    ``cpu_cores`` overrides it; 0 = no limit."""

    stream_secret: str = ""
    """FARM_STREAM_SECRET: the secret the web signs stream tokens with and the stream service
    checks them with (HMAC-SHA256); operators call the service with an operator token made
    from it. `farm up` generates one; the service refuses to start without it."""

    stream_token_ttl_s: float = 300.0
    """FARM_STREAM_TOKEN_TTL_S: lifetime of a stream token the web signs (one per request)."""

    # --- H9: stream limits and survival (issue #18 items 5-7) -------------------------------

    stream_connect_timeout_s: float = 20.0
    """FARM_STREAM_CONNECT_TIMEOUT_S: a viewer whose connection has not come up this long after
    it joined is removed (its session then ends after FARM_STREAM_GRACE_S without viewers)."""

    stream_input_rate: float = 250.0
    """FARM_STREAM_INPUT_RATE: input messages per second one viewer may send (a burst of as
    many is allowed); more are dropped and counted."""

    stream_message_max_bytes: int = 65536
    """FARM_STREAM_MESSAGE_MAX_BYTES: the largest viewer message taken (input, clipboard text);
    larger ones are dropped and counted."""

    stream_capture_retries: int = 2
    """FARM_STREAM_CAPTURE_RETRIES: times a session's capture that failed is started again
    (restarting its display when that died) before the session ends."""

    stream_encode_mpx_s: float = 0.0
    """FARM_STREAM_ENCODE_MPX_S: megapixels a second this device's encoder sustains, which
    admission shares among sessions (width x height x fps each); 0 = measured when the stream
    service starts (a short encode of the test pattern)."""

    # --- H7: stream session features (issue #18 items 3-4) ----------------------------------

    stream_resize_max_width: int = 1920
    """FARM_STREAM_RESIZE_MAX_WIDTH: the widest a viewer may resize a session's display to (its
    Xvfb framebuffer; a session started wider keeps its own width as the limit)."""

    stream_resize_max_height: int = 1080
    """FARM_STREAM_RESIZE_MAX_HEIGHT: the tallest a viewer may resize a session's display to."""

    stream_file_max_mib: int = 256
    """FARM_STREAM_FILE_MAX_MIB: the largest file a viewer may upload into a session's home."""

    # --- H10: stream sessions' audio (issue #18 item 3) --------------------------------------

    stream_audio: int = 1
    """FARM_STREAM_AUDIO: 1 = sessions of apps with ``audio`` in the catalog send their sound
    (a PulseAudio null sink in the session's sandbox, Opus to every viewer); 0 = none does."""

    # --- H2: the Blender child's sandbox (issue #11 item 3) --------------------------------

    blender_memory_mib: int = 0
    """FARM_BLENDER_MEMORY_MIB: memory (RAM + swap) of one sandboxed Blender child; 0 = no
    limit (a scene's needs vary: set it to what the worker's host can give one child)."""

    blender_pids: int = 1024
    """FARM_BLENDER_PIDS: processes and threads one Blender child may have (Cycles runs a
    thread per core); 0 = no limit."""

    blender_cpu_cores: float = 0.0
    """FARM_BLENDER_CPU_CORES: CPU one Blender child may use (cores); 0 = no limit."""

    metrics_port: int = 0
    """FARM_METRICS_PORT: port of a render worker's Prometheus /metrics server; 0 = none (the
    web and the stream service serve /metrics on their own port)."""

    metrics_host: str = "127.0.0.1"
    """FARM_METRICS_HOST: address a render worker's /metrics server binds (0.0.0.0 in a
    container)."""

    usage_prices: str = ""
    """FARM_USAGE_PRICES: JSON price per device-hour by device class, ``{"t4": 0.35, "a100":
    2.9, "cpu": 0.04, "*": 1.0}`` (``*``: any other class); unset prices cost 0."""

    usage_currency: str = "USD"
    """FARM_USAGE_CURRENCY: the currency of FARM_USAGE_PRICES (a label only)."""

    grid_carbon_g_per_kwh: float = 400.0
    """FARM_GRID_CARBON_G_PER_KWH: grid carbon intensity for CO2e (gCO2e per kWh; set the
    figure of your grid or provider)."""

    device_watts: str = ""
    """FARM_DEVICE_WATTS: JSON watts per device class, ``{"t4": 70, "cpu": 120}``, to estimate
    energy where NVML has no energy counter (defaults: the boards' rated power)."""

    usage_raw_retention_s: float = 30 * 86400.0
    """FARM_USAGE_RAW_RETENTION_S: raw usage entries (one per lease) older than this are rolled
    up into hourly totals per project, class, kind and job, and trimmed (default 30 days)."""

    job_retention_s: float = 7 * 86400.0
    """FARM_JOB_RETENTION_S: this long after a job ended, its tiles, events and delivery records
    leave Redis; its summary (spec, state, times, counters) stays (default 7 days)."""

    # --- H4: deployment (issue #12) -----------------------------------------------------------

    s3_public_url: str = ""
    """FARM_S3_PUBLIC_URL: the S3 endpoint as browsers reach it (``https://files.example.com``):
    download links are presigned against it while the farm talks to FARM_S3_ENDPOINT_URL.
    Empty: links go to AWS S3 itself or, with FARM_S3_ENDPOINT_URL set, the web streams the
    files (an in-cluster name such as ``http://minio:9000`` is no address for a browser)."""

    data_dir: Path | None = None
    """FARM_DATA_DIR: `farm up`'s Redis, storage and logs; unset = ``$XDG_DATA_HOME/tessera``
    (``~/.local/share/tessera``), never the current folder."""

    web_farm_metrics: str = "on"
    """FARM_WEB_FARM_METRICS: ``on``: this web's /metrics carries the farm-wide metrics read
    from Redis (queues, devices, leases, usage); ``off`` on every web replica but one, or each
    replica exports them and sums count them once per replica."""

    # --- scheduling: tags, limits, blocklist (issue #16 item 4) ------------------------------

    worker_tags: str = ""
    """FARM_WORKER_TAGS: comma-separated tags of this worker (``big-ram,houdini-licence``); it
    takes the tiles of untagged jobs and of jobs whose every tag it has."""

    tag_limits: str = ""
    """FARM_TAG_LIMITS: JSON ``{"tag": K}``: at most K tiles of jobs with that tag render at once,
    farm-wide (licences); give every worker the same value."""

    blocklist_failures: int = 3
    """FARM_BLOCKLIST_FAILURES: counted tile failures of one job on one worker after which that
    worker takes no more of that job's tiles (until the job's blocklist is cleared)."""

    # --- H3: web request hardening and per-project limits ------------------------------------

    web_origins: str = ""
    """FARM_WEB_ORIGINS: comma-separated origins the pages are reached at besides the web's own
    (``https://farm.example.com`` behind a TLS proxy); cookie-authenticated writes from any
    other origin are refused."""

    metrics_token: str = ""
    """FARM_METRICS_TOKEN: the bearer token the web's /metrics asks for; empty = a farm
    admin's API token. Give FARM_WEB_METRICS_PORT instead to serve it on its own address."""

    web_metrics_port: int = 0
    """FARM_WEB_METRICS_PORT: serve the web's /metrics without a token on
    FARM_METRICS_HOST:this port (a scrape-only address) instead of on the web's port; 0 = no."""

    project_max_uploads: int = 4
    """FARM_PROJECT_MAX_UPLOADS: uploads of one project in flight at once, farm-wide."""

    project_max_inspections: int = 4
    """FARM_PROJECT_MAX_INSPECTIONS: inspections of one project running at once, farm-wide."""

    project_max_queued_tiles: int = 200_000
    """FARM_PROJECT_MAX_QUEUED_TILES: tiles of one project's unfinished jobs, farm-wide."""

    job_max_tiles: int = 100_000
    """FARM_JOB_MAX_TILES: tiles (frames x tiles per frame) one job may have."""

    project_max_stored_bytes: int = 1 << 40
    """FARM_PROJECT_MAX_STORED_BYTES: bytes of uploads one project may keep (1 TiB)."""

    upload_checks: int = 2
    """FARM_UPLOAD_CHECKS: zip and decompression checks one web process runs at once (each
    on its own thread, apart from the threads that answer requests)."""

    # --- H-events: webhooks (issue #16 item 5) ------------------------------------------------

    webhook_allow_private: int = 0
    """FARM_WEBHOOK_ALLOW_PRIVATE: 1 = webhooks may go to loopback, link-local and private
    addresses (a farm on a private network whose receivers are there too); 0 = public
    addresses only, checked when each request is sent, so members cannot reach the farm's own
    network through a hook."""

    webhook_max_attempts: int = 8
    """FARM_WEBHOOK_MAX_ATTEMPTS: tries of one delivery before it is marked failed."""

    webhook_backoff_s: float = 10.0
    """FARM_WEBHOOK_BACKOFF_S: the wait after a delivery's first failed try; it doubles with
    each try (with jitter: between half and all of it), up to FARM_WEBHOOK_BACKOFF_MAX_S."""

    webhook_backoff_max_s: float = 3600.0
    """FARM_WEBHOOK_BACKOFF_MAX_S: the longest wait between two tries of a delivery."""

    webhook_timeout_s: float = 10.0
    """FARM_WEBHOOK_TIMEOUT_S: how long one webhook request may take (connect to answer)."""

    webhook_max_per_project: int = 10
    """FARM_WEBHOOK_MAX_PER_PROJECT: webhooks one project may have."""

    # --- webhooks for operators: Retry-After, secret rotation

    webhook_retry_after_max_s: float = 3600.0
    """FARM_WEBHOOK_RETRY_AFTER_MAX_S: the longest a delivery waits for a receiver's 429 or
    503 ``Retry-After``; it is retried no sooner than asked, up to this."""

    webhook_secret_grace_s: float = 86400.0
    """FARM_WEBHOOK_SECRET_GRACE_S: after a hook's secret is rotated, how long deliveries are
    signed with the old secret too (a second ``v1=`` in X-Tessera-Signature)."""

    # --- estimates before submit (farm.estimate, farm.estimaterecords, farm.budget)

    estimate_probe_s: float = 2.0
    """FARM_ESTIMATE_PROBE_S: render time the estimate's probe aims at for its sampled renders,
    all probed frames together (its one-sample renders come on top)."""

    estimate_probe_pixels: int = 16384
    """FARM_ESTIMATE_PROBE_PIXELS: pixels of the probe's scaled-down frame (about 170x96)."""

    estimate_probe_frames: int = 3
    """FARM_ESTIMATE_PROBE_FRAMES: frames of an animation the probe renders (first, last and
    evenly between)."""

    device_speeds: str = ""
    """FARM_DEVICE_SPEEDS: JSON render speed by device class, a host's CPUs = 1, ``{"t4": 4,
    "a100": 14}``, used where the farm has not yet measured a ratio between two classes
    (defaults: farm.estimate.DEFAULT_SPEEDS)."""

    estimate_errors_max: int = 10000
    """FARM_ESTIMATE_ERRORS_MAX: estimate-vs-actual records the farm keeps (the oldest go)."""

    # --- live preview (issue #17 part 1) ------------------------------------------------------

    live_preview_ttl_s: float = 3600.0
    """FARM_LIVE_PREVIEW_TTL_S: a live-preview job's pass images stay in Redis this long after
    its last pass (viewers joining mid-frame start from them); they are small 8-bit JPEGs."""

    live_preview_budget: float = 0.05
    """FARM_LIVE_PREVIEW_BUDGET: what a live-preview tile's sample passes may cost over one
    plain render of it, as a fraction of that render, as the worker estimates it from the
    passes done (it merges the passes still to come once more render calls would cost more).
    0.05 leaves room for the estimate's error under the 1.10x target: at 0.10 whole jobs
    measured 1.16x (bench/preview_latency.py)."""

    # --- live preview over WebRTC (issue #17 part 1) ------------------------------------------

    live_webrtc_per_job: int = 4
    """FARM_LIVE_WEBRTC_PER_JOB: viewers of one job that a web process sends the live preview
    as a WebRTC video (one encode each); more are refused and watch over JPEG/SSE. 0 turns the
    WebRTC path off."""

    live_webrtc_peers: int = 32
    """FARM_LIVE_WEBRTC_PEERS: live-preview WebRTC viewers of all jobs in one web process."""

    live_webrtc_idle_s: float = 120.0
    """FARM_LIVE_WEBRTC_IDLE_S: a live-preview viewer's connection closes after this long
    without a pass landing (its page falls back to JPEG/SSE), or that long unconnected."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for attr, (name, kind, minimum) in ENV.items():
            raw = env.get(name, "")
            if raw == "":
                continue
            if kind in (str, Path):
                values[attr] = kind(raw)
                continue
            try:
                value = kind(raw)
            except ValueError:
                raise BadParameter(f"{name}={raw!r} is not a number") from None
            if not math.isfinite(value):
                raise BadParameter(f"{name}={raw!r} must be a finite number")
            if value < minimum:
                raise BadParameter(f"{name} must be at least {minimum}, not {value}")
            values[attr] = value
        return replace(cls(), **values).validated()

    def to_env(self) -> dict[str, str]:
        """The FARM_* variables that rebuild these settings in a child process."""
        return {
            name: str(getattr(self, attr))
            for attr, (name, _kind, _minimum) in ENV.items()
            if getattr(self, attr) is not None
        }

    def validated(self) -> Settings:
        if self.log_level.upper() not in LOG_LEVELS:
            raise BadParameter(
                f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
            )
        if self.log_level != self.log_level.upper():
            return replace(self, log_level=self.log_level.upper()).validated()
        if self.gpu_backend is not None and self.gpu_backend != self.gpu_backend.upper():
            return replace(self, gpu_backend=self.gpu_backend.upper()).validated()
        if self.nvml not in NVML_MODES:
            # only another value loads the NVML module: it knows the test doubles, if any
            from farm.gpu.factory import check_spec

            check_spec(self.nvml)
        if self.device not in DEVICE_KINDS:
            raise BadParameter(f"device {self.device!r} is not one of {', '.join(DEVICE_KINDS)}")
        redisurl.check(self.redis_url)
        if self.control_redis_url:
            redisurl.check(self.control_redis_url)
        if self.cell:
            check_cell(self.cell)
        if self.cells:
            parse_cells(self.cells)
        for attr, allowed in STORAGE_CHOICES.items():
            if getattr(self, attr) not in allowed:
                raise BadParameter(
                    f"{ENV[attr][0]}={getattr(self, attr)!r} is not one of "
                    f"{', '.join(repr(a) for a in allowed)}"
                )
        if self.presign_expiry_s > PRESIGN_MAX_S:
            raise BadParameter(f"FARM_PRESIGN_EXPIRY_S is at most {PRESIGN_MAX_S} (7 days)")
        if self.gpu_backend is not None and self.gpu_backend.upper() not in GPU_BACKENDS:
            raise BadParameter(
                f"GPU backend {self.gpu_backend!r} is not one of {', '.join(GPU_BACKENDS)}"
            )
        if self.nvenc not in NVENC_MODES:
            # only another value loads the encoder (PyAV): it knows the test doubles, if any
            from encoder.videoencoder import check_mode

            check_mode(self.nvenc)
        if self.sandbox not in SANDBOX_MODES:
            raise BadParameter(f"FARM_SANDBOX {self.sandbox!r} is not one of bwrap, none")
        if self.stream_min_kbps > self.stream_max_kbps:
            raise BadParameter(
                f"FARM_STREAM_MIN_KBPS ({self.stream_min_kbps}) is above FARM_STREAM_MAX_KBPS "
                f"({self.stream_max_kbps})"
            )
        from farm import tags  # the tag rules live with the tags

        tags.worker_tags(self.worker_tags)
        tags.tag_limits(self.tag_limits)
        return self

    def worker_name(self) -> str:
        """A worker's default name: host, device, pid and a random part (unique on the farm).

        Host and pid alone repeat when a container restarts (same hostname, same small pid),
        and rq then refuses the new worker while the killed one's registration lives on
        (found by `make test-stack`: a worker SIGKILLed mid-job could not come back)."""
        device = self.device if self.gpu_index is None else f"gpu{self.gpu_index}"
        return f"{socket.gethostname()}-{device}-{os.getpid()}-{secrets.token_hex(3)}"

    @property
    def accounts_redis_url(self) -> str:
        """The Redis holding accounts: the control Redis in a farm of cells, else the farm's."""
        return self.control_redis_url or self.redis_url

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes).validated()


#: every setting's variable, type and least value: the one table from_env and to_env read
ENV: dict[str, tuple[str, type, float]] = {
    "redis_url": ("FARM_REDIS_URL", str, 0),
    "control_redis_url": ("FARM_CONTROL_REDIS_URL", str, 0),
    "cell": ("FARM_CELL", str, 0),
    "cells": ("FARM_CELLS", str, 0),
    "storage_dir": ("FARM_STORAGE_DIR", Path, 0),
    "storage_url": ("FARM_STORAGE_URL", str, 0),
    "s3_endpoint_url": ("FARM_S3_ENDPOINT_URL", str, 0),
    "s3_region": ("FARM_S3_REGION", str, 0),
    "s3_addressing_style": ("FARM_S3_ADDRESSING_STYLE", str, 0),
    "s3_storage_class": ("FARM_S3_STORAGE_CLASS", str, 0),
    "s3_sse": ("FARM_S3_SSE", str, 0),
    "s3_kms_key_id": ("FARM_S3_KMS_KEY_ID", str, 0),
    "s3_checksum": ("FARM_S3_CHECKSUM", str, 0),
    "s3_multipart_threshold_mib": ("FARM_S3_MULTIPART_THRESHOLD_MIB", int, 5),
    "s3_multipart_chunk_mib": ("FARM_S3_MULTIPART_CHUNK_MIB", int, 5),
    "s3_max_concurrency": ("FARM_S3_MAX_CONCURRENCY", int, 1),
    "s3_max_attempts": ("FARM_S3_MAX_ATTEMPTS", int, 1),
    "s3_timeout_s": ("FARM_S3_TIMEOUT_S", float, 0.1),
    "presign_expiry_s": ("FARM_PRESIGN_EXPIRY_S", int, 1),
    "tile_retention": ("FARM_TILE_RETENTION", str, 0),
    "work_dir": ("FARM_WORK_DIR", Path, 0),
    "device": ("FARM_DEVICE", str, 0),
    "gpu_index": ("FARM_GPU_INDEX", int, 0),
    "gpu_backend": ("FARM_GPU_BACKEND", str, 0),
    "cpu_threads": ("FARM_CPU_THREADS", int, 0),
    "tile_timeout_s": ("FARM_TILE_TIMEOUT_S", float, 1.0),
    "inspect_timeout_s": ("FARM_INSPECT_TIMEOUT_S", float, 1.0),
    "max_attempts": ("FARM_MAX_ATTEMPTS", int, 1),
    "python": ("FARM_BLENDER_PYTHON", str, 0),
    "log_level": ("FARM_LOG_LEVEL", str, 0),
    "nvml": ("FARM_NVML", str, 0),
    "cpu_render_slots": ("FARM_CPU_RENDER_SLOTS", int, 0),
    "cpu_encode_sessions": ("FARM_CPU_ENCODE_SESSIONS", int, 0),
    "gpu_render_slots": ("FARM_GPU_RENDER_SLOTS", int, 1),
    "encoder_sessions_per_engine": ("FARM_ENCODER_SESSIONS_PER_ENGINE", int, 1),
    "host_encoder_budget": ("FARM_HOST_ENCODER_BUDGET", int, 0),
    "device_overrides": ("FARM_DEVICE_OVERRIDES", str, 0),
    "render_vram_floor_mib": ("FARM_RENDER_VRAM_FLOOR_MIB", int, 0),
    "lease_ttl_s": ("FARM_LEASE_TTL_S", float, 0.1),
    "storage_retry_s": ("FARM_STORAGE_RETRY_S", float, 0),
    "agent_timeout_s": ("FARM_AGENT_TIMEOUT_S", float, 0.1),
    "worker_silent_s": ("FARM_WORKER_SILENT_S", float, 0.1),
    "worker_retention_s": ("FARM_WORKER_RETENTION_S", float, 1.0),
    "metrics_port": ("FARM_METRICS_PORT", int, 0),
    "metrics_host": ("FARM_METRICS_HOST", str, 0),
    "usage_prices": ("FARM_USAGE_PRICES", str, 0),
    "usage_currency": ("FARM_USAGE_CURRENCY", str, 0),
    "grid_carbon_g_per_kwh": ("FARM_GRID_CARBON_G_PER_KWH", float, 0.0),
    "device_watts": ("FARM_DEVICE_WATTS", str, 0),
    "usage_raw_retention_s": ("FARM_USAGE_RAW_RETENTION_S", float, 0.0),
    "job_retention_s": ("FARM_JOB_RETENTION_S", float, 0.0),
    "stream_host": ("FARM_STREAM_HOST", str, 0),
    "stream_port": ("FARM_STREAM_PORT", int, 0),
    "stream_url": ("FARM_STREAM_URL", str, 0),
    "stream_apps": ("FARM_STREAM_APPS", Path, 0),
    "stream_grace_s": ("FARM_STREAM_GRACE_S", float, 0.0),
    "stream_min_kbps": ("FARM_STREAM_MIN_KBPS", int, 50),
    "stream_max_kbps": ("FARM_STREAM_MAX_KBPS", int, 50),
    "stream_vram_mib": ("FARM_STREAM_VRAM_MIB", int, 0),
    "nvenc": ("FARM_NVENC", str, 0),
    "stun_urls": ("FARM_STUN_URLS", str, 0),
    "turn_urls": ("FARM_TURN_URLS", str, 0),
    "turn_secret": ("FARM_TURN_SECRET", str, 0),
    "turn_ttl_s": ("FARM_TURN_TTL_S", float, 60.0),
    # H1: stream sandbox and stream service authentication
    "sandbox": ("FARM_SANDBOX", str, 0),
    "sandbox_uid": ("FARM_SANDBOX_UID", int, 1),
    "sandbox_gid": ("FARM_SANDBOX_GID", int, 1),
    "sandbox_cgroup": ("FARM_SANDBOX_CGROUP", str, 0),
    "stream_memory_mib": ("FARM_STREAM_MEMORY_MIB", int, 0),
    "stream_pids": ("FARM_STREAM_PIDS", int, 0),
    "stream_cpu_cores": ("FARM_STREAM_CPU_CORES", float, 0.0),
    "stream_secret": ("FARM_STREAM_SECRET", str, 0),
    "stream_token_ttl_s": ("FARM_STREAM_TOKEN_TTL_S", float, 5.0),
    # H9: stream limits and survival
    "stream_connect_timeout_s": ("FARM_STREAM_CONNECT_TIMEOUT_S", float, 0.1),
    "stream_input_rate": ("FARM_STREAM_INPUT_RATE", float, 1.0),
    "stream_message_max_bytes": ("FARM_STREAM_MESSAGE_MAX_BYTES", int, 256),
    "stream_capture_retries": ("FARM_STREAM_CAPTURE_RETRIES", int, 0),
    "stream_encode_mpx_s": ("FARM_STREAM_ENCODE_MPX_S", float, 0.0),
    # H7: stream session features
    "stream_resize_max_width": ("FARM_STREAM_RESIZE_MAX_WIDTH", int, 64),
    "stream_resize_max_height": ("FARM_STREAM_RESIZE_MAX_HEIGHT", int, 64),
    "stream_file_max_mib": ("FARM_STREAM_FILE_MAX_MIB", int, 1),
    "stream_audio": ("FARM_STREAM_AUDIO", int, 0),
    # H2: the Blender child's sandbox
    "blender_memory_mib": ("FARM_BLENDER_MEMORY_MIB", int, 0),
    "blender_pids": ("FARM_BLENDER_PIDS", int, 0),
    "blender_cpu_cores": ("FARM_BLENDER_CPU_CORES", float, 0.0),
    "stop_grace_s": ("FARM_STOP_GRACE_S", float, 0),
    "web_host": ("FARM_WEB_HOST", str, 0),
    "web_port": ("FARM_WEB_PORT", int, 0),
    "tls_cert": ("FARM_TLS_CERT", Path, 0),
    "tls_key": ("FARM_TLS_KEY", Path, 0),
    "upload_max_bytes": ("FARM_UPLOAD_MAX_BYTES", int, 1),
    "unpack_max_bytes": ("FARM_UNPACK_MAX_BYTES", int, 1),
    "session_ttl_s": ("FARM_SESSION_TTL_S", float, 1.0),
    "upload_session_ttl_s": ("FARM_UPLOAD_SESSION_TTL_S", float, 1.0),
    # H4: deployment (issue #12)
    "s3_public_url": ("FARM_S3_PUBLIC_URL", str, 0),
    "data_dir": ("FARM_DATA_DIR", Path, 0),
    "web_farm_metrics": ("FARM_WEB_FARM_METRICS", str, 0),
    # scheduling (issue #16 item 4)
    "worker_tags": ("FARM_WORKER_TAGS", str, 0),
    "tag_limits": ("FARM_TAG_LIMITS", str, 0),
    "blocklist_failures": ("FARM_BLOCKLIST_FAILURES", int, 1),
    # H3: web request hardening and per-project limits
    "web_origins": ("FARM_WEB_ORIGINS", str, 0),
    "metrics_token": ("FARM_METRICS_TOKEN", str, 0),
    "web_metrics_port": ("FARM_WEB_METRICS_PORT", int, 0),
    "project_max_uploads": ("FARM_PROJECT_MAX_UPLOADS", int, 1),
    "project_max_inspections": ("FARM_PROJECT_MAX_INSPECTIONS", int, 1),
    "project_max_queued_tiles": ("FARM_PROJECT_MAX_QUEUED_TILES", int, 1),
    "job_max_tiles": ("FARM_JOB_MAX_TILES", int, 1),
    "project_max_stored_bytes": ("FARM_PROJECT_MAX_STORED_BYTES", int, 1),
    "upload_checks": ("FARM_UPLOAD_CHECKS", int, 1),
    # H-events: webhooks
    "webhook_allow_private": ("FARM_WEBHOOK_ALLOW_PRIVATE", int, 0),
    "webhook_max_attempts": ("FARM_WEBHOOK_MAX_ATTEMPTS", int, 1),
    "webhook_backoff_s": ("FARM_WEBHOOK_BACKOFF_S", float, 0.01),
    "webhook_backoff_max_s": ("FARM_WEBHOOK_BACKOFF_MAX_S", float, 0.01),
    "webhook_timeout_s": ("FARM_WEBHOOK_TIMEOUT_S", float, 0.1),
    "webhook_max_per_project": ("FARM_WEBHOOK_MAX_PER_PROJECT", int, 0),
    # webhooks for operators
    "webhook_retry_after_max_s": ("FARM_WEBHOOK_RETRY_AFTER_MAX_S", float, 0.0),
    "webhook_secret_grace_s": ("FARM_WEBHOOK_SECRET_GRACE_S", float, 0.0),
    # estimates before submit
    "estimate_probe_s": ("FARM_ESTIMATE_PROBE_S", float, 0.01),
    "estimate_probe_pixels": ("FARM_ESTIMATE_PROBE_PIXELS", int, 64),
    "estimate_probe_frames": ("FARM_ESTIMATE_PROBE_FRAMES", int, 1),
    "device_speeds": ("FARM_DEVICE_SPEEDS", str, 0),
    "estimate_errors_max": ("FARM_ESTIMATE_ERRORS_MAX", int, 1),
    # live preview (issue #17 part 1)
    "live_preview_ttl_s": ("FARM_LIVE_PREVIEW_TTL_S", float, 1.0),
    "live_preview_budget": ("FARM_LIVE_PREVIEW_BUDGET", float, 0.0),
    # live preview over WebRTC (issue #17 part 1)
    "live_webrtc_per_job": ("FARM_LIVE_WEBRTC_PER_JOB", int, 0),
    "live_webrtc_peers": ("FARM_LIVE_WEBRTC_PEERS", int, 0),
    "live_webrtc_idle_s": ("FARM_LIVE_WEBRTC_IDLE_S", float, 1.0),
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: the settings that take one of a few words
STORAGE_CHOICES: dict[str, tuple[str, ...]] = {
    "s3_addressing_style": ("auto", "path", "virtual"),
    "s3_sse": ("", "AES256", "aws:kms"),
    "s3_checksum": ("when_supported", "when_required"),
    "tile_retention": ("delete", "keep"),
    "web_farm_metrics": ("on", "off"),  # H4
}
#: SigV4 presigned URLs live at most 7 days
PRESIGN_MAX_S = 7 * 86400
#: FARM_NVML: which NVML the farm opens (farm.gpu.factory; test doubles add their schemes there)
NVML_MODES = ("auto", "real")
#: FARM_NVENC policies: where the stream service encodes with h264_nvenc (encoder.videoencoder;
#: test doubles add their modes there)
NVENC_MODES = ("auto", "require", "off")
#: FARM_SANDBOX: bubblewrap, or none (an operator's explicit choice on a single-user machine)
SANDBOX_MODES = ("bwrap", "none")
#: Cycles compute backends in the order a worker prefers them
GPU_BACKENDS = ("OPTIX", "CUDA", "HIP", "ONEAPI", "METAL")


def json_object(text: str, name: str, expected: str) -> dict[str, Any]:
    """A setting holding a JSON object (``name``: its FARM_* variable); blank is ``{}``.

    ``expected`` ends the error for another JSON value: "must be a JSON object <expected>".
    """
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadParameter(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadParameter(f"{name} must be a JSON object {expected}")
    return data


def default_data_dir(env: Mapping[str, str] | None = None) -> Path:
    """`farm up`'s data folder where FARM_DATA_DIR is unset: ``tessera`` in the XDG data home."""
    env = os.environ if env is None else env
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return Path(env.get("XDG_DATA_HOME") or home / ".local" / "share") / "tessera"
