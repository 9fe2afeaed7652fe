"""The NVIDIA driver's NVML through pynvml: what each GPU is and what it is doing now."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pynvml

from farm.errors import NvmlError
from farm.gpu.types import MIB, GpuInfo, GpuProcess, model_of, nvenc_engines

log = logging.getLogger("tessera.nvml")


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
NO_DRIVER_CODES = frozenset(
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
)
