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


def test_final_states_have_no_exit_but_a_retry_of_failed() -> None:
    # a failed job's tiles are failed or canceled (with the job): a retry queues both again
    retried = {TileState.FAILED, TileState.CANCELED}
    assert {s for s in TileState if not TILE_TRANSITIONS[s]} | retried == TILE_FINAL
    assert {s for s in JobState if not JOB_TRANSITIONS[s]} | {JobState.FAILED} == JOB_FINAL
    assert TILE_TRANSITIONS[TileState.FAILED] == {TileState.QUEUED}
    assert TILE_TRANSITIONS[TileState.CANCELED] == {TileState.QUEUED}
    assert JOB_TRANSITIONS[JobState.FAILED] == {JobState.RUNNING}


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
