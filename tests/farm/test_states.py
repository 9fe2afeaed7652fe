"""Tests of the job and tile transition tables the job scripts enforce (farm/jobscripts.py).

That the scripts refuse what the tables forbid, for every pair of states, is tested against
Redis in tests/farm/test_jobstore.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from farm.states import (
    JOB_FINAL,
    JOB_TRANSITIONS,
    TILE_FINAL,
    TILE_TRANSITIONS,
    JobState,
    TileState,
)

TILE_ALLOWED = {
    (TileState.QUEUED, TileState.RENDERING),
    (TileState.QUEUED, TileState.CANCELED),
    (TileState.RENDERING, TileState.DONE),
    (TileState.RENDERING, TileState.QUEUED),
    (TileState.RENDERING, TileState.FAILED),
    (TileState.RENDERING, TileState.CANCELED),
    (TileState.FAILED, TileState.QUEUED),
    (TileState.CANCELED, TileState.QUEUED),
    (TileState.DONE, TileState.QUEUED),
}
JOB_ALLOWED = {
    (JobState.WAITING, JobState.QUEUED),
    (JobState.WAITING, JobState.FAILED),
    (JobState.WAITING, JobState.CANCELED),
    (JobState.QUEUED, JobState.RUNNING),
    (JobState.QUEUED, JobState.FAILED),
    (JobState.QUEUED, JobState.CANCELED),
    (JobState.RUNNING, JobState.ASSEMBLING),
    (JobState.RUNNING, JobState.FAILED),
    (JobState.RUNNING, JobState.CANCELED),
    (JobState.ASSEMBLING, JobState.DONE),
    (JobState.ASSEMBLING, JobState.FAILED),
    (JobState.ASSEMBLING, JobState.CANCELED),
    (JobState.FAILED, JobState.RUNNING),
    (JobState.QUEUED, JobState.SUSPENDED),
    (JobState.RUNNING, JobState.SUSPENDED),
    (JobState.SUSPENDED, JobState.RUNNING),
    (JobState.SUSPENDED, JobState.QUEUED),
    (JobState.SUSPENDED, JobState.ASSEMBLING),
    (JobState.SUSPENDED, JobState.FAILED),
    (JobState.SUSPENDED, JobState.CANCELED),
    (JobState.ASSEMBLING, JobState.RUNNING),
    (JobState.DONE, JobState.RUNNING),
    (JobState.CANCELED, JobState.RUNNING),
}


def test_tables_cover_every_state() -> None:
    assert set(TILE_TRANSITIONS) == set(TileState)
    assert set(JOB_TRANSITIONS) == set(JobState)


def test_tables_are_the_documented_ones() -> None:
    # Written out by hand so that a change to a table is a deliberate change to this test too.
    assert {(a, b) for a, bs in TILE_TRANSITIONS.items() for b in bs} == TILE_ALLOWED
    assert {(a, b) for a, bs in JOB_TRANSITIONS.items() for b in bs} == JOB_ALLOWED


def test_no_state_moves_to_itself() -> None:
    for tile_state in TileState:
        assert tile_state not in TILE_TRANSITIONS[tile_state]
    for job_state in JobState:
        assert job_state not in JOB_TRANSITIONS[job_state]


def test_final_states_leave_only_for_a_retry_or_a_requeue() -> None:
    # a failed job's tiles are failed or canceled (with the job): a retry queues both again;
    # a done tile and a done or canceled job leave only when the user requeues (farm.jobcontrol)
    assert all(TILE_TRANSITIONS[s] == {TileState.QUEUED} for s in TILE_FINAL)
    assert all(JOB_TRANSITIONS[s] == {JobState.RUNNING} for s in JOB_FINAL)


S = TypeVar("S", TileState, JobState)


def reachable(table: Mapping[S, frozenset[S]], start: S) -> set[S]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_state_is_reachable_and_every_unfinished_state_has_a_way_on() -> None:
    assert reachable(TILE_TRANSITIONS, TileState.QUEUED) == set(TileState)
    # a job starts queued, or waiting for the jobs it depends on
    assert reachable(JOB_TRANSITIONS, JobState.WAITING) == set(JobState)
    assert reachable(JOB_TRANSITIONS, JobState.QUEUED) == set(JobState) - {JobState.WAITING}
    assert all(TILE_TRANSITIONS[s] for s in TileState if s not in TILE_FINAL)
    assert all(JOB_TRANSITIONS[s] for s in JobState if s not in JOB_FINAL)


def test_states_are_strings_for_redis_and_json() -> None:
    assert TileState("rendering") is TileState.RENDERING
    assert JobState.ASSEMBLING.value == "assembling"
    assert isinstance(TileState.DONE, str)
