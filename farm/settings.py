"""The one settings object of a process, built once from FARM_* environment variables."""

from __future__ import annotations

import math
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from farm.errors import BadParameter

DEVICE_KINDS = ("cpu", "gpu")


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    """FARM_REDIS_URL: the Redis holding queues, job state and events (redis:// or unix://)."""

    storage_dir: Path = Path("/var/lib/tessera/storage")
    """FARM_STORAGE_DIR: the shared folder for uploads, tiles and frames (local storage)."""

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
    """FARM_NVML: ``auto`` (NVML when a driver answers, else a CPU device), ``real``, or
    ``fake:MODEL,MODEL`` (the in-tree fake, e.g. ``fake:t4,l4,a100``; tests and demos only)."""

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

    agent_timeout_s: float = 15.0
    """FARM_AGENT_TIMEOUT_S: an agent silent for this long leaves the pool with its devices."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        base = cls()
        values: dict[str, Any] = {}

        def text(name: str, attr: str) -> None:
            if name in env and env[name] != "":
                values[attr] = env[name]

        def number(name: str, attr: str, kind: type, minimum: float) -> None:
            if name in env and env[name] != "":
                try:
                    value = kind(env[name])
                except ValueError:
                    raise BadParameter(f"{name}={env[name]!r} is not a number") from None
                if not math.isfinite(value):
                    raise BadParameter(f"{name}={env[name]!r} must be a finite number")
                if value < minimum:
                    raise BadParameter(f"{name} must be at least {minimum}, not {value}")
                values[attr] = value

        text("FARM_REDIS_URL", "redis_url")
        text("FARM_DEVICE", "device")
        text("FARM_GPU_BACKEND", "gpu_backend")
        text("FARM_BLENDER_PYTHON", "python")
        text("FARM_LOG_LEVEL", "log_level")
        text("FARM_NVML", "nvml")
        text("FARM_DEVICE_OVERRIDES", "device_overrides")
        for name, attr in (("FARM_STORAGE_DIR", "storage_dir"), ("FARM_WORK_DIR", "work_dir")):
            if env.get(name):
                values[attr] = Path(env[name])
        number("FARM_GPU_INDEX", "gpu_index", int, 0)
        number("FARM_CPU_THREADS", "cpu_threads", int, 0)
        number("FARM_TILE_TIMEOUT_S", "tile_timeout_s", float, 1.0)
        number("FARM_INSPECT_TIMEOUT_S", "inspect_timeout_s", float, 1.0)
        number("FARM_MAX_ATTEMPTS", "max_attempts", int, 1)
        number("FARM_CPU_RENDER_SLOTS", "cpu_render_slots", int, 0)
        number("FARM_CPU_ENCODE_SESSIONS", "cpu_encode_sessions", int, 0)
        number("FARM_GPU_RENDER_SLOTS", "gpu_render_slots", int, 1)
        number("FARM_ENCODER_SESSIONS_PER_ENGINE", "encoder_sessions_per_engine", int, 1)
        number("FARM_HOST_ENCODER_BUDGET", "host_encoder_budget", int, 0)
        number("FARM_RENDER_VRAM_FLOOR_MIB", "render_vram_floor_mib", int, 0)
        number("FARM_LEASE_TTL_S", "lease_ttl_s", float, 0.1)
        number("FARM_AGENT_TIMEOUT_S", "agent_timeout_s", float, 0.1)
        return replace(base, **values).validated()

    def validated(self) -> Settings:
        if self.log_level.upper() not in LOG_LEVELS:
            raise BadParameter(
                f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}"
            )
        if self.log_level != self.log_level.upper():
            return replace(self, log_level=self.log_level.upper()).validated()
        if self.gpu_backend is not None and self.gpu_backend != self.gpu_backend.upper():
            return replace(self, gpu_backend=self.gpu_backend.upper()).validated()
        if not (self.nvml in ("auto", "real") or self.nvml.startswith("fake:")):
            raise BadParameter(
                f"FARM_NVML {self.nvml!r} is not auto, real or fake:MODEL[,MODEL...]"
            )
        if self.device not in DEVICE_KINDS:
            raise BadParameter(f"device {self.device!r} is not one of {', '.join(DEVICE_KINDS)}")
        if self.gpu_backend is not None and self.gpu_backend.upper() not in GPU_BACKENDS:
            raise BadParameter(
                f"GPU backend {self.gpu_backend!r} is not one of {', '.join(GPU_BACKENDS)}"
            )
        return self

    def worker_name(self) -> str:
        """A worker's default name: host, device and pid (unique on the farm)."""
        device = self.device if self.gpu_index is None else f"gpu{self.gpu_index}"
        return f"{socket.gethostname()}-{device}-{os.getpid()}"

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes).validated()


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Cycles compute backends in the order a worker prefers them
GPU_BACKENDS = ("OPTIX", "CUDA", "HIP", "ONEAPI", "METAL")
