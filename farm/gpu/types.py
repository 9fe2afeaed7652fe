"""What the farm knows of a GPU (GpuInfo), the NVML interface that the driver's library and the
fake both answer, and GPU model names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

MIB = 1024 * 1024


#: NVENC engines per GPU, keyed by model (see ``model_of``). NVML has no engine-count query,
#: so the count comes from NVIDIA's NVENC support matrix; NVML only says whether NVENC exists.
NVENC_ENGINES: dict[str, int] = {
    "t4": 1,
    "a10": 1,
    "a10g": 1,
    # An A16 board carries four GPUs; NVML lists each on its own, with one engine.
    "a16": 1,
    "a40": 1,
    "l4": 2,
    "l40": 3,
    "l40s": 3,
    "rtx3090": 1,
    "rtx4090": 2,
    # Compute-only parts: no NVENC at all.
    "a100": 0,
    "h100": 0,
    "h200": 0,
}


#: word sequences that name a model inside an NVML name ("NVIDIA A100-SXM4-80GB" -> a100);
#: whole words only, so A10 never matches an A100
_MODEL_WORDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("T4",), "t4"),
    (("A10",), "a10"),
    (("A10G",), "a10g"),
    (("A16",), "a16"),
    (("A40",), "a40"),
    (("L4",), "l4"),
    (("L40",), "l40"),
    (("L40S",), "l40s"),
    (("RTX", "3090"), "rtx3090"),
    (("RTX", "4090"), "rtx4090"),
    (("A100",), "a100"),
    (("H100",), "h100"),
    (("H200",), "h200"),
)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mib: int


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it at one moment."""

    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_used_mib: int
    encoder_engines: int
    """NVENC engines; 0 means the GPU cannot encode video at all (A100, H100, H200)."""
    encoder_sessions: int
    """NVENC sessions open now, from any process."""
    encoder_fps: float
    utilization_pct: int
    power_w: float | None
    energy_j: float | None
    """The driver's energy counter since it loaded; None where the GPU does not report it."""
    processes: tuple[GpuProcess, ...]
    consumer: bool
    """A GeForce/TITAN card, whose driver caps concurrent NVENC sessions per system."""


class Nvml(Protocol):
    """What the farm asks NVML; ``RealNvml`` and ``farm.gpu.fake.FakeNvml`` both answer it.

    Every failure is an ``NvmlError``; one with ``fields["lost"]`` true names (``index``) a GPU
    that fell off the bus.
    """

    def device_count(self) -> int: ...

    def device(self, index: int) -> GpuInfo: ...

    def devices(self) -> list[GpuInfo]: ...

    def driver_version(self) -> str: ...

    def close(self) -> None: ...


def model_of(name: str) -> str | None:
    """The model key ("t4", "a10g", "rtx4090", ...) in an NVML device name, None if unknown."""
    words = re.findall(r"[A-Z0-9]+", name.upper())
    for pattern, model in _MODEL_WORDS:
        size = len(pattern)
        if any(tuple(words[i : i + size]) == pattern for i in range(len(words) - size + 1)):
            return model
    return None


def nvenc_engines(name: str, capacity_pct: int | None, sessions: int) -> int:
    """NVENC engines of a GPU called ``name``.

    ``capacity_pct`` is nvmlDeviceGetEncoderCapacity's answer (None: not supported, so no
    encoder is exposed here, as on a vGPU or MIG slice without one); ``sessions`` are the
    sessions open now. A model outside ``NVENC_ENGINES`` that can encode counts as one engine.
    """
    if capacity_pct is None:
        return 0
    model = model_of(name)
    if model is not None:
        return NVENC_ENGINES[model]
    # capacity is what is left: a busy encoder may answer 0 while it has sessions open
    return 1 if capacity_pct > 0 or sessions > 0 else 0
