"""Live-preview passes: disjoint sample runs, growing geometrically, covering every sample."""

from __future__ import annotations

import pytest

from farm.errors import BadParameter
from farm.passschedule import pass_schedule, samples_so_far


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
