"""Quoting a planned job before it is queued: its estimate from the inspection's probe, on
each device class the submitter may use that is online, with the farm's prices, power figures
and measured speed ratios (farm.estimate does the maths; this module gathers its inputs)."""

from __future__ import annotations

from collections.abc import Iterable

from farm import estimaterecords
from farm.alloc import policy
from farm.alloc.allocator import DeviceState, SlotAllocator
from farm.alloc.usage import Rates
from farm.errors import BadParameter
from farm.estimate import Estimate, Pool, Probe, Workload, estimate
from farm.models import InspectionReport, JobSpec
from farm.redisclient import Redis
from farm.settings import Settings, json_object


def speeds_of(settings: Settings) -> dict[str, float]:
    """FARM_DEVICE_SPEEDS, checked."""
    data = json_object(settings.device_speeds, "FARM_DEVICE_SPEEDS", 'of class -> speed, {"t4": 4}')
    out = {}
    for name, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise BadParameter(f"FARM_DEVICE_SPEEDS: {name!r} must be a number above 0")
        out[str(name)] = float(value)
    return out


def pools(devices: Iterable[DeviceState]) -> dict[str, Pool]:
    """Render devices online by class: how many, how many with a render slot free now."""
    count: dict[str, int] = {}
    free: dict[str, int] = {}
    for d in devices:
        if not (d.alive and d.available and d.render_slots > 0):
            continue
        count[d.device_class] = count.get(d.device_class, 0) + 1
        if d.used_render_slots < d.render_slots:
            free[d.device_class] = free.get(d.device_class, 0) + 1
    return {c: Pool(n, free.get(c, 0)) for c, n in count.items()}


def allowed_classes(
    allocator: SlotAllocator, project: str, role: str, online: Iterable[str]
) -> list[str]:
    """The online classes the role may lease in the project (an operator's job: every one)."""
    names = sorted(set(online))
    if not role:
        return names
    allowed = allocator.policy(project).get(role, ())
    return [c for c in names if policy.permits(allowed, c)]


def quote(
    conn: Redis,
    settings: Settings,
    allocator: SlotAllocator,
    report: InspectionReport,
    spec: JobSpec,
) -> Estimate:
    """The estimate of ``spec`` (planned from ``report``, which carries the probe)."""
    if report.probe is None:
        why = f": {report.probe_error}" if report.probe_error else ""
        raise BadParameter(f"the farm could not estimate {spec.source.name} (no probe{why})")
    probe = Probe.from_dict(report.probe)
    found = pools(allocator.devices())
    classes = allowed_classes(allocator, spec.project, spec.role, found)
    return estimate(
        probe,
        Workload.of(spec, report),
        classes,
        found,
        Rates.of(settings),
        estimaterecords.ratios(conn),
        speeds_of(settings),
    )
