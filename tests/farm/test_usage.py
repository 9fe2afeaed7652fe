"""Usage accounting: every ended lease is charged to its project and job, and `farm usage` and
the API's dict add them up into device-hours, kWh, cost and CO2e."""

from __future__ import annotations

import json
import time

import pytest
import redis

from farm import cli, keys
from farm.alloc import usage
from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator
from farm.errors import BadParameter
from farm.jobstore import JobStore
from farm.settings import Settings

T4 = DeviceOffer("gpu-t4", "t4", "Tesla T4", 15360, 8, 2)
CPU = DeviceOffer("cpu-host", "cpu", "cpu", 65536, 4, 4)

#: 2026-11-01T00:00:00Z in ms: the test clock starts here
T0_MS = 1_793_491_200_000


class Clock:
    def __init__(self) -> None:
        self.ms = T0_MS

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def alloc(redis_url: str, clock: Clock) -> SlotAllocator:
    a = SlotAllocator(redis.Redis.from_url(redis_url, decode_responses=True), ttl_s=3600,
                      clock_ms=clock)  # fmt: skip
    # the T4's agent reports NVML's energy counter; the CPU device has none
    a.register("agent", "host-1", [_t4(energy_j=5000.0), CPU], ttl_s=86400)
    return a


def _t4(energy_j: float) -> DeviceOffer:
    return DeviceOffer(T4.id, "t4", "Tesla T4", 15360, 8, 2, energy_j=energy_j)


SETTINGS = Settings(
    usage_prices=json.dumps({"t4": 0.36, "*": 0.05}),
    device_watts=json.dumps({"cpu": 200}),
    grid_carbon_g_per_kwh=300.0,
)


def test_totals_equal_the_sum_of_lease_durations_and_energy_is_split_and_estimated(
    alloc: SlotAllocator, clock: Clock
) -> None:
    render = Request("render", vram_mib=2000, render_slots=1, classes=("t4",),
                     project="film", job="job-a")  # fmt: skip
    a = alloc.acquire("w1", render)
    b = alloc.acquire("w2", render)
    cpu = alloc.acquire("w3", Request("render", render_slots=1, classes=("cpu",),
                                      project="film", job="job-b"))  # fmt: skip
    clock.ms += 600_000  # 10 min; the T4 burned 1200 J meanwhile, shared by its two leases
    alloc.register("agent", "host-1", [_t4(energy_j=6200.0), CPU], ttl_s=86400)
    alloc.release(a)
    clock.ms += 1_200_000  # 20 more min: only b on the T4 now, 900 J all its own
    alloc.register("agent", "host-1", [_t4(energy_j=7100.0), CPU], ttl_s=86400)
    alloc.release(b)
    alloc.release(cpu)
    # a stream holder dies: its lease expires an hour after its grant (never renewed) and is
    # reclaimed by the next allocator call two hours later, but is charged only up to its expiry
    alloc.acquire("s1", Request("stream", encoder_sessions=1, classes=("t4",), project="film"))
    clock.ms += 7_200_000
    alloc.acquire("other", Request("render", render_slots=1, classes=("cpu",), project="ads"))

    summary = usage.project_usage(alloc.conn, SETTINGS, "film", now_s=clock.ms / 1000)

    cpu_row, t4 = summary["by_class"]  # sorted by class
    assert (t4["device_class"], cpu_row["device_class"]) == ("t4", "cpu")
    # leases: a 600 s, b 1800 s, the stream 3600 s on the T4; 1800 s on the CPU
    assert t4["device_seconds"] == pytest.approx(600 + 1800 + 3600)
    assert t4["render_hours"] == pytest.approx(2400 / 3600)
    assert t4["stream_hours"] == pytest.approx(1.0)
    assert cpu_row["device_seconds"] == pytest.approx(1800)
    assert summary["total"]["device_seconds"] == pytest.approx(600 + 1800 + 3600 + 1800)
    assert summary["total"]["gpu_hours"] == pytest.approx(6000 / 3600)
    assert summary["total"]["leases"] == 4
    # measured: a got 600 J (half of 1200), b 600 + 900 J; the stream lease saw no beat
    assert t4["energy_measured_kwh"] == pytest.approx(2100 / 3.6e6)
    assert t4["energy_estimated_kwh"] == 0
    # the CPU device has no counter: 200 W (configured) for 1800 s
    assert cpu_row["energy_estimated_kwh"] == pytest.approx(200 * 1800 / 3.6e6)
    kwh = (2100 + 200 * 1800) / 3.6e6
    assert summary["total"]["energy_kwh"] == pytest.approx(kwh, abs=1e-6)
    assert summary["total"]["co2e_kg"] == pytest.approx(kwh * 300 / 1000, abs=1e-6)
    assert t4["cost"] == pytest.approx(6000 / 3600 * 0.36, abs=1e-4)
    assert cpu_row["cost"] == pytest.approx(0.5 * 0.05, abs=1e-4)  # the "*" price
    jobs = {row["job"]: row for row in summary["jobs"]}
    assert jobs["job-a"]["device_seconds"] == pytest.approx(2400)
    assert jobs["job-b"]["device_seconds"] == pytest.approx(1800)
    # the all-time totals the metrics export agree with the records
    totals = {row.device_class: row for row in usage.totals(alloc.conn, SETTINGS)
              if row.project == "film"}  # fmt: skip
    assert totals["t4"].seconds_by_kind == pytest.approx({"render": 2400, "stream": 3600})
    assert totals["t4"].energy_j == pytest.approx(2100)
    assert totals["cpu"].energy_j == pytest.approx(200 * 1800)
    assert usage.projects(alloc.conn) == ["film"]  # "ads" holds its lease still


def test_a_window_counts_only_the_part_of_each_lease_inside_it(
    alloc: SlotAllocator, clock: Clock
) -> None:
    lease = alloc.acquire("w", Request("render", render_slots=1, classes=("cpu",), project="p"))
    for _ in range(4):  # two hours, 00:00 to 02:00, renewed every half hour
        clock.ms += 1_800_000
        lease = alloc.renew(lease)
    alloc.release(lease)
    now_s = clock.ms / 1000
    inside = usage.project_usage(alloc.conn, SETTINGS, "p", "2026-11-01T01:30", now_s=now_s)
    assert inside["total"]["device_hours"] == pytest.approx(0.5)
    assert inside["since"] == "2026-11-01T01:30:00+00:00"
    later = usage.project_usage(alloc.conn, SETTINGS, "p", "2026-11-02", now_s=now_s)
    assert later["total"]["leases"] == 0 and later["total"]["device_hours"] == 0
    age = usage.project_usage(alloc.conn, SETTINGS, "p", "1h", now_s=now_s)
    assert age["total"]["device_hours"] == pytest.approx(1.0)


def test_farm_usage_prints_gpu_hours_kwh_cost_and_co2e(
    alloc: SlotAllocator,
    clock: Clock,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lease = alloc.acquire("w", Request("render", render_slots=1, classes=("t4",),
                                       project="film", job="j1"))  # fmt: skip
    clock.ms += 1_800_000
    alloc.register("agent", "host-1", [_t4(energy_j=5000.0 + 126_000), CPU], ttl_s=86400)
    alloc.release(lease)
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    monkeypatch.setenv("FARM_USAGE_PRICES", '{"t4": 0.5}')
    monkeypatch.setenv("FARM_GRID_CARBON_G_PER_KWH", "250")

    assert cli.main(["usage", "--project", "film", "--since", "2026-11-01"]) == 0
    text = capsys.readouterr().out
    assert "GPU-hours 0.500" in text and "0.035 kWh" in text  # 126 kJ in half an hour: 70 W
    assert "cost 0.25 USD" in text and "0.009 kg CO2e at 250 g/kWh" in text

    assert cli.main(["usage", "--project", "film", "--since", "2026-11-01", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"]["gpu_hours"] == pytest.approx(0.5)
    assert data["jobs"][0]["job"] == "j1"
    # without --project: every project with usage
    assert cli.main(["usage", "--json"]) == 0
    assert [s["project"] for s in json.loads(capsys.readouterr().out)] == ["film"]


def test_bad_dates_and_price_tables_are_refused_with_a_clear_message(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    assert cli.main(["usage", "--project", "film", "--since", "last tuesday"]) != 0
    assert "is not a date" in capsys.readouterr().err
    bad = Settings(usage_prices='{"t4": "cheap"}')
    with pytest.raises(BadParameter, match="FARM_USAGE_PRICES"):
        usage.project_usage(redis.Redis.from_url(redis_url), bad, "film")
    with pytest.raises(BadParameter, match="after --since"):
        usage.project_usage(redis.Redis.from_url(redis_url), SETTINGS, "f", "2026-11-02",
                            "2026-11-01")  # fmt: skip


def test_rolling_raw_entries_up_changes_neither_farm_usage_nor_the_totals(
    alloc: SlotAllocator,
    clock: Clock,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # leases across hour edges: measured (the T4) and estimated (the CPU), two jobs, a stream
    clock.ms += 3_000_000  # 00:50
    a = alloc.acquire("w1", Request("render", vram_mib=2000, render_slots=1, classes=("t4",),
                                    project="film", job="job-a"))  # fmt: skip
    b = alloc.acquire("w2", Request("render", render_slots=1, classes=("cpu",),
                                    project="film", job="job-b"))  # fmt: skip
    clock.ms += 1_500_000  # 01:15
    alloc.register("agent", "host-1", [_t4(energy_j=8000.0), CPU], ttl_s=86400)
    alloc.release(a)
    s = alloc.acquire("s1", Request("stream", encoder_sessions=1, classes=("t4",), project="film"))
    clock.ms += 5_400_000  # 02:45
    alloc.release(b)
    alloc.release(s)
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    monkeypatch.setenv("FARM_USAGE_PRICES", '{"t4": 0.36, "*": 0.05}')

    def shown() -> tuple[str, dict[str, object], str, list[usage.ClassTotals]]:
        assert cli.main(["usage", "--project", "film"]) == 0
        text = capsys.readouterr().out
        assert cli.main(["usage", "--project", "film", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        # a window on hour edges: the rolled-up hours inside it count whole, the others not
        window = ["--since", "2026-11-01T01:00", "--until", "2026-11-01T02:00"]
        assert cli.main(["usage", "--project", "film", *window]) == 0
        return text, data, capsys.readouterr().out, usage.totals(alloc.conn, SETTINGS)

    before = shown()
    assert "LEASES" in before[0] and before[1]["total"]["leases"] == 3  # type: ignore[index]
    assert usage.roll_up(alloc.conn, T0_MS * 10, 0, limit=1) == 1  # one rolled, two raw
    assert shown() == before
    # the sweeper rolls up the rest: the raw stream is empty, what `farm usage` says is not
    store = JobStore(alloc.conn, clock=lambda: time.time() + 1, usage_raw_retention_s=0)
    assert store.sweep("w1", 15.0).rolled_usage == 2
    assert alloc.conn.xlen(keys.usage("film")) == 0
    assert usage.records(alloc.conn, "film") == []
    assert shown() == before
