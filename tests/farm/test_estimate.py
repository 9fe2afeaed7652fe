"""The estimate model: what the probe's renders are fitted to, how a job is priced from them on
each device class, the speed ratios, and what a budget holds a job to."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import redis

from farm import budget, estimaterecords
from farm.alloc.usage import Rates
from farm.estimate import (
    DEFAULT_SPEEDS,
    Pool,
    Probe,
    ProbedFrame,
    Workload,
    adaptive_share,
    estimate,
    fit,
    frame_seconds,
    probe_frames,
    speed_ratio,
)
from farm.models import BlendSource, JobSpec
from farm.settings import Settings
from farm.taskrecords import Attempt, TaskRow
from tests.web.conftest import scene_report

#: a scene whose render costs exactly: sync 0.5 s per frame, 0.02 s per task, 2 us per
#: sample-pixel (the figures measured on this machine, rounded)
SYNC_S, TASK_S, SP_S = 0.5, 0.02, 2e-6
PROBE_W, PROBE_H = 100, 50


def timed(samples: int) -> float:
    return TASK_S + SP_S * samples * PROBE_W * PROBE_H


def probed(
    frame: int, scale: float = 1.0, adaptive: tuple[tuple[int, int, float], ...] = ()
) -> ProbedFrame:
    return ProbedFrame(frame, scale * (SYNC_S + timed(1)), scale * TASK_S, 20,
                       scale * timed(20), adaptive)  # fmt: skip


def probe(*frames: ProbedFrame, adaptive: bool = False, device_class: str = "cpu") -> Probe:
    return Probe(device_class, "CPU", PROBE_W, PROBE_H, 128, adaptive, frames, 1.0)


def spec(**kw: object) -> JobSpec:
    fields: dict[str, object] = {
        "source": BlendSource("upload", "u", "ab" * 32, "s.blend"),
        "frames": (1, 2, 3),
        "tiles": "2x2",
        "width": 640,
        "height": 360,
        "output": "/o",
        "samples": 128,
        **kw,
    }
    return JobSpec(**fields)  # type: ignore[arg-type]


def test_the_fit_recovers_the_costs_the_renders_were_made_of() -> None:
    (cost,) = fit(probe(probed(1)))
    assert cost.sync_s == pytest.approx(SYNC_S)
    assert cost.task_s == pytest.approx(TASK_S)
    assert cost.sample_pixel_s == pytest.approx(SP_S)
    assert cost.adaptive_share == 1.0


def test_a_frame_is_priced_from_its_tasks_pixels_overlaps_included() -> None:
    report = scene_report(640, 360)
    work = Workload.of(spec(overlap_px=16), report)
    # 2x2 tiles of 320x180, each grown by 16 px on its two inner edges
    assert work.sample_pixels == 128 * 4 * (336 * 196)
    costs = fit(probe(probed(1)))
    one_worker = frame_seconds(costs, work, 1, workers=1)
    assert one_worker == pytest.approx(SYNC_S + 4 * TASK_S + SP_S * work.sample_pixels)
    # each of four workers syncs the frame once
    assert frame_seconds(costs, work, 1, workers=4) == pytest.approx(one_worker + 3 * SYNC_S)
    split = Workload.of(spec(mode="sample_split", split_parts=4, tiles="1x1"), report)
    assert split.sample_pixels == 128 * 640 * 360 and split.tasks_per_frame == 4


def test_frames_between_probed_ones_are_interpolated() -> None:
    costs = fit(probe(probed(1), probed(11, scale=3.0)))
    work = Workload.of(spec(frames=(1, 6, 11), tiles="1x1"), scene_report(640, 360))
    first, middle, last = (frame_seconds(costs, work, f, 1) for f in (1, 6, 11))
    assert last == pytest.approx(3 * first)
    assert middle == pytest.approx(2 * first)


def test_adaptive_sampling_scales_the_sample_cost_by_the_share_it_took() -> None:
    # adaptively, patches of 64 and 256 px at the scene's 128 samples took their task cost
    # plus 40 % of their samples' cost
    patches = tuple((px, 128, TASK_S + 0.4 * SP_S * px * 128) for px in (64, 256))
    (cost,) = fit(probe(probed(1, adaptive=patches), adaptive=True))
    assert cost.adaptive_share == pytest.approx(0.4, rel=1e-3)
    report = scene_report(640, 360)
    plain = Workload.of(spec(tiles="1x1"), report)
    adaptive = Workload.of(spec(tiles="1x1"), replace(report, adaptive_sampling=True))
    costs = [cost]
    sampled = SP_S * plain.sample_pixels
    assert frame_seconds(costs, adaptive, 1, 1, 128) == pytest.approx(
        frame_seconds(costs, plain, 1, 1, 128) - 0.6 * sampled, rel=1e-3
    )
    # pixels stop after about 0.4 x 128 = 51 samples: a job of 32 takes them all, one of 512
    # takes the same 51 (a tenth of its count)
    assert adaptive_share(0.4, 128, 32) == 1.0
    assert adaptive_share(0.4, 128, 512) == pytest.approx(0.1)


def test_classes_convert_by_measured_ratio_first_then_the_speed_table() -> None:
    measured = {"cpu>t4": (math.log(0.25), 3)}
    assert speed_ratio("cpu", "t4", measured, {}).factor == pytest.approx(0.25)
    assert speed_ratio("cpu", "t4", measured, {}).source == "measured"
    # the pair measured the other way round counts too
    assert speed_ratio("t4", "cpu", measured, {}).factor == pytest.approx(4.0)
    by_default = speed_ratio("cpu", "a100", measured, {})
    assert by_default.factor == pytest.approx(1 / DEFAULT_SPEEDS["a100"])
    assert by_default.source == "default"
    assert speed_ratio("cpu", "a100", {}, {"a100": 50.0}).factor == pytest.approx(1 / 50)


def test_the_estimate_gives_wall_time_cost_energy_and_carbon_per_class() -> None:
    settings = Settings().with_(
        usage_prices='{"cpu": 0.36, "t4": 0.72}', grid_carbon_g_per_kwh=500.0,
        device_watts='{"cpu": 100, "t4": 70}',
    )  # fmt: skip
    work = Workload.of(spec(tiles="1x1"), scene_report(640, 360))
    pools = {"cpu": Pool(2, 1), "t4": Pool(4, 4)}
    est = estimate(probe(probed(1)), work, ["t4", "a100"], pools, Rates.of(settings),
                   {"cpu>t4": (math.log(0.5), 1)}, {})  # fmt: skip
    cpu, t4, a100 = est.classes
    assert [c.device_class for c in est.classes] == ["cpu", "t4", "a100"]
    assert cpu.render_s == pytest.approx(3 * (SYNC_S + TASK_S + SP_S * work.sample_pixels), 1e-3)
    assert t4.render_s == pytest.approx(cpu.render_s / 2, rel=1e-3)
    # one free CPU renders the three frames one after another; four T4s share them
    assert cpu.wall_s == pytest.approx(cpu.device_s, rel=1e-3)
    assert t4.wall_s == pytest.approx(t4.device_s / 3, rel=1e-3)
    assert cpu.cost == pytest.approx(cpu.device_s / 3600 * 0.36, abs=1e-4)
    assert cpu.energy_kwh == pytest.approx(cpu.device_s * 100 / 3.6e6, rel=1e-3)
    assert cpu.co2e_kg == pytest.approx(cpu.energy_kwh * 0.5, rel=1e-3)
    assert a100.devices == 0 and a100.wall_s is None
    assert budget.job_cost(est, "cpu") == cpu
    assert budget.job_cost(est, "gpu") == max(t4, a100, key=lambda c: c.cost)


def test_the_probe_takes_the_first_last_and_evenly_between() -> None:
    assert probe_frames(1, 1, 1, 3) == [1]
    assert probe_frames(1, 2, 1, 3) == [1, 2]
    assert probe_frames(1, 100, 1, 3) == [1, 51, 100]
    assert probe_frames(10, 20, 5, 3) == [10, 15, 20]
    assert probe_frames(1, 100, 1, 1) == [1]


def test_a_job_on_another_class_records_its_error_and_the_ratio_between_the_classes(
    redis_url: str,
) -> None:
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    work = Workload.of(spec(tiles="1x1", frames=(1,)), scene_report(640, 360))
    pools = {"cpu": Pool(1, 1), "t4": Pool(1, 1)}
    est = estimate(probe(probed(1)), work, ["t4"], pools, Rates.of(Settings()), {}, {})
    cpu, t4 = est.classes
    estimaterecords.save(conn, "j1", est)
    # the job rendered on a T4 in a tenth of the CPU's estimate (the default table says 1/4)
    took_s = cpu.render_s / 10
    done = Attempt(1, "w", "GPU 0 (Tesla T4)", 0.0, 1.0, render_s=took_s, outcome="done",
                   device_class="t4")  # fmt: skip
    rows = [TaskRow(1, 0, "done", 1, [done])]
    found = estimaterecords.record(conn, "j1", "A", rows, now=5.0, keep=100)
    assert found is not None and found.device_class == "t4"
    assert found.error == pytest.approx((t4.render_s - took_s) / took_s, abs=1e-3)
    # recorded once: a second reader (the web, farm status) finds it checked
    assert estimaterecords.record(conn, "j1", "A", rows, now=6.0, keep=100) is None
    (entry,) = estimaterecords.errors(conn)
    assert entry["job"] == "j1" and float(entry["error"]) == found.error
    measured = estimaterecords.ratios(conn)
    assert measured["cpu>t4"][1] == 1
    assert speed_ratio("cpu", "t4", measured, {}).factor == pytest.approx(0.1, rel=1e-3)
    # the next estimate converts by the measured ratio
    again = estimate(probe(probed(1)), work, ["t4"], pools, Rates.of(Settings()), measured, {})
    assert again.classes[1].ratio_source == "measured"
    assert again.classes[1].render_s == pytest.approx(cpu.render_s / 10, rel=1e-3)
    conn.close()
