"""`farm worker`: an rq worker bound to one device, owning one long-lived Blender child."""

from __future__ import annotations

import logging

from farm import jobstore, queue
from farm.errors import DeviceUnavailable
from farm.settings import Settings
from farm.storage import LocalStorage
from workers import tasks
from workers.child import BlenderChild

log = logging.getLogger("tessera.worker")


def serve(
    settings: Settings,
    *,
    name: str | None = None,
    burst: bool = False,
    child: BlenderChild | None = None,
) -> None:
    """Take tiles from the device's queue until stopped; the Blender child lives as long.

    ``child`` may be one already started (without waiting), so that `import bpy` overlapped
    the worker's own imports.
    """
    name = name or settings.worker_name()
    if child is None:
        child = BlenderChild.for_settings(settings, name)
        child.start(wait=False)
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
    # Blender is ready before the worker takes work, so no tile pays for `import bpy`.
    child.wait_ready()
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
        # The child holds nothing to save (every output is written atomically): skip
        # Blender's teardown.
        child.kill()
