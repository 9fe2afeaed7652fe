"""Drift between what the allocator has leased on a GPU and what NVML sees in use there."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from farm.alloc.devices import Device
from farm.gpu.types import GpuInfo


class DriftKind(StrEnum):
    MEMORY = "memory"
    """More GPU memory in use than leases explain (beyond the tolerance)."""
    ENCODER = "encoder"
    """More NVENC sessions open than stream leases explain."""
    FOREIGN_PROCESS = "foreign_process"
    """A process that is not the farm's holds GPU memory."""
    LOST = "lost"
    """The allocator has the device; NVML no longer reports it."""


@dataclass(frozen=True)
class LeaseView:
    """What the allocator believes is in use on one device, its leases summed."""

    vram_mib: int
    encoder_sessions: int
    count: int


NO_LEASES = LeaseView(vram_mib=0, encoder_sessions=0, count=0)


@dataclass(frozen=True)
class Tolerance:
    """How far memory in use may exceed the leases before it counts as drift."""

    vram_mib: int = 512
    """CUDA contexts and driver allocations that no lease reserves (a few hundred MiB each)."""
    vram_fraction: float = 0.10
    """A lease's amount is an estimate; real use may run this far past it."""

    def allowed_vram_mib(self, leased_mib: int) -> int:
        return leased_mib + self.vram_mib + int(leased_mib * self.vram_fraction)


@dataclass(frozen=True)
class Drift:
    device_id: str
    kind: DriftKind
    expected: int
    """MiB or sessions the leases explain (0 for a foreign process; 1 device for lost)."""
    observed: int
    """MiB or sessions NVML reports (a foreign process's MiB; 0 devices for lost)."""
    message: str
    """One line for logs and metrics."""
    pid: int | None = None
    """The foreign process, for ``FOREIGN_PROCESS``."""

    @property
    def excess(self) -> int:
        return max(0, self.observed - self.expected)


def reconcile(
    devices: list[Device],
    leases: Mapping[str, LeaseView],
    gpus: list[GpuInfo],
    farm_pids: set[int],
    tolerance: Tolerance = Tolerance(),
) -> list[Drift]:
    """Every drift on this host's GPUs; the CPU device has nothing to compare with.

    ``leases`` is keyed by device id (absent: nothing leased); ``farm_pids`` are the pids of
    the farm's own processes on this host, as NVML numbers them.
    """
    seen = {gpu.uuid: gpu for gpu in gpus}
    drifts: list[Drift] = []
    for device in devices:
        if device.index is None:
            continue
        where = f"GPU {device.index} ({device.model}, {device.id})"
        gpu = seen.get(device.id)
        if gpu is None:
            drifts.append(
                Drift(
                    device.id,
                    DriftKind.LOST,
                    expected=1,
                    observed=0,
                    message=f"{where} is no longer reported by NVML: lost or removed",
                )
            )
            continue
        lease = leases.get(device.id, NO_LEASES)
        if gpu.memory_used_mib > tolerance.allowed_vram_mib(lease.vram_mib):
            drifts.append(
                Drift(
                    device.id,
                    DriftKind.MEMORY,
                    expected=lease.vram_mib,
                    observed=gpu.memory_used_mib,
                    message=f"{where}: {gpu.memory_used_mib} MiB in use, {lease.count} lease(s) "
                    f"explain {lease.vram_mib} MiB",
                )
            )
        if gpu.encoder_sessions > lease.encoder_sessions:
            drifts.append(
                Drift(
                    device.id,
                    DriftKind.ENCODER,
                    expected=lease.encoder_sessions,
                    observed=gpu.encoder_sessions,
                    message=f"{where}: {gpu.encoder_sessions} NVENC session(s) open, leases "
                    f"explain {lease.encoder_sessions}",
                )
            )
        for process in gpu.processes:
            if process.pid not in farm_pids and process.used_mib > 0:
                drifts.append(
                    Drift(
                        device.id,
                        DriftKind.FOREIGN_PROCESS,
                        expected=0,
                        observed=process.used_mib,
                        message=f"{where}: pid {process.pid} is not a farm process and holds "
                        f"{process.used_mib} MiB",
                        pid=process.pid,
                    )
                )
    return drifts
