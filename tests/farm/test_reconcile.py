"""Tests of drift detection: GPU usage NVML reports against what the allocator has leased."""

from __future__ import annotations

from farm.alloc.devices import Device, host_devices
from farm.alloc.reconcile import (
    Drift,
    DriftKind,
    LeaseView,
    Tolerance,
    reconcile,
)
from farm.gpu.fake import FakeNvml
from farm.gpu.types import GpuProcess
from farm.settings import Settings

FARM_PIDS = {1000, 1001}


def host(models: list[str]) -> tuple[FakeNvml, list[Device]]:
    nvml = FakeNvml(models)
    return nvml, host_devices(Settings(), nvml, hostname="h")


def drifts_of(nvml: FakeNvml, devices: list[Device], leases: dict[str, LeaseView]) -> list[Drift]:
    return reconcile(devices, leases, nvml.devices(), FARM_PIDS)


def test_usage_matching_the_leases_within_tolerance_is_no_drift() -> None:
    nvml, devices = host(["l4", "t4"])
    l4 = devices[0]
    leases = {l4.id: LeaseView(vram_mib=8000, encoder_sessions=2, count=3)}
    # 8000 leased + 512 + 10 % = 9312 MiB allowed
    nvml.set_usage(
        0,
        memory_used_mib=9312,
        encoder_sessions=2,
        processes=[GpuProcess(1000, 6000), GpuProcess(1001, 3000)],
    )
    nvml.set_usage(1, memory_used_mib=400)  # idle GPU: driver overhead only
    assert drifts_of(nvml, devices, leases) == []


def test_memory_beyond_the_leases_is_drift() -> None:
    nvml, (l4,) = host(["l4"])
    nvml.set_usage(0, memory_used_mib=9313, processes=[GpuProcess(1000, 9000)])
    leases = {l4.id: LeaseView(vram_mib=8000, encoder_sessions=0, count=1)}
    (drift,) = drifts_of(nvml, [l4], leases)
    assert drift.kind is DriftKind.MEMORY
    assert str(drift.kind) == "memory"  # logs and metrics carry the plain name
    assert (drift.expected, drift.observed) == (8000, 9313)
    assert "9313 MiB" in drift.message and "8000 MiB" in drift.message
    assert "\n" not in drift.message
    assert drift.excess == 1313


def test_tolerance_is_configurable() -> None:
    nvml, (t4,) = host(["t4"])
    nvml.set_usage(0, memory_used_mib=300)
    assert drifts_of(nvml, [t4], {}) == []
    strict = reconcile([t4], {}, nvml.devices(), FARM_PIDS, Tolerance(vram_mib=0, vram_fraction=0))
    assert [d.kind for d in strict] == [DriftKind.MEMORY]


def test_encoder_sessions_beyond_stream_leases_are_drift() -> None:
    nvml, (l4,) = host(["l4"])
    nvml.set_usage(0, encoder_sessions=5)
    leases = {l4.id: LeaseView(vram_mib=0, encoder_sessions=3, count=3)}
    (drift,) = drifts_of(nvml, [l4], leases)
    assert drift.kind is DriftKind.ENCODER
    assert (drift.expected, drift.observed) == (3, 5)
    assert drift.excess == 2


def test_a_foreign_process_is_named_with_its_memory() -> None:
    nvml, (t4,) = host(["t4"])
    nvml.set_usage(
        0,
        memory_used_mib=4400,
        processes=[GpuProcess(1000, 4000), GpuProcess(31337, 300), GpuProcess(5, 0)],
    )
    leases = {t4.id: LeaseView(vram_mib=4000, encoder_sessions=0, count=1)}
    (drift,) = drifts_of(nvml, [t4], leases)
    assert drift.kind is DriftKind.FOREIGN_PROCESS and drift.pid == 31337
    assert drift.observed == 300
    assert "pid 31337" in drift.message and "300 MiB" in drift.message


def test_a_foreign_process_beyond_the_tolerance_is_memory_drift_too() -> None:
    nvml, (t4,) = host(["t4"])
    nvml.set_usage(0, memory_used_mib=6000, processes=[GpuProcess(4242, 5500)])
    drifts = drifts_of(nvml, [t4], {})
    assert sorted(d.kind for d in drifts) == [DriftKind.FOREIGN_PROCESS, DriftKind.MEMORY]


def test_a_device_nvml_no_longer_reports_is_lost() -> None:
    nvml, devices = host(["2xl4"])
    gpus = nvml.devices()[:1]  # GPU 1 gone after a driver reload
    leases = {devices[1].id: LeaseView(vram_mib=2000, encoder_sessions=1, count=1)}
    (drift,) = reconcile(devices, leases, gpus, FARM_PIDS)
    assert drift.kind is DriftKind.LOST and drift.device_id == devices[1].id
    assert "no longer reported" in drift.message


def test_the_cpu_device_never_drifts() -> None:
    devices = host_devices(Settings(), None, hostname="h", cpu_count=8, memory_mib=8192)
    leases = {devices[0].id: LeaseView(vram_mib=99999, encoder_sessions=99, count=99)}
    assert reconcile(devices, leases, [], set()) == []
