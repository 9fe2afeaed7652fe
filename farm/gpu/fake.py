"""The fake NVML, a test double behind the Nvml interface: realistic GPUs, settable usage,
injected faults. Production never loads it; FARM_NVML=fake:... names it only in a process
started through the test suite's entry point (tests/doubles.py); benches use its model table."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from farm.errors import BadParameter, NvmlError
from farm.gpu.types import GpuInfo, GpuProcess

#: NVML's code for "Unknown Error", the answer a flaky driver gives
_NVML_ERROR_UNKNOWN = 999
#: NVML's code for "GPU is lost"
_NVML_ERROR_GPU_IS_LOST = 15
#: NVML's code for "Uninitialized" (a query after nvmlShutdown)
_NVML_ERROR_UNINITIALIZED = 1
#: NVML's code for "Invalid Argument" (an index past the last GPU)
_NVML_ERROR_INVALID_ARGUMENT = 2


@dataclass(frozen=True)
class FakeModel:
    """What nvidia-smi shows for one model: its NVML name, memory and NVENC engines."""

    name: str
    memory_total_mib: int
    encoder_engines: int
    idle_power_w: float
    consumer: bool = False


FAKE_MODELS: dict[str, FakeModel] = {
    "t4": FakeModel("Tesla T4", 15360, 1, 9.5),
    "l4": FakeModel("NVIDIA L4", 23034, 2, 16.0),
    "a10": FakeModel("NVIDIA A10", 23028, 1, 21.0),
    "l40s": FakeModel("NVIDIA L40S", 46068, 3, 35.0),
    "a100": FakeModel("NVIDIA A100-SXM4-80GB", 81920, 0, 60.0),
    "h100": FakeModel("NVIDIA H100 80GB HBM3", 81559, 0, 70.0),
    "h200": FakeModel("NVIDIA H200", 143771, 0, 75.0),
    "rtx4090": FakeModel("NVIDIA GeForce RTX 4090", 24564, 2, 20.0, consumer=True),
}

FAKE_DRIVER_VERSION = "550.127.05-fake"

T = TypeVar("T")


@dataclass
class _FakeGpu:
    info: GpuInfo
    lost: bool = False


@dataclass
class FakeNvml:
    """An ``Nvml`` over made-up GPUs: ``FakeNvml(["t4", "2xl4"])`` is a T4 and two L4s."""

    models: list[str]
    _gpus: list[_FakeGpu] = field(init=False, repr=False)
    _failures_left: int = field(default=0, init=False, repr=False)
    _open: bool = field(default=True, init=False, repr=False)
    #: clear while the fake's driver hangs (``stall``): every query waits for it
    _answering: threading.Event = field(
        default_factory=threading.Event, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        keys = [key for item in self.models for key in _expand(item)]
        self._gpus = [_FakeGpu(_new_info(index, key)) for index, key in enumerate(keys)]
        self._answering.set()

    # --- the Nvml interface -------------------------------------------------------------------

    def device_count(self) -> int:
        self._answer()
        return len(self._gpus)

    def device(self, index: int) -> GpuInfo:
        self._answer()
        return self._info(index)

    def devices(self) -> list[GpuInfo]:
        self._answer()
        return [self._info(index) for index in range(len(self._gpus))]

    def driver_version(self) -> str:
        self._answer()
        return FAKE_DRIVER_VERSION

    def close(self) -> None:
        self._open = False

    # --- what tests and demos set -------------------------------------------------------------

    def set_usage(
        self,
        index: int,
        *,
        memory_used_mib: int | None = None,
        encoder_sessions: int | None = None,
        encoder_fps: float | None = None,
        utilization_pct: int | None = None,
        power_w: float | None = None,
        energy_j: float | None = None,
        processes: Iterable[GpuProcess] | None = None,
    ) -> None:
        """Change what GPU ``index`` reports from now on; arguments left None stay as they are."""
        gpu = self._gpu(index)
        info = gpu.info
        if memory_used_mib is not None and not 0 <= memory_used_mib <= info.memory_total_mib:
            raise BadParameter(
                f"fake GPU {index} has {info.memory_total_mib} MiB, not {memory_used_mib} to use"
            )
        gpu.info = replace(
            info,
            memory_used_mib=_or(memory_used_mib, info.memory_used_mib),
            encoder_sessions=_or(encoder_sessions, info.encoder_sessions),
            encoder_fps=_or(encoder_fps, info.encoder_fps),
            utilization_pct=_or(utilization_pct, info.utilization_pct),
            power_w=_or(power_w, info.power_w),
            energy_j=_or(energy_j, info.energy_j),
            processes=info.processes if processes is None else tuple(processes),
        )

    def lose(self, index: int) -> None:
        """GPU ``index`` falls off the bus: every query that touches it fails as lost."""
        self._gpu(index).lost = True

    def fail_next(self, calls: int) -> None:
        """The next ``calls`` queries fail as a flaky driver's would (not lost)."""
        self._failures_left = calls

    def stall(self) -> None:
        """The driver stops answering (a wedged GPU): every query waits until ``answer``."""
        self._answering.clear()

    def answer(self) -> None:
        """The driver answers again; the queries waiting return."""
        self._answering.set()

    # --- inside -------------------------------------------------------------------------------

    def _answer(self) -> None:
        self._answering.wait()
        if not self._open:
            raise NvmlError(
                "NVML: query after close failed: Uninitialized",
                index=None,
                lost=False,
                nvml_code=_NVML_ERROR_UNINITIALIZED,
            )
        if self._failures_left > 0:
            self._failures_left -= 1
            raise NvmlError(
                "NVML: query failed: Unknown Error (injected by the fake)",
                index=None,
                lost=False,
                nvml_code=_NVML_ERROR_UNKNOWN,
            )

    def _info(self, index: int) -> GpuInfo:
        if not 0 <= index < len(self._gpus):
            raise NvmlError(
                f"NVML on GPU {index}: nvmlDeviceGetHandleByIndex failed: Invalid Argument",
                index=index,
                lost=False,
                nvml_code=_NVML_ERROR_INVALID_ARGUMENT,
            )
        gpu = self._gpus[index]
        if gpu.lost:
            raise NvmlError(
                f"GPU {index} fell off the bus (nvmlDeviceGetHandleByIndex: GPU is lost); "
                "drain its leases and check the host (nvidia-smi, Xid 79 in the kernel log)",
                index=index,
                lost=True,
                nvml_code=_NVML_ERROR_GPU_IS_LOST,
            )
        return gpu.info

    def _gpu(self, index: int) -> _FakeGpu:
        if not 0 <= index < len(self._gpus):
            raise BadParameter(f"the fake has GPUs 0 to {len(self._gpus) - 1}, not {index}")
        return self._gpus[index]


def _expand(item: str) -> list[str]:
    """``"2xl4"`` -> ``["l4", "l4"]``; ``"RTX 4090"`` -> ``["rtx4090"]``."""
    text = re.sub(r"[\s_-]+", "", item.lower())
    count = 1
    if match := re.fullmatch(r"(\d+)x(.+)", text):
        count, text = int(match[1]), match[2]
        if count < 1:
            raise BadParameter(f"fake GPU spec {item!r} asks for no GPU")
    if text not in FAKE_MODELS:
        raise BadParameter(
            f"unknown fake GPU model {item!r}; known: {', '.join(sorted(FAKE_MODELS))}",
            model=item,
            known=sorted(FAKE_MODELS),
        )
    return [text] * count


def _new_info(index: int, key: str) -> GpuInfo:
    model = FAKE_MODELS[key]
    return GpuInfo(
        index=index,
        uuid=f"GPU-fake-{key}-{index}",
        name=model.name,
        memory_total_mib=model.memory_total_mib,
        memory_used_mib=0,
        encoder_engines=model.encoder_engines,
        encoder_sessions=0,
        encoder_fps=0.0,
        utilization_pct=0,
        power_w=model.idle_power_w,
        energy_j=0.0,
        processes=(),
        consumer=model.consumer,
    )


def _or(value: T | None, current: T) -> T:
    return current if value is None else value
