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


#: every setting's variable, type and least value: the one table from_env and to_env read
ENV: dict[str, tuple[str, type, float]] = {
    "redis_url": ("FARM_REDIS_URL", str, 0),
    "storage_dir": ("FARM_STORAGE_DIR", Path, 0),
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
    "agent_timeout_s": ("FARM_AGENT_TIMEOUT_S", float, 0.1),
}

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: Cycles compute backends in the order a worker prefers them
GPU_BACKENDS = ("OPTIX", "CUDA", "HIP", "ONEAPI", "METAL")
