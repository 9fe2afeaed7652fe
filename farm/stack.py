"""`farm up`: the local stack: private Redis, the web, a worker and stream service per device."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from farm import jobstore, lifetime
from farm.accounts import Accounts
from farm.embedded import LocalWorkers
from farm.gpu.factory import open_nvml
from farm.redisserver import RedisServer
from farm.settings import Settings, default_data_dir
from web.serve import run

log = logging.getLogger("tessera.up")

#: seconds a service gets to stop after SIGTERM before it is killed
STOP_GRACE_S = 10.0


def gpu_indexes(settings: Settings) -> list[int]:
    nvml = open_nvml(settings.nvml)
    if nvml is None:
        return []
    try:
        return [gpu.index for gpu in nvml.devices()]
    finally:
        nvml.close()


class GpuWorker(LocalWorkers):
    """The render worker of one GPU, named after its index (names are unique on the farm)."""

    def start(self) -> None:
        self._spawn(f"local-gpu{self.settings.gpu_index}")


class StreamServices:
    """One `farm stream` process per device (each GPU, or the CPU device)."""

    def __init__(self, settings: Settings, gpus: list[int], log_dir: Path) -> None:
        self.settings = settings
        self.gpus = gpus
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        devices = [["--device", "gpu", "--gpu-index", str(i)] for i in self.gpus] or [
            ["--device", "cpu"]
        ]
        env = {**os.environ, **self.settings.to_env(), "FARM_STREAM_PORT": "0"}
        for i, args in enumerate(devices):
            log_path = self.log_dir / f"stream-{i}.log"
            self.procs.append(lifetime.spawn_farm(["stream", *args], env, log_path))

    def stop(self) -> None:
        # one shared grace for all of them (each stopped in turn could take N times as long)
        lifetime.stop_all(self.procs, STOP_GRACE_S)


def data_folder(settings: Settings, given: Path | None) -> Path:
    """Where `farm up` keeps Redis, storage and logs: ``--data``, FARM_DATA_DIR, else
    ``tessera`` in the XDG data home; never the folder it was started in (a checkout)."""
    return (given or settings.data_dir or default_data_dir()).resolve()


def up(settings: Settings, data_dir: Path | None = None, out: TextIO = sys.stderr) -> None:
    """Run the stack from ``data_dir`` (see data_folder) until Ctrl-C; stops what it started."""
    data_dir = data_folder(settings, data_dir)
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with RedisServer(data_dir / "redis", appendonly=True) as redis_server:
        local = settings.with_(
            redis_url=redis_server.url,
            storage_dir=data_dir / "storage",
            work_dir=data_dir / "work",
            # the web signs stream tokens with it, the stream services check them
            stream_secret=settings.stream_secret or secrets.token_urlsafe(32),
        )
        conn = jobstore.connect(local.redis_url)
        try:
            issued = Accounts(conn).bootstrap_admin()
        finally:
            conn.close()
        gpus = gpu_indexes(local)
        workers = [LocalWorkers(local.with_(device="cpu"), 1, logs)]
        workers += [GpuWorker(local.with_(device="gpu", gpu_index=i), 1, logs) for i in gpus]
        streams = StreamServices(local, gpus, logs)
        try:
            for pool in workers:
                pool.start()
            streams.start()
            print(
                f"farm up: Redis {redis_server.url}, {len(workers)} render worker(s), "
                f"{len(streams.procs)} stream service(s); data and logs in {data_dir}",
                file=out,
            )
            print(
                f"farm up: admin API token (shown once): {issued.token}\n"
                "farm up: log in with it in the browser, or send it as "
                "`Authorization: Bearer <token>`; Ctrl-C stops everything",
                file=out,
                flush=True,
            )
            asyncio.run(run(local, out))
        finally:
            streams.stop()
            for pool in workers:
                pool.stop()
            print("farm up: stopped", file=out)
