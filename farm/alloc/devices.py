"""This host's device inventory: one Device per GPU (or one CPU device), with its capacity."""

from __future__ import annotations

import os
import platform
import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from farm.errors import BadParameter
from farm.gpu.types import GpuInfo, Nvml, model_of
from farm.settings import Settings, json_object

CPU_CLASS = "cpu"

#: concurrent NVENC sessions a GeForce/TITAN driver allows per system, all cards together:
#: raised to 8 in 2024 (5 in 2023, 3 before); data-centre and pro cards have no such cap
CONSUMER_NVENC_SESSION_CAP = 8

#: the fields FARM_DEVICE_OVERRIDES may set on a device
OVERRIDE_FIELDS = ("vram_mib", "encoder_sessions", "render_slots", "device_class", "labels")

_MIB = 1024 * 1024


@dataclass(frozen=True)
class Device:
    """A device the allocator leases: a GPU, or a whole host's CPUs."""

    id: str
    """The GPU's NVML UUID, or ``cpu-<hostname>``."""
    host: str
    index: int | None
    """NVML index of a GPU; None for the CPU device."""
    model: str
    device_class: str
    vram_mib: int
    """GPU memory; for the CPU device, the host's memory."""
    encoder_sessions: int
    """Stream sessions it may serve (NVENC, or libx264 on the CPU device); 0 is normal."""
    render_slots: int
    labels: tuple[str, ...] = ()
    consumer: bool = False


def device_class_of(name: str) -> str:
    """The short class of an NVML name ("NVIDIA A100-SXM4-80GB" -> "a100"); else a slug."""
    model = model_of(name)
    if model is not None:
        return model
    words = re.findall(r"[a-z0-9]+", name.lower())
    while words and words[0] in ("nvidia", "tesla", "geforce"):
        words.pop(0)
    return "-".join(words) or "gpu"


def host_devices(
    settings: Settings,
    nvml: Nvml | None,
    hostname: str | None = None,
    cpu_count: int | None = None,
    memory_mib: int | None = None,
) -> list[Device]:
    """Every device this host offers, FARM_DEVICE_OVERRIDES applied.

    GPUs when NVML reports any, else one CPU device sized from the core count (``cpu_count``,
    default: the cores this process may run on) and memory (``memory_mib``, default: the
    host's, or the container's limit). NvmlError from ``nvml`` propagates.
    """
    host = hostname or socket.gethostname()
    gpus = nvml.devices() if nvml is not None else []
    if gpus:
        devices = [_gpu_device(settings, host, gpu) for gpu in gpus]
    else:
        cores = cpu_count if cpu_count is not None else _usable_cores()
        memory = memory_mib if memory_mib is not None else _usable_memory_mib()
        devices = [_cpu_device(settings, host, cores, memory)]
    return apply_overrides(devices, settings.device_overrides)


def host_encoder_budget(settings: Settings, devices: list[Device]) -> int | None:
    """NVENC sessions this host may run in all, None for no cap.

    With a consumer card present the driver's cap counts every session on the host, so the
    budget does too (a data-centre card beside it then shares the cap: conservative).
    """
    if settings.host_encoder_budget > 0:
        return settings.host_encoder_budget
    if any(device.consumer for device in devices):
        return CONSUMER_NVENC_SESSION_CAP
    return None


def apply_overrides(devices: list[Device], overrides_json: str) -> list[Device]:
    """``devices`` with FARM_DEVICE_OVERRIDES applied.

    Keys match a device class, a model name or a UUID (the device id); when several match, the
    more specific wins field by field (class, then model, then id). Keys matching nothing are
    ignored: one setting may serve many hosts.
    """
    overrides = parse_overrides(overrides_json)
    if not overrides:
        return devices
    folded = {key.casefold(): value for key, value in overrides.items()}
    result = []
    for device in devices:
        for key in (device.device_class, device.model, device.id):
            changes = folded.get(key.casefold())
            if changes:
                device = replace(device, **changes)
        result.append(device)
    return result


def parse_overrides(text: str) -> dict[str, dict[str, Any]]:
    """FARM_DEVICE_OVERRIDES parsed and checked: ``{key: {field: value}}``."""
    raw = json_object(text, "FARM_DEVICE_OVERRIDES", "keyed by device")
    return {key: _checked_override(key, value) for key, value in raw.items()}


def _checked_override(key: str, value: object) -> dict[str, Any]:
    where = f"FARM_DEVICE_OVERRIDES[{key!r}]"
    if not isinstance(value, dict):
        raise BadParameter(f"{where} must be a JSON object of {', '.join(OVERRIDE_FIELDS)}")
    unknown = sorted(set(value) - set(OVERRIDE_FIELDS))
    if unknown:
        raise BadParameter(
            f"{where} has unknown field(s) {', '.join(unknown)}; "
            f"known: {', '.join(OVERRIDE_FIELDS)}",
            unknown=unknown,
        )
    changes: dict[str, Any] = {}
    for name, item in value.items():
        if name == "device_class":
            if not isinstance(item, str) or not item:
                raise BadParameter(f"{where}.device_class must be a non-empty string")
            changes[name] = item
        elif name == "labels":
            if not isinstance(item, list) or not all(isinstance(s, str) and s for s in item):
                raise BadParameter(f"{where}.labels must be a list of non-empty strings")
            changes[name] = tuple(item)
        else:
            # bool is an int to Python but never a capacity
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise BadParameter(f"{where}.{name} must be a whole number >= 0, not {item!r}")
            changes[name] = item
    return changes


def _gpu_device(settings: Settings, host: str, gpu: GpuInfo) -> Device:
    return Device(
        id=gpu.uuid,
        host=host,
        index=gpu.index,
        model=gpu.name,
        device_class=device_class_of(gpu.name),
        vram_mib=gpu.memory_total_mib,
        encoder_sessions=gpu.encoder_engines * settings.encoder_sessions_per_engine,
        render_slots=settings.gpu_render_slots,
        labels=("gpu", "nvenc") if gpu.encoder_engines > 0 else ("gpu",),
        consumer=gpu.consumer,
    )


def _cpu_device(settings: Settings, host: str, cores: int, memory_mib: int) -> Device:
    # Half the cores per lease: a Cycles render or a libx264 720p60 encode keeps about two busy.
    derived = max(1, cores // 2)
    return Device(
        id=f"cpu-{host}",
        host=host,
        index=None,
        model=_cpu_model(),
        device_class=CPU_CLASS,
        vram_mib=memory_mib,
        encoder_sessions=settings.cpu_encode_sessions or derived,
        render_slots=settings.cpu_render_slots or derived,
        labels=(CPU_CLASS,),
    )


def _usable_cores() -> int:
    # the affinity mask, not os.cpu_count(): a container pinned to 4 of 64 cores has 4
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _usable_memory_mib() -> int:
    physical_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // _MIB
    # a container's cgroup (v2) limit, where there is one, is what this host really has
    limit = _read(Path("/sys/fs/cgroup/memory.max"))
    if limit.isdigit():
        return min(physical_mib, int(limit) // _MIB)
    return physical_mib


def _cpu_model() -> str:
    for line in _read(Path("/proc/cpuinfo")).splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.machine() or "CPU"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
