"""`farm worker`: an rq worker bound to one device, owning one long-lived Blender child."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from farm import blocklist, jobstore, metrics, queue, sandbox, tags, workerstate
from farm.alloc.agent import DeviceAgent, together
from farm.alloc.allocator import SlotAllocator
from farm.alloc.devices import Device
from farm.errors import DeviceUnavailable, RenderError
from farm.gpu.factory import open_nvml
from farm.settings import Settings
from farm.storage.factory import farm_storage
from workers import exr, tasks
from workers.child import BlenderChild
from workers.shutdown import Shutdown

log = logging.getLogger("tessera.worker")

#: OpenEXR threads of a worker at most: beyond a few, a frame's blocks are too few to share
EXR_THREADS_MAX = 4


def serve(
    settings: Settings,
    *,
    name: str | None = None,
    burst: bool = False,
    child: BlenderChild | None = None,
) -> None:
    """Take tiles from the device's queue until stopped; the Blender child lives as long.

    ``child`` may be one already started (without waiting), so that `import bpy` overlapped
    the worker's own imports. A child that dies while starting is replaced (BlenderChild's
    bounded retries); when none starts, the worker says it is unhealthy and exits.
    """
    name = name or settings.worker_name()
    if settings.sandbox == "none":
        sandbox.check(settings)  # logs that members' files run unisolated
    # Otherwise the child's own start is the sandbox's trial: a host that cannot make one says
    # why at the child's first failed start (BlenderChild.wait_ready); no second sandbox runs.
    if child is None:
        child = BlenderChild.for_settings(settings, name)
        child.start(wait=False)
    # Blender is ready before the worker takes work, so no tile pays for `import bpy`.
    try:
        child.wait_ready()
    except RenderError as exc:
        child.kill()
        log.error("event=worker_unhealthy worker=%s reason=%r log=%s", name, exc.message,
                  child.log_path)  # fmt: skip
        raise DeviceUnavailable(
            f"worker {name} cannot render: {exc.message} (its log: {child.log_path})"
        ) from exc
    if child.device_error:
        # A GPU worker without its GPU must not take tiles: it would fail every one of them.
        child.stop()
        raise DeviceUnavailable(
            f"worker {name} cannot render on {settings.device}: {child.device_error}"
        )
    # the assembly's EXR reads and writes; the child is idle while this worker assembles
    exr.use_threads(min(os.cpu_count() or 1, EXR_THREADS_MAX))
    # one text client for the job store, the allocator and the tasks; rq needs its own (bytes)
    conn = jobstore.connect(settings.redis_url)
    rq_conn = queue.connect(settings.redis_url)
    allocator = SlotAllocator(conn, ttl_s=settings.lease_ttl_s)
    agent = _agent(settings, allocator, name, child)
    carried = tasks.CarriedRenewal(agent.interval_s)
    ctx = tasks.WorkerContext(
        settings=settings,
        name=name,
        conn=conn,
        store=jobstore.JobStore(
            conn,
            tile_lease_s=settings.lease_ttl_s,
            job_retention_s=settings.job_retention_s,
            usage_raw_retention_s=settings.usage_raw_retention_s,
        ),
        queue=queue.RenderQueue(rq_conn, settings.device),
        storage=farm_storage(settings),
        child=child,
        allocator=allocator,
        device=agent.devices[0],
        shutdown=Shutdown(child, settings.stop_grace_s),
        report=workerstate.Reporter(workerstate.registry_for(conn, settings), name),
        tags=tags.worker_tags(settings.worker_tags),
        tag_limits=tags.tag_limits(settings.tag_limits),
        carried=carried,
    )
    tasks.install(ctx)
    beacon = _beacon(settings, ctx, agent)
    # the worker's beat and its rendering tile's renewal ride on its agent's: one round trip
    agent.beside = together(beacon.beat_in, carried.beat_in)
    blocklist.announce(conn, name, ctx.tags, settings.lease_ttl_s * 3)
    # Prometheus /metrics of this worker (tiles, durations, its GPU's NVML gauges)
    exporter = (
        metrics.start_metrics_server(settings.metrics_port, settings.metrics_host)
        if settings.metrics_port
        else None
    )
    agent.start()
    sweeper = _Sweeper(ctx.sweep, every_s=settings.lease_ttl_s)
    sweeper.start()
    log.info("event=worker_ready worker=%s device=%s device_id=%s blender_pid=%s tags=%s", name,
             settings.device, ctx.device.id, child.pid, ",".join(sorted(ctx.tags)))  # fmt: skip
    try:
        queue.run_worker(
            rq_conn,
            settings.device,
            name,
            burst=burst,
            log_level=settings.log_level,
            on_signal=ctx.shutdown.on_signal if ctx.shutdown else None,
            picker=queue.Picker(name, ctx.tags, ctx.tag_limits, settings.lease_ttl_s),
        )
    finally:
        if ctx.shutdown is not None:
            ctx.shutdown.close()
        sweeper.stop()
        agent.stop()
        beacon.forget()
        if exporter is not None:
            exporter.stop()
        # The child holds nothing to save (every output is written atomically): skip
        # Blender's teardown.
        child.kill()


class _Sweeper:
    """Runs the recovery sweep every lease period on its own thread.

    Not in rq's loop: an idle rq worker blocks on its queue for up to its dequeue timeout,
    and a tile whose worker vanished should be requeued about one lease period after.
    """

    def __init__(self, sweep: Callable[[], None], every_s: float) -> None:
        self.sweep = sweep
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="recovery-sweep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sweep()
            except Exception:  # a failed sweep must not stop the worker; the next one retries
                log.exception("event=sweep_failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _beacon(settings: Settings, ctx: tasks.WorkerContext, agent: DeviceAgent) -> workerstate.Beacon:
    """The worker's entry on the workers page (written with its agent's heartbeat): who it is,
    and its GPU's utilisation."""
    device = ctx.device
    identity = {"kind": "render", "host": device.host, "pid": os.getpid(),
                "queue": settings.device, "device_id": device.id,
                "device_class": device.device_class, "model": device.model}  # fmt: skip
    assert ctx.report.registry is not None
    return workerstate.Beacon(ctx.report.registry, ctx.name, identity, agent.gauges)


def _agent(
    settings: Settings, allocator: SlotAllocator, name: str, child: BlenderChild
) -> DeviceAgent:
    """The agent offering this worker's one device: its GPU, or the host's CPU device."""
    nvml = open_nvml(settings.nvml) if settings.device == "gpu" else None
    index = settings.gpu_index or 0

    def mine(device: Device) -> bool:
        return device.index is None if settings.device == "cpu" else device.index == index

    agent = DeviceAgent(
        settings,
        allocator,
        name,
        nvml=nvml,
        select=mine,
        farm_pids=lambda: {os.getpid(), *([child.pid] if child.pid else [])},
    )
    if not agent.devices:
        raise DeviceUnavailable(f"worker {name}: NVML reports no GPU {index} on this host")
    return agent
