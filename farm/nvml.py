"""NVML, the NVIDIA driver's management library: what each GPU is and what it is doing now."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pynvml

from farm.errors import BadParameter, NvmlError

log = logging.getLogger("tessera.nvml")

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
    """What the farm asks NVML; ``RealNvml`` and ``farm.fakenvml.FakeNvml`` both answer it.

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


def _mapped(err: pynvml.NVMLError, call: str, index: int | None) -> NvmlError:
    code = int(err.value)
    if code == pynvml.NVML_ERROR_GPU_IS_LOST:
        return NvmlError(
            f"GPU {index} fell off the bus ({call}: {err}); drain its leases and check the "
            "host (nvidia-smi, Xid 79 in the kernel log)",
            index=index,
            lost=True,
            nvml_code=code,
            call=call,
        )
    where = "NVML" if index is None else f"NVML on GPU {index}"
    return NvmlError(
        f"{where}: {call} failed: {err}", index=index, lost=False, nvml_code=code, call=call
    )


def _call(fn: Callable[..., Any], index: int | None, *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        raise _mapped(err, fn.__name__, index) from err


def _optional(fn: Callable[..., Any], index: int, *args: Any) -> Any:
    """``fn``'s answer, or None where this GPU or driver does not support the query."""
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        if int(err.value) == pynvml.NVML_ERROR_NOT_SUPPORTED:
            return None
        raise _mapped(err, fn.__name__, index) from err


class RealNvml:
    """NVML through the driver (``pynvml``); initialised once, closed by ``close``."""

    def __init__(self) -> None:
        _call(pynvml.nvmlInit, None)
        self._open = True
        #: engine counts by UUID: static per GPU, and worked out (and logged) once
        self._engines: dict[str, int] = {}

    def device_count(self) -> int:
        return int(_call(pynvml.nvmlDeviceGetCount, None))

    def device(self, index: int) -> GpuInfo:
        # A fresh handle per query: handles go stale when a GPU is reset.
        handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index, index)
        uuid = str(_call(pynvml.nvmlDeviceGetUUID, index, handle))
        name = str(_call(pynvml.nvmlDeviceGetName, index, handle))
        memory = _call(pynvml.nvmlDeviceGetMemoryInfo, index, handle)
        stats = _optional(pynvml.nvmlDeviceGetEncoderStats, index, handle)
        sessions, fps = (int(stats[0]), float(stats[1])) if stats is not None else (0, 0.0)
        utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, index, handle)
        power_mw = _optional(pynvml.nvmlDeviceGetPowerUsage, index, handle)
        energy_mj = _optional(pynvml.nvmlDeviceGetTotalEnergyConsumption, index, handle)
        return GpuInfo(
            index=index,
            uuid=uuid,
            name=name,
            memory_total_mib=int(memory.total) // MIB,
            memory_used_mib=int(memory.used) // MIB,
            encoder_engines=self._encoder_engines(index, handle, uuid, name, sessions),
            encoder_sessions=sessions,
            encoder_fps=fps,
            utilization_pct=int(utilization.gpu) if utilization is not None else 0,
            power_w=int(power_mw) / 1000 if power_mw is not None else None,
            energy_j=int(energy_mj) / 1000 if energy_mj is not None else None,
            processes=self._processes(index, handle),
            consumer=self._consumer(index, handle, name),
        )

    def devices(self) -> list[GpuInfo]:
        return [self.device(index) for index in range(self.device_count())]

    def driver_version(self) -> str:
        return str(_call(pynvml.nvmlSystemGetDriverVersion, None))

    def close(self) -> None:
        if self._open:
            self._open = False
            _call(pynvml.nvmlShutdown, None)

    def _encoder_engines(self, index: int, handle: Any, uuid: str, name: str, sessions: int) -> int:
        if uuid not in self._engines:
            capacity = _optional(
                pynvml.nvmlDeviceGetEncoderCapacity, index, handle, pynvml.NVML_ENCODER_QUERY_H264
            )
            capacity_pct = int(capacity) if capacity is not None else None
            engines = nvenc_engines(name, capacity_pct, sessions)
            if model_of(name) is None and engines > 0:
                log.warning(
                    "event=nvenc_engines_guessed gpu=%d name=%r engines=%d reason=unknown_model",
                    index,
                    name,
                    engines,
                )
            self._engines[uuid] = engines
        return self._engines[uuid]

    def _processes(self, index: int, handle: Any) -> tuple[GpuProcess, ...]:
        used_mib: dict[int, int] = {}
        for query in (
            pynvml.nvmlDeviceGetComputeRunningProcesses,
            pynvml.nvmlDeviceGetGraphicsRunningProcesses,
        ):
            try:
                found = _optional(query, index, handle) or []
            except pynvml.NVMLLibraryMismatchError:
                # drivers older than the _v3 calls: nothing to attribute, not a failure
                found = []
            for process in found:
                # usedGpuMemory is None where the OS hides it (WDDM); a process that is both
                # compute and graphics appears twice with the same memory
                mib = int(process.usedGpuMemory or 0) // MIB
                used_mib[int(process.pid)] = max(used_mib.get(int(process.pid), 0), mib)
        return tuple(GpuProcess(pid, mib) for pid, mib in sorted(used_mib.items()))

    def _consumer(self, index: int, handle: Any, name: str) -> bool:
        brand = _optional(pynvml.nvmlDeviceGetBrand, index, handle)
        if brand is None:
            return "GEFORCE" in name.upper() or "TITAN" in name.upper()
        return int(brand) in (pynvml.NVML_BRAND_GEFORCE, pynvml.NVML_BRAND_TITAN)


#: NVML answers that mean "no NVIDIA driver on this host", not "a driver that is broken"
_NO_DRIVER_CODES = frozenset(
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
)


def open_nvml(spec: str) -> Nvml | None:
    """The NVML that FARM_NVML names: ``auto``, ``real`` or ``fake:MODEL[,MODEL...]``.

    ``auto`` answers None where NVML cannot start (no NVIDIA driver): the caller then offers a
    CPU device. ``real`` raises ``NvmlError`` instead.
    """
    if spec.startswith("fake:"):
        # imported here: the fake is for tests and demos, never loaded on a production path
        from farm.fakenvml import FakeNvml

        return FakeNvml([model for model in spec.removeprefix("fake:").split(",") if model])
    if spec == "real":
        try:
            return RealNvml()
        except NvmlError as err:
            raise NvmlError(
                f"FARM_NVML=real but NVML could not start ({err.message}); install the NVIDIA "
                "driver (nvidia-smi must list the GPUs) or set FARM_NVML=auto",
                **err.fields,
            ) from err
    if spec == "auto":
        try:
            return RealNvml()
        except NvmlError as err:
            broken = err.fields.get("nvml_code") not in _NO_DRIVER_CODES
            log.log(
                logging.WARNING if broken else logging.INFO,
                "event=nvml_unavailable reason=%r devices=cpu",
                err.message,
            )
            return None
    raise BadParameter(f"FARM_NVML {spec!r} is not auto, real or fake:MODEL[,MODEL...]")
