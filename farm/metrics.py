"""Prometheus metrics: every metric Tessera exports, by name, and how a process serves them.

Each process keeps its own metrics in ``REGISTRY`` and serves it at ``/metrics``:

- a render worker (and any process without an HTTP server): ``start_metrics_server(port)``;
- an aiohttp process (web, stream service): a handler returning ``exposition()``'s body and
  content type, run in an executor when the farm collector is registered (it reads Redis);
- the farm-wide state (queue depth, device capacity and use, leases, usage totals) is read from
  Redis at scrape time by ``FarmCollector``; the web registers it
  (``register_farm_collector(settings)``) so that one target answers for the whole farm.

Render workers count tiles and time them (``TILES_RENDERED``, ``TILES_FAILED``,
``TILE_SECONDS``, ``JOB_SECONDS``); device agents (worker, stream service) set the NVML gauges
of their GPUs at each heartbeat (``observe_gpus``); the stream service sets the ``STREAM_*``
metrics and calls ``forget_stream_session`` when a session ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from farm.errors import FarmError

if TYPE_CHECKING:
    from farm.alloc.devices import Device
    from farm.gpu.types import GpuInfo
    from farm.jobstore import JobStore
    from farm.settings import Settings

log = logging.getLogger("tessera.metrics")

MIB = 1024 * 1024

#: this process's metrics; ``exposition`` and ``start_metrics_server`` serve it
REGISTRY = CollectorRegistry(auto_describe=True)
_PROCESS = ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# --- render worker -----------------------------------------------------------------------------

TILES_RENDERED = Counter(
    "tessera_tiles_rendered",
    "Tiles rendered and committed by this worker.",
    ["device_class"],
    registry=REGISTRY,
)
TILES_FAILED = Counter(
    "tessera_tiles_failed",
    "Tile attempts that failed on this worker; counts=false: requeued without counting "
    "(preempted, no room, lease lost).",
    ["device_class", "counts"],
    registry=REGISTRY,
)
TILE_SECONDS = Histogram(
    "tessera_tile_duration_seconds",
    "Wall time of one tile on a worker: lease held, Blender render, tile stored.",
    ["device_class"],
    buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)
JOB_SECONDS = Histogram(
    "tessera_job_duration_seconds",
    "Time from a job's submission to its end (observed by the worker that ended it).",
    ["state"],
    buckets=(5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400),
    registry=REGISTRY,
)


def observe_job_end(store: JobStore, job_id: str) -> None:
    """Observe the job's duration if it has ended (call after a step that may have ended it)."""
    from farm.states import JOB_FINAL, JobState

    status = store.status(job_id)
    if JobState(status.state) in JOB_FINAL and status.finished_s is not None:
        JOB_SECONDS.labels(status.state).observe(max(0.0, status.finished_s - status.created_s))


# --- GPUs, as NVML reports them (set by a device agent at each heartbeat) -----------------------

_GPU_LABELS = ["device", "device_class", "host"]
GPU_UTILIZATION = Gauge(
    "tessera_gpu_utilization_percent", "GPU busy time over NVML's last sample period.",
    _GPU_LABELS, registry=REGISTRY,
)  # fmt: skip
GPU_MEMORY_USED = Gauge(
    "tessera_gpu_memory_used_bytes", "GPU memory in use, by any process.", _GPU_LABELS,
    registry=REGISTRY,
)  # fmt: skip
GPU_MEMORY_TOTAL = Gauge(
    "tessera_gpu_memory_total_bytes", "GPU memory in all.", _GPU_LABELS, registry=REGISTRY
)
GPU_POWER = Gauge(
    "tessera_gpu_power_watts", "GPU power draw now (absent where NVML does not report it).",
    _GPU_LABELS, registry=REGISTRY,
)  # fmt: skip
GPU_ENERGY = Gauge(
    "tessera_gpu_energy_joules",
    "NVML's total-energy counter (since the driver loaded); use rate() for watts.",
    _GPU_LABELS,
    registry=REGISTRY,
)
GPU_ENCODER_SESSIONS = Gauge(
    "tessera_gpu_encoder_sessions", "NVENC sessions open on the GPU, from any process.",
    _GPU_LABELS, registry=REGISTRY,
)  # fmt: skip

# --- stream service -----------------------------------------------------------------------------

STREAM_SESSIONS = Gauge(
    "tessera_stream_sessions", "Stream sessions running on this service.",
    ["device", "encoder"], registry=REGISTRY,
)  # fmt: skip
STREAM_VIEWERS = Gauge(
    "tessera_stream_viewers", "Viewers (player and spectators) of this service's sessions.",
    ["device"], registry=REGISTRY,
)  # fmt: skip
STREAM_FPS = Gauge(
    "tessera_stream_fps", "Frames encoded per second by one session.", ["session"],
    registry=REGISTRY,
)  # fmt: skip
STREAM_BITRATE = Gauge(
    "tessera_stream_bitrate_bits_per_second", "Encoder output rate of one session.",
    ["session"], registry=REGISTRY,
)  # fmt: skip
STREAM_ROUND_TRIP = Gauge(
    "tessera_stream_round_trip_seconds", "Last round trip measured to a session's controlling "
    "viewer (data-channel ping).", ["session"], registry=REGISTRY,
)  # fmt: skip
STREAM_ROUND_TRIPS = Histogram(
    "tessera_stream_round_trip_distribution_seconds",
    "Round trips to viewers (data-channel ping), all sessions together.",
    buckets=(0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)
STREAM_FRAMES = Counter(
    "tessera_stream_frames_encoded", "Frames encoded by this service.", ["encoder"],
    registry=REGISTRY,
)  # fmt: skip

STREAM_MESSAGES_DROPPED = Counter(
    "tessera_stream_messages_dropped", "Viewer messages dropped (too large, too deeply nested, "
    "malformed, over the input rate).", ["reason"], registry=REGISTRY,
)  # fmt: skip

# --- web: webhooks ------------------------------------------------------------------------------

WEBHOOK_ATTEMPTS = Counter(
    "tessera_webhook_attempts", "Webhook requests this web's dispatcher sent, by outcome: "
    "delivered, retry (to be tried again), failed (no tries left, or a refused address), and "
    "dropped deliveries (their hook was deleted).", ["outcome"], registry=REGISTRY,
)  # fmt: skip

# --- the front door of a farm in cells (web/frontdoor.py) -------------------------------------

FRONTDOOR_REQUESTS = Counter(
    "tessera_frontdoor_requests", "Requests the front door sent to a cell's web, by cell and "
    "the cell's status class (2xx, 3xx, 4xx, 5xx), or unreachable.", ["cell", "status"],
    registry=REGISTRY,
)  # fmt: skip
FRONTDOOR_SECONDS = Histogram(
    "tessera_frontdoor_request_duration_seconds", "From the front door sending a request to "
    "a cell to that cell's answer's headers, by cell.", ["cell"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
    registry=REGISTRY,
)  # fmt: skip

_SESSION_GAUGES = (STREAM_FPS, STREAM_BITRATE, STREAM_ROUND_TRIP)

#: the families ``FarmCollector`` yields, with their types
FARM_FAMILIES: dict[str, str] = {
    "tessera_farm_up": "gauge",
    "tessera_queue_depth": "gauge",
    "tessera_device_vram_bytes": "gauge",
    "tessera_device_vram_used_bytes": "gauge",
    "tessera_device_encoder_sessions": "gauge",
    "tessera_device_encoder_sessions_used": "gauge",
    "tessera_device_render_slots": "gauge",
    "tessera_device_render_slots_used": "gauge",
    "tessera_device_up": "gauge",
    "tessera_device_leases": "gauge",
    "tessera_usage_device_seconds": "counter",
    "tessera_usage_energy_joules": "counter",
}

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


def exported_names() -> set[str]:
    """Every sample name a Tessera process may expose (dashboards and alerts use these)."""
    families: list[tuple[str, str]] = list(FARM_FAMILIES.items())
    own = (TILES_RENDERED, TILES_FAILED, TILE_SECONDS, JOB_SECONDS, GPU_UTILIZATION,
           GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_POWER, GPU_ENERGY, GPU_ENCODER_SESSIONS,
           STREAM_SESSIONS, STREAM_VIEWERS, STREAM_FPS, STREAM_BITRATE, STREAM_ROUND_TRIP,
           STREAM_ROUND_TRIPS, STREAM_FRAMES, STREAM_MESSAGES_DROPPED,
           WEBHOOK_ATTEMPTS, FRONTDOOR_REQUESTS, FRONTDOOR_SECONDS)  # fmt: skip
    for metric in own:
        families += [(m.name, m.type) for m in metric.describe()]
    families += [(m.name, m.type) for m in _PROCESS.collect()]
    return {name + suffix for name, kind in families for suffix in _SUFFIXES.get(kind, ("",))}


def forget_stream_session(session_id: str) -> None:
    """Drop an ended session's per-session series (fps, bitrate, round trip)."""
    for gauge in _SESSION_GAUGES:
        with contextlib.suppress(KeyError):
            gauge.remove(session_id)


def observe_round_trip(session_id: str, seconds: float) -> None:
    STREAM_ROUND_TRIP.labels(session_id).set(seconds)
    STREAM_ROUND_TRIPS.observe(seconds)


# --- GPU gauges ---------------------------------------------------------------------------------


#: the GPU gauges of a moment (what a late NVML reading leaves unknown), not of the board
#: (its memory) nor cumulative (its energy counter)
_GPU_NOW = (GPU_UTILIZATION, GPU_MEMORY_USED, GPU_POWER, GPU_ENCODER_SESSIONS)


def forget_gpus(devices: Sequence[Device]) -> None:
    """Drop ``devices``' gauges of the moment while NVML does not answer: a scrape then finds
    no value, where the last one would read as current."""
    for device in devices:
        if device.index is None:
            continue
        for gauge in _GPU_NOW:
            with contextlib.suppress(KeyError):
                gauge.remove(device.id, device.device_class, device.host)


def observe_gpus(devices: Sequence[Device], gpus: Iterable[GpuInfo]) -> None:
    """Set the NVML gauges of ``gpus`` (matched to ``devices`` by NVML index)."""
    by_index = {d.index: d for d in devices if d.index is not None}
    for gpu in gpus:
        device = by_index.get(gpu.index)
        if device is None:
            continue
        labels = (device.id, device.device_class, device.host)
        GPU_UTILIZATION.labels(*labels).set(gpu.utilization_pct)
        GPU_MEMORY_USED.labels(*labels).set(gpu.memory_used_mib * MIB)
        GPU_MEMORY_TOTAL.labels(*labels).set(gpu.memory_total_mib * MIB)
        GPU_ENCODER_SESSIONS.labels(*labels).set(gpu.encoder_sessions)
        if gpu.power_w is not None:
            GPU_POWER.labels(*labels).set(gpu.power_w)
        if gpu.energy_j is not None:
            GPU_ENERGY.labels(*labels).set(gpu.energy_j)


# --- the farm as Redis holds it (read at scrape time) -------------------------------------------


#: how long one scrape waits for Redis to come back before it reports the farm down
SCRAPE_RIDE_OUT_S = 2.0


class FarmCollector(Collector):
    """Queue depth, device capacity and use, leases and usage totals, read from Redis."""

    def __init__(self, settings: Settings) -> None:
        from farm import redisclient
        from farm.alloc.allocator import SlotAllocator

        self.settings = settings
        # a scrape must answer within Prometheus' scrape timeout (10 s by default): with Redis
        # away it reports the farm down at once instead of riding the outage out
        url, ride_out_s = settings.redis_url, SCRAPE_RIDE_OUT_S
        self.conn = redisclient.connect(url, ride_out_s=ride_out_s)
        self.rq_conn = redisclient.connect(url, text=False, ride_out_s=ride_out_s)
        self.allocator = SlotAllocator(self.conn, ttl_s=settings.lease_ttl_s)

    def describe(self) -> Iterator[Metric]:
        # no up-front description: describing would read Redis at registration
        return iter(())

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self._collect()
        except FarmError as exc:
            # Redis away: say so in the exposition rather than failing the whole scrape
            log.warning("event=metrics_farm_unreadable error=%r", exc.message)
            up = GaugeMetricFamily("tessera_farm_up", "Whether Redis answered this scrape.")
            up.add_metric([], 0)
            yield up

    def _collect(self) -> Iterator[Metric]:
        from farm import queue
        from farm.alloc import usage

        depths = queue.depths(self.rq_conn)
        devices = self.allocator.devices()
        totals = usage.totals(self.conn, self.settings)
        up = GaugeMetricFamily("tessera_farm_up", "Whether Redis answered this scrape.")
        up.add_metric([], 1)
        yield up
        depth = GaugeMetricFamily(
            "tessera_queue_depth", "Tasks waiting in each render queue.", labels=["queue"]
        )
        for name, count in sorted(depths.items()):
            depth.add_metric([name], count)
        yield depth
        yield from _device_families(devices)
        seconds = CounterMetricFamily(
            "tessera_usage_device_seconds",
            "Device-seconds leased, by project, device class and kind (render, stream).",
            labels=["project", "device_class", "kind"],
        )
        energy = CounterMetricFamily(
            "tessera_usage_energy_joules",
            "Energy of the leases, measured by NVML where it can, else estimated.",
            labels=["project", "device_class"],
        )
        for row in totals:
            for kind, secs in sorted(row.seconds_by_kind.items()):
                seconds.add_metric([row.project, row.device_class, kind], secs)
            energy.add_metric([row.project, row.device_class], row.energy_j)
        yield seconds
        yield energy


def _device_families(devices: Sequence[object]) -> Iterator[Metric]:
    from farm.alloc.allocator import DeviceState

    labels = ["device", "device_class", "host"]
    rows: list[tuple[str, str, str]] = [
        ("tessera_device_vram_bytes", "Device memory the allocator may lease.", "vram"),
        ("tessera_device_vram_used_bytes", "Device memory leased now.", "used_vram"),
        ("tessera_device_encoder_sessions", "Stream sessions the device may serve.", "enc"),
        ("tessera_device_encoder_sessions_used", "Stream sessions leased now.", "used_enc"),
        ("tessera_device_render_slots", "Concurrent render leases allowed.", "slots"),
        ("tessera_device_render_slots_used", "Render leases held now.", "used_slots"),
        ("tessera_device_up", "1 while the device's agent beats and NVML reads it.", "up"),
    ]
    families = {field: GaugeMetricFamily(name, doc, labels=labels) for name, doc, field in rows}
    leases = GaugeMetricFamily(
        "tessera_device_leases", "Leases held now, by kind.", labels=[*labels, "kind"]
    )
    for d in devices:
        assert isinstance(d, DeviceState)
        values = {
            "vram": d.vram_mib * MIB,
            "used_vram": d.used_vram_mib * MIB,
            "enc": d.encoder_sessions,
            "used_enc": d.used_encoder_sessions,
            "slots": d.render_slots,
            "used_slots": d.used_render_slots,
            "up": 1 if d.alive and d.available else 0,
        }
        key = [d.id, d.device_class, d.host]
        for field, value in values.items():
            families[field].add_metric(key, value)
        for kind in ("render", "stream"):
            count = sum(1 for lease in d.leases if lease.get("kind") == kind)
            leases.add_metric([*key, kind], count)
    yield from families.values()
    yield leases


_farm_lock = threading.Lock()
_farm_collector: FarmCollector | None = None


def register_farm_collector(settings: Settings) -> FarmCollector:
    """Export the farm-wide metrics from this process (the web); again: replaces the first.
    With FARM_WEB_FARM_METRICS=off the collector is made but not exported: another process
    (one of several web replicas) is the farm's one exporter."""
    global _farm_collector
    with _farm_lock:
        if _farm_collector is not None:
            REGISTRY.unregister(_farm_collector)
            _farm_collector = None
        collector = FarmCollector(settings)
        if settings.web_farm_metrics == "on":
            REGISTRY.register(collector)
            _farm_collector = collector
        return collector


def unregister_farm_collector() -> None:
    global _farm_collector
    with _farm_lock:
        if _farm_collector is not None:
            REGISTRY.unregister(_farm_collector)
            _farm_collector = None


# --- serving ------------------------------------------------------------------------------------


def exposition() -> tuple[bytes, str]:
    """The body and Content-Type of a /metrics answer (blocking: may read Redis)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class MetricsServer:
    """A /metrics HTTP server on its own thread, for processes without one (render workers)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=REGISTRY)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_metrics_server(port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve ``REGISTRY`` at http://host:port/metrics (port 0: a free port, see ``.port``)."""
    server = MetricsServer(port, host)
    log.info("event=metrics_ready url=%s", server.url)
    return server
