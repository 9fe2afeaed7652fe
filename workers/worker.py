"""`farm worker`: an rq worker bound to one device, owning one long-lived Blender child."""

from __future__ import annotations

import logging
import os
import socket

from farm import jobstore, queue
from farm.errors import DeviceUnavailable
from farm.settings import Settings
from farm.storage import LocalStorage
from workers import tasks
from workers.child import BlenderChild

log = logging.getLogger("tessera.worker")


def default_name(settings: Settings) -> str:
    device = settings.device if settings.gpu_index is None else f"gpu{settings.gpu_index}"
    return f"{socket.gethostname()}-{device}-{os.getpid()}"


def serve(settings: Settings, *, name: str | None = None, burst: bool = False) -> None:
    """Take tiles from the device's queue until stopped; the Blender child lives as long."""
    name = name or default_name(settings)
    child = BlenderChild(
        python=settings.python,
        work_dir=settings.work_dir / name,
        device=settings.device,
        gpu_index=settings.gpu_index,
        gpu_backend=settings.gpu_backend,
        threads=settings.cpu_threads,
        name=name,
    )
    ctx = tasks.WorkerContext(
        settings=settings,
        name=name,
        conn=jobstore.connect(settings.redis_url),
        store=jobstore.JobStore(jobstore.connect(settings.redis_url)),
        queue=queue.RenderQueue(queue.connect(settings.redis_url), settings.device),
        storage=LocalStorage(settings.storage_dir),
        child=child,
    )
    tasks.install(ctx)
    # Start Blender before taking work, so the first tile does not pay for `import bpy`.
    child.start()
    if child.device_error:
        # A GPU worker without its GPU must not take tiles: it would fail every one of them.
        child.stop()
        raise DeviceUnavailable(
            f"worker {name} cannot render on {settings.device}: {child.device_error}"
        )
    log.info(
        "event=worker_ready worker=%s device=%s blender_pid=%s", name, settings.device, child.pid
    )
    try:
        queue.run_worker(
            queue.connect(settings.redis_url),
            settings.device,
            name,
            burst=burst,
            maintenance=ctx.sweep,
            log_level=settings.log_level,
        )
    finally:
        child.stop()
