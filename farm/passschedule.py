"""Live-preview sample passes: which disjoint runs of a tile's samples each pass renders.

A tile in preview mode renders its samples in passes whose cumulative counts grow geometrically
(1, 4, 16, 64, ... up to the scene's samples); each pass is a disjoint run of the samples
(Cycles' sample subset), so merging the passes so far is an honest image of that many samples
and merging all of them is the full render (workers.samplesplit.merge_parts).

Each pass pays a render call's fixed cost (scene sync, kernel start, the EXR, the merge, the
tone-mapped JPEG) on top of its samples. ``trim`` keeps that extra within a budget: from the
passes done so far it fits ``seconds = fixed + per_sample * samples`` and drops pass boundaries
still to come (merging those passes) once more calls would cost more than the budget's share
of what one plain render of the tile costs.
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


def fit_cost(timings: list[tuple[int, float]]) -> tuple[float, float]:
    """``(fixed_s, per_sample_s)`` of ``seconds = fixed + per_sample * samples`` fitted by least
    squares to ``(samples, seconds)`` of passes done; both at least 0. One pass: all fixed."""
    if not timings:
        return 0.0, 0.0
    if len(timings) == 1 or len({n for n, _ in timings}) == 1:
        return max(0.0, timings[0][1]), 0.0
    mean_n = sum(n for n, _ in timings) / len(timings)
    mean_t = sum(t for _, t in timings) / len(timings)
    var = sum((n - mean_n) ** 2 for n, _ in timings)
    slope = max(0.0, sum((n - mean_n) * (t - mean_t) for n, t in timings) / var)
    return max(0.0, mean_t - slope * mean_n), slope


def trim(
    schedule: list[tuple[int, int]], timings: list[tuple[int, float]], budget: float
) -> list[tuple[int, int]]:
    """The passes still to render after ``timings`` (one ``(samples, seconds)`` per pass done,
    in order), within ``budget``: the extra cost of the passes' render calls over one plain
    render, as a fraction of that render's estimated time.

    Later boundaries are kept, earlier ones merged: the run left always ends at the total.
    """
    done = len(timings)
    rest = schedule[done:]
    # one pass cannot tell a call's fixed cost from its samples' (fit_cost counts it all fixed)
    if len({n for n, _ in timings}) < 2 or len(rest) <= 1:
        return rest
    fixed, per_sample = fit_cost(timings)
    if fixed <= 0:
        return rest
    total = sum(count for _, count in schedule)
    plain_s = fixed + per_sample * total
    calls = 1 + int(budget * plain_s / fixed)  # render calls the budget pays for
    keep = max(1, calls - done)
    if keep >= len(rest):
        return rest
    ends = [offset + count for offset, count in rest][-keep:]
    start = rest[0][0]
    out = []
    for end in ends:
        out.append((start, end - start))
        start = end
    return out


def samples_so_far(schedule: list[tuple[int, int]], passes_done: int) -> int:
    """Samples merged after the first ``passes_done`` passes."""
    return sum(count for _, count in schedule[:passes_done])
