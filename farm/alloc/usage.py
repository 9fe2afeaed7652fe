"""Usage accounting: what each project's leases cost in device-hours, energy, money and CO2e.

The allocator's scripts append one record per lease when it ends (released, expired, revoked:
see ``farm.alloc.scripts``) to the project's stream ``keys.usage(project)`` and add it to the
project's running totals. A record carries the lease's device class, its start and end (an
expired lease is charged until its expiry, not until someone noticed), and the device's energy
over it where an agent reports NVML's total-energy counter: the counter's increase between two
heartbeats is split evenly between the leases the device held, so the resolution is one
heartbeat. Where there is no counter, energy is estimated from the class's watts.

Raw entries are kept for FARM_USAGE_RAW_RETENTION_S; then the sweep rolls them up (``roll_up``)
into per-hour totals by class, kind and job (``keys.usage_day``) and trims them from the stream.
A window reads both, so what `farm usage` prints does not change when entries are rolled up; a
window edge inside a rolled-up hour counts that hour in proportion.

Prices (per device-hour, by class) and the grid's carbon intensity come from the settings.
Everything here returns plain dicts: ``farm usage`` prints them and the web serves them.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from farm import keys, redisclock
from farm.alloc import scripts
from farm.errors import BadParameter
from farm.redisclient import Redis, guard
from farm.settings import Settings, json_object

#: rated board power (W) per device class: the energy estimate where NVML has no counter
DEFAULT_WATTS: dict[str, float] = {
    "t4": 70,
    "a10": 150,
    "a10g": 150,
    "a16": 62.5,  # one of the board's four GPUs (250 W board)
    "a40": 300,
    "l4": 72,
    "l40": 300,
    "l40s": 350,
    "rtx3090": 350,
    "rtx4090": 450,
    "a100": 400,
    "h100": 700,
    "h200": 700,
    "cpu": 150,  # a render host's CPUs under load; set FARM_DEVICE_WATTS for yours
    "*": 250,
}

#: the class a price or watts entry applies to when none names the device's class
ANY = "*"

_PAGE = 1000
_HOUR_MS = 3_600_000
_DAY_MS = 86_400_000
#: raw entries a sweep pass rolls up per project at most (the rest wait for the next pass)
ROLL_UP_LIMIT = 1000
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True)
class LeaseUsage:
    """One ended lease, as the allocator recorded it."""

    lease: str
    project: str
    job: str
    holder: str
    kind: str
    device: str
    device_class: str
    start_ms: int
    end_ms: int
    energy_j: float | None
    """Measured (NVML counter) energy over the lease; None: the device reports none."""
    why: str

    @property
    def seconds(self) -> float:
        return (self.end_ms - self.start_ms) / 1000

    @classmethod
    def from_fields(cls, f: dict[str, str]) -> LeaseUsage:
        return cls(
            lease=f.get("lease", ""),
            project=f.get("project", ""),
            job=f.get("job", ""),
            holder=f.get("holder", ""),
            kind=f.get("kind", ""),
            device=f.get("device", ""),
            device_class=f.get("class", ""),
            start_ms=int(float(f.get("start_ms", "0"))),
            end_ms=int(float(f.get("end_ms", "0"))),
            energy_j=float(f["energy_j"]) if f.get("energy_j") else None,
            why=f.get("why", ""),
        )


@dataclass(frozen=True)
class RolledHour:
    """One hour of a project's rolled-up leases of one class, kind and job."""

    hour_ms: int
    device_class: str
    kind: str
    job: str
    ms: int
    unmeasured_ms: int
    """The part of ``ms`` without an energy counter (estimated from rated power when read)."""
    energy_j: float
    leases: int
    """Leases in this hour."""
    continued: int
    """Those of ``leases`` that were in the hour before too (a window counts them there)."""


@dataclass(frozen=True)
class ClassTotals:
    """All-time totals of one project on one device class (the metrics' counters)."""

    project: str
    device_class: str
    seconds_by_kind: dict[str, float] = field(default_factory=dict)
    energy_j: float = 0.0
    """Measured energy plus the estimate for the seconds without a counter."""


@dataclass(frozen=True)
class Rates:
    """Prices, watts and carbon intensity from the settings, checked once."""

    prices: dict[str, float]
    watts: dict[str, float]
    currency: str
    carbon_g_per_kwh: float

    @classmethod
    def of(cls, settings: Settings) -> Rates:
        prices = _table(settings.usage_prices, "FARM_USAGE_PRICES")
        watts = {**DEFAULT_WATTS, **_table(settings.device_watts, "FARM_DEVICE_WATTS")}
        return cls(prices, watts, settings.usage_currency, settings.grid_carbon_g_per_kwh)

    def price(self, device_class: str) -> float:
        return self.prices.get(device_class, self.prices.get(ANY, 0.0))

    def watt(self, device_class: str) -> float:
        return self.watts.get(device_class, self.watts[ANY])


def _table(text: str, name: str) -> dict[str, float]:
    data = json_object(text, name, 'of class -> number, e.g. {"t4": 0.35}')
    out: dict[str, float] = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise BadParameter(f"{name}: {key!r} must be a number of 0 or more, not {value!r}")
        out[str(key)] = float(value)
    return out


# --- reading ------------------------------------------------------------------------------------


def projects(conn: Redis) -> list[str]:
    """Every project with recorded usage."""
    return sorted(guard(conn.smembers, keys.USAGE_PROJECTS))


def records(
    conn: Redis, project: str, since_ms: int | None = None, until_ms: int | None = None
) -> list[LeaseUsage]:
    """The project's ended leases that overlap [since_ms, until_ms), oldest first."""
    out: list[LeaseUsage] = []
    start = "-"
    while True:
        page = guard(conn.xrange, keys.usage(project), start, "+", _PAGE)
        for _entry_id, raw in page:
            fields = {_text(k): _text(v) for k, v in raw.items()}
            rec = LeaseUsage.from_fields(fields)
            before = since_ms is not None and rec.end_ms < since_ms
            after = until_ms is not None and rec.start_ms >= until_ms
            if not (before or after):
                out.append(rec)
        if len(page) < _PAGE:
            return out
        start = "(" + _text(page[-1][0])


def rolled_hours(
    conn: Redis, project: str, since_ms: int | None = None, until_ms: int | None = None
) -> list[RolledHour]:
    """The project's rolled-up hours that overlap [since_ms, until_ms), oldest first."""
    lo = "-inf" if since_ms is None else since_ms // _DAY_MS
    hi = "+inf" if until_ms is None else (until_ms - 1) // _DAY_MS
    days = [_text(d) for d in guard(conn.zrangebyscore, keys.usage_days(project), lo, hi)]
    pipe = conn.pipeline(transaction=False)
    for day in days:
        pipe.hgetall(keys.usage_day(project, day))
    found: dict[tuple[int, str, str, str], dict[str, float]] = {}
    for day, stored in zip(days, guard(pipe.execute) if days else [], strict=True):
        for name, value in stored.items():
            hour, device_class, kind, rest = _text(name).split("|", 3)
            job, metric = rest.rsplit("|", 1)
            hour_ms = int(day) * _DAY_MS + int(hour) * _HOUR_MS
            row = found.setdefault((hour_ms, device_class, kind, job), {})
            row[metric] = float(_text(value))
    out = []
    for (hour_ms, device_class, kind, job), m in sorted(found.items()):
        if _overlap(hour_ms, since_ms, until_ms) > 0:
            ms, unmeasured, leases, continued = (int(m.get(k, 0)) for k in ("ms", "u", "n", "c"))
            out.append(RolledHour(hour_ms, device_class, kind, job, ms, unmeasured,
                                  m.get("j", 0.0), leases, continued))  # fmt: skip
    return out


def _overlap(hour_ms: int, since_ms: int | None, until_ms: int | None) -> float:
    """The part of an hour inside the window."""
    lo = hour_ms if since_ms is None else max(hour_ms, since_ms)
    hi = hour_ms + _HOUR_MS if until_ms is None else min(hour_ms + _HOUR_MS, until_ms)
    return max(0, hi - lo) / _HOUR_MS


def roll_up(conn: Redis, now_ms: int, raw_retention_s: float, limit: int = ROLL_UP_LIMIT) -> int:
    """Roll every project's raw entries older than ``raw_retention_s`` up into its hours and
    trim them (at most ``limit`` per project); returns how many were rolled up."""
    newest = int(now_ms - raw_retention_s * 1000) - 1
    if newest < 0:
        return 0
    script = conn.register_script(scripts.ROLL_UP_USAGE)
    return sum(int(guard(script, keys=[], args=[p, newest, limit])) for p in projects(conn))


def totals(conn: Redis, settings: Settings) -> list[ClassTotals]:
    """All-time totals per project and device class (cheap: one hash per project)."""
    rates = Rates.of(settings)
    out = []
    for project in projects(conn):
        stored = guard(conn.hgetall, keys.usage_totals(project))
        raw = {_text(k): float(v) for k, v in stored.items()}
        classes: dict[str, dict[str, float]] = {}
        unmeasured_s: dict[str, float] = {}
        for name, value in raw.items():
            part, _, rest = name.partition("|")
            device_class, _, kind = rest.partition("|")
            # ``m|``/``u|`` are integer ms by class and kind (measured energy or not);
            # ``s|class|kind`` and ``u|class`` seconds are totals recorded before them
            seconds = value / 1000 if part in ("m", "u") and kind else value
            if part in ("s", "m") or (part == "u" and kind):
                by_kind = classes.setdefault(device_class, {})
                by_kind[kind] = by_kind.get(kind, 0.0) + seconds
            if part == "u":
                unmeasured_s[device_class] = unmeasured_s.get(device_class, 0.0) + seconds
        for device_class, by_kind in sorted(classes.items()):
            energy = raw.get(f"j|{device_class}", 0.0)
            energy += unmeasured_s.get(device_class, 0.0) * rates.watt(device_class)
            out.append(ClassTotals(project, device_class, by_kind, energy))
    return out


# --- summing up ---------------------------------------------------------------------------------


@dataclass
class _Sum:
    seconds: float = 0.0
    render_s: float = 0.0
    stream_s: float = 0.0
    measured_j: float = 0.0
    estimated_j: float = 0.0
    cost: float = 0.0
    leases: int = 0

    def add(self, rec: LeaseUsage, share: float, rates: Rates) -> None:
        secs = rec.seconds * share
        self.seconds += secs
        if rec.kind == "render":
            self.render_s += secs
        elif rec.kind == "stream":
            self.stream_s += secs
        if rec.energy_j is None:
            self.estimated_j += secs * rates.watt(rec.device_class)
        else:
            self.measured_j += rec.energy_j * share
        self.cost += secs / 3600 * rates.price(rec.device_class)
        self.leases += 1

    def add_rolled(self, row: RolledHour, share: float, leases: int, rates: Rates) -> None:
        secs = row.ms / 1000 * share
        self.seconds += secs
        if row.kind == "render":
            self.render_s += secs
        elif row.kind == "stream":
            self.stream_s += secs
        self.estimated_j += row.unmeasured_ms / 1000 * share * rates.watt(row.device_class)
        self.measured_j += row.energy_j * share
        self.cost += secs / 3600 * rates.price(row.device_class)
        self.leases += leases

    def to_dict(self, rates: Rates) -> dict[str, Any]:
        kwh = (self.measured_j + self.estimated_j) / 3.6e6
        return {
            "device_seconds": round(self.seconds, 3),
            "device_hours": round(self.seconds / 3600, 6),
            "render_hours": round(self.render_s / 3600, 6),
            "stream_hours": round(self.stream_s / 3600, 6),
            "energy_kwh": round(kwh, 9),
            "energy_measured_kwh": round(self.measured_j / 3.6e6, 9),
            "energy_estimated_kwh": round(self.estimated_j / 3.6e6, 9),
            "cost": round(self.cost, 4),
            "co2e_kg": round(kwh * rates.carbon_g_per_kwh / 1000, 9),
            "leases": self.leases,
        }


def _share(rec: LeaseUsage, since_ms: int | None, until_ms: int | None) -> float:
    """The part of a lease inside the window (a lease across its edge counts in part)."""
    lo = rec.start_ms if since_ms is None else max(rec.start_ms, since_ms)
    hi = rec.end_ms if until_ms is None else min(rec.end_ms, until_ms)
    if rec.end_ms <= rec.start_ms:
        return 1.0
    return max(0.0, hi - lo) / (rec.end_ms - rec.start_ms)


def summarize(
    recs: Iterable[LeaseUsage],
    settings: Settings,
    project: str,
    since_ms: int | None = None,
    until_ms: int | None = None,
    rolled: Iterable[RolledHour] = (),
) -> dict[str, Any]:
    """Device-hours, kWh, cost and CO2e of ``recs`` and ``rolled`` in the window, by class and
    by job."""
    rates = Rates.of(settings)
    total, gpu = _Sum(), _Sum()
    by_class: dict[str, _Sum] = {}
    by_job: dict[str, _Sum] = {}
    for rec in recs:
        share = _share(rec, since_ms, until_ms)
        total.add(rec, share, rates)
        if rec.device_class != "cpu":
            gpu.add(rec, share, rates)
        by_class.setdefault(rec.device_class, _Sum()).add(rec, share, rates)
        if rec.job:
            by_job.setdefault(rec.job, _Sum()).add(rec, share, rates)
    for row in rolled:
        share = _overlap(row.hour_ms, since_ms, until_ms)
        # a lease across hours counts once in a window: as continued where the hour before
        # is in the window too
        leases = row.leases
        if _overlap(row.hour_ms - _HOUR_MS, since_ms, until_ms) > 0:
            leases -= row.continued
        sums = [total, by_class.setdefault(row.device_class, _Sum())]
        sums += [gpu] if row.device_class != "cpu" else []
        sums += [by_job.setdefault(row.job, _Sum())] if row.job else []
        for s in sums:
            s.add_rolled(row, share, leases, rates)
    return {
        "project": project,
        "since": _iso(since_ms),
        "until": _iso(until_ms),
        "currency": rates.currency,
        "grid_carbon_g_per_kwh": rates.carbon_g_per_kwh,
        "total": {**total.to_dict(rates), "gpu_hours": round(gpu.seconds / 3600, 6)},
        "by_class": [
            {
                "device_class": name,
                "price_per_hour": rates.price(name),
                "watts_estimate": rates.watt(name),
                **s.to_dict(rates),
            }
            for name, s in sorted(by_class.items())
        ],
        "jobs": [{"job": job, **s.to_dict(rates)} for job, s in sorted(by_job.items())],
    }


def project_usage(
    conn: Redis,
    settings: Settings,
    project: str,
    since: str | None = None,
    until: str | None = None,
    now_s: float | None = None,
) -> dict[str, Any]:
    """What `farm usage` prints and the API serves: one project's usage in a window.

    ``since``/``until`` are ISO dates or times (UTC unless they say otherwise) or ages such as
    ``7d``, ``24h``; unset ``since`` means from the first record, unset ``until`` means now.
    """
    if not project:
        raise BadParameter("name the project whose usage to show")
    # the entries' times are Redis's (the allocator's scripts): so is "now" of an age
    now_s = redisclock.now(conn) if now_s is None else now_s
    since_ms = None if since is None else int(parse_time(since, now_s) * 1000)
    until_ms = None if until is None else int(parse_time(until, now_s) * 1000)
    if since_ms is not None and until_ms is not None and until_ms <= since_ms:
        raise BadParameter(f"--until ({until}) must be after --since ({since})")
    # the roll-up moves entries from the stream to the hours: read both between two reads of
    # its mark, so no entry is counted twice nor missed
    for _ in range(5):
        mark = guard(conn.get, keys.usage_rolled(project))
        rolled = rolled_hours(conn, project, since_ms, until_ms)
        recs = records(conn, project, since_ms, until_ms)
        if guard(conn.get, keys.usage_rolled(project)) == mark:
            break
    return summarize(recs, settings, project, since_ms, until_ms, rolled)


def parse_time(text: str, now_s: float | None = None) -> float:
    """Epoch seconds of ``2026-11-01``, ``2026-11-01T12:00[:00][+01:00]`` or an age (``7d``)."""
    value = text.strip()
    now = time.time() if now_s is None else now_s
    if match := _RELATIVE.match(value.lower()):
        return now - float(match[1]) * _UNIT_S[match[2]]
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadParameter(
            f"{text!r} is not a date (2026-11-01, 2026-11-01T12:00) or an age (7d, 24h, 30m)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def render_text(summary: dict[str, Any]) -> str:
    """``summary`` as the table `farm usage` prints."""
    t = summary["total"]
    cur = summary["currency"]
    lines = [
        f"usage of project {summary['project']} from {summary['since'] or 'the start'} to "
        f"{summary['until'] or 'now'}",
        f"{'CLASS':<12} {'HOURS':>10} {'RENDER':>10} {'STREAM':>10} {'kWh':>10} "
        f"{'COST ' + cur:>12} {'CO2e kg':>10} {'LEASES':>7}",
    ]
    for row in summary["by_class"]:
        lines.append(
            f"{row['device_class']:<12} {row['device_hours']:>10.3f} {row['render_hours']:>10.3f} "
            f"{row['stream_hours']:>10.3f} {row['energy_kwh']:>10.3f} {row['cost']:>12.2f} "
            f"{row['co2e_kg']:>10.3f} {row['leases']:>7}"
        )
    lines.append(
        f"{'total':<12} {t['device_hours']:>10.3f} {t['render_hours']:>10.3f} "
        f"{t['stream_hours']:>10.3f} {t['energy_kwh']:>10.3f} {t['cost']:>12.2f} "
        f"{t['co2e_kg']:>10.3f} {t['leases']:>7}"
    )
    estimated = t["energy_estimated_kwh"]
    lines.append(
        f"GPU-hours {t['gpu_hours']:.3f}, {t['energy_kwh']:.3f} kWh "
        f"({estimated:.3f} kWh estimated from rated power), cost {t['cost']:.2f} {cur}, "
        f"{t['co2e_kg']:.3f} kg CO2e at {summary['grid_carbon_g_per_kwh']:g} g/kWh"
    )
    return "\n".join(lines)


def _iso(ms: int | None) -> str | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="seconds")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
