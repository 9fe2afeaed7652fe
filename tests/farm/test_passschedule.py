"""Live-preview passes: disjoint sample runs, growing geometrically, covering every sample,
within a cost budget; and what a live-preview job fixes when it is planned."""

from __future__ import annotations

from dataclasses import replace

import pytest

from farm import submission
from farm.errors import BadParameter
from farm.models import BlendSource
from farm.passschedule import fit_cost, pass_schedule, samples_so_far, trim
from tests.web.conftest import scene_report


@pytest.mark.parametrize("total", [1, 2, 3, 4, 5, 16, 17, 100, 256, 4096, 10_000])
def test_passes_are_disjoint_and_cover_every_sample_once(total: int) -> None:
    runs = pass_schedule(total)
    covered = [s for offset, count in runs for s in range(offset, offset + count)]
    assert covered == list(range(total))
    assert all(count >= 1 for _, count in runs)
    assert len(runs) <= 5


def test_cumulative_counts_grow_geometrically_up_to_the_samples() -> None:
    assert pass_schedule(64) == [(0, 1), (1, 3), (4, 12), (16, 48)]
    runs = pass_schedule(100)
    assert [samples_so_far(runs, k) for k in range(1, len(runs) + 1)] == [1, 4, 16, 64, 100]
    # too many passes: the smallest go, the first pass renders more
    assert [samples_so_far(pass_schedule(4096), k) for k in range(1, 6)] == [
        16, 64, 256, 1024, 4096
    ]  # fmt: skip
    assert pass_schedule(1) == [(0, 1)]
    with pytest.raises(BadParameter, match="at least one sample"):
        pass_schedule(0)


def test_the_cost_fit_finds_a_render_calls_fixed_and_per_sample_time() -> None:
    fixed, per_sample = fit_cost([(1, 0.06), (3, 0.08), (12, 0.17)])
    assert fixed == pytest.approx(0.05)
    assert per_sample == pytest.approx(0.01)
    assert fit_cost([(1, 0.2)]) == (0.2, 0.0)


def test_passes_are_merged_when_their_calls_would_cost_more_than_the_budget() -> None:
    runs = pass_schedule(1024)  # cumulative 4, 16, 64, 256, 1024
    # 50 ms a call, 1 ms a sample: a plain render is about 1.07 s, 10 % of it pays two calls
    cheap_calls = [(4, 0.054), (12, 0.062)]
    assert trim(runs, cheap_calls, 0.10) == [(16, 1008)]
    # 5 ms a call: the budget pays for every pass
    assert trim(runs, [(4, 0.009), (12, 0.017)], 0.10) == runs[2:]
    # a generous budget keeps the schedule; what is left always ends at the total
    assert trim(runs, cheap_calls, 100.0) == runs[2:]
    assert trim(runs, [], 0.10) == runs
    # one pass alone cannot tell a call's fixed cost from its samples': nothing is merged yet
    assert trim(runs, cheap_calls[:1], 0.10) == runs[1:]
    for budget in (0.0, 0.05, 0.2, 1.0):
        rest = trim(runs, cheap_calls, budget)
        assert rest[0][0] == 16 and sum(c for _, c in rest) == 1024 - 16


def test_a_live_preview_job_fixes_its_samples_and_refuses_a_sample_split() -> None:
    source = BlendSource("upload", f"uploads/{'ab' * 32}/upload.blend", "ab" * 32, "b.blend")
    report = replace(scene_report(), samples=48, adaptive_sampling=True)
    req = submission.RenderRequest(output="/tmp/o", frames="1", live_preview=True)
    spec, warnings = submission.plan_job(req, report, source)
    # every pass is a run of the scene's samples, so the job must know them
    assert spec.live_preview and spec.samples == 48
    assert any("adaptive sampling is off in a live preview" in w for w in warnings)
    split = replace(req, mode="sample_split")
    with pytest.raises(BadParameter, match="choose tiles mode"):
        submission.plan_job(split, report, source)
