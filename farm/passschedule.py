"""Live-preview sample passes: which disjoint runs of a tile's samples each pass renders.

A tile in preview mode renders its samples in passes whose cumulative counts grow geometrically
(1, 4, 16, 64, ... up to the scene's samples); each pass is a disjoint run of the samples
(Cycles' sample subset), so merging the passes so far is an honest image of that many samples
and merging all of them is the full render (workers.samplesplit.merge_parts).
"""

from __future__ import annotations

from farm.errors import BadParameter

#: each pass's cumulative sample count is this many times the one before
GROWTH = 4
#: passes of one tile at most: each costs a render call's fixed overhead (scene sync, kernel
#: start, writing the EXR, tone-mapping the preview), so the earliest passes go first
MAX_PASSES = 5


def pass_schedule(
    total: int, growth: int = GROWTH, max_passes: int = MAX_PASSES
) -> list[tuple[int, int]]:
    """``(sample_offset, sample_count)`` of each pass: disjoint, in order, covering 0..total-1.

    Cumulative counts are ``growth**k`` below ``total``, then ``total``; with more than
    ``max_passes`` of them the smallest are dropped (the first pass renders more samples).
    """
    if total < 1:
        raise BadParameter(f"a live preview needs at least one sample, not {total}")
    if growth < 2 or max_passes < 1:
        raise BadParameter(f"pass growth {growth} (>= 2) or passes {max_passes} (>= 1) is wrong")
    cumulative, n = [], 1
    while n < total:
        cumulative.append(n)
        n *= growth
    cumulative.append(total)
    cumulative = cumulative[-max_passes:]
    runs, start = [], 0
    for end in cumulative:
        runs.append((start, end - start))
        start = end
    return runs


def samples_so_far(schedule: list[tuple[int, int]], passes_done: int) -> int:
    """Samples merged after the first ``passes_done`` passes."""
    return sum(count for _, count in schedule[:passes_done])
