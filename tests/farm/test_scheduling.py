"""Scheduling against a real redis-server, without workers: the bounds of tags, dependencies and
frame order; the queue pick's routing by tags, tag limits and blocklists; dependencies released,
failed and healed by the sweep's recheck."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from rq.exceptions import DequeueTimeout

from farm import blocklist, dependencies, keys, submission, tagslots
from farm.accept import accept
from farm.errors import BadParameter
from farm.frames import ordered_frames
from farm.jobstore import JobStore
from farm.models import BlendSource
from farm.queue import Picker, RenderQueue, _BandedQueue
from farm.settings import Settings
from farm.states import JobState
from farm.tags import tag_limits
from tests.farmprocs import blocked_on_a_queue, until
from tests.web.conftest import SHA, scene_report


@pytest.fixture
def farm(redis_url: str) -> Iterator[tuple[JobStore, RenderQueue]]:
    store = JobStore(redis.Redis.from_url(redis_url, decode_responses=True))
    queue = RenderQueue(redis.Redis.from_url(redis_url), "cpu")
    yield store, queue
    store.conn.close()
    queue.conn.close()


def _job(farm: tuple[JobStore, RenderQueue], project: str = "A", **options: Any) -> str:
    """A job of frames 1-2 (or ``frames``), accepted as every client's is (the report in place
    of an inspection)."""
    store, queue = farm
    source = BlendSource("upload", f"uploads/{SHA}/upload.blend", SHA, "b.blend")
    values = {"frames": "1-2", "tiles": "1x1", "project": project, **options}
    req = submission.request_from(values, "/tmp/out", Settings())
    return accept(Settings(), store, queue, req, source, report=scene_report()).job_id


def _picks(queue: RenderQueue, picker: Picker, most: int = 50) -> list[str]:
    """The rq ids a worker with ``picker`` takes, one after another, until it finds none."""
    cls: type[_BandedQueue] = type("_Q", (_BandedQueue,), {"picker": picker})
    out = []
    for _ in range(most):
        got = cls.dequeue_any([cls(queue.queue.name, connection=queue.conn)], None, queue.conn)
        if got is None:
            break
        out.append(str(got[0].id))
    return out


# --- bounds ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"tags": "GPU"}, "tag 'GPU' must be 1 to 32 lower-case"),
        ({"tags": "a+b"}, "tag 'a+b' must be"),
        ({"tags": ",".join(f"t{i}" for i in range(9))}, "at most 8 tags, not 9"),
        ({"tags": ["ok", 5]}, "tag '5'"),  # a list is joined; 5 is a fine name, so next case
        ({"depends_on": "42"}, "'42' is not a job id"),
        ({"depends_on": [f"20261201-000000-{i:08x}" for i in range(17)]}, "at most 16 jobs"),
        ({"frame_order": "random"}, "frame order 'random' is not one of sequential, first-"),
    ],
)
def test_bad_tags_dependencies_and_frame_orders_are_refused_by_name(
    options: dict[str, Any], says: str
) -> None:
    req = submission.request_from(options, "/tmp/out", Settings())
    if options.get("tags") == ["ok", 5]:
        assert req.tags == "ok,5"
        submission.check_request(req)  # digits are a tag
        return
    with pytest.raises(BadParameter) as err:
        submission.check_request(req)
    assert says in err.value.message


def test_a_dependency_that_is_no_job_of_the_project_is_refused_and_nothing_is_queued(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, queue = farm
    other = _job(farm, project="B")
    unknown = "20261201-000000-00000000"
    for dep in (unknown, other):
        with pytest.raises(BadParameter, match=f"depends_on: there is no job {dep} in project A"):
            _job(farm, depends_on=dep)
    assert [j for j, _ in store.project_job_ids("A")] == []
    assert queue.depth() == 2  # the other project's two tiles only


def test_tag_limits_setting_is_checked() -> None:
    assert tag_limits('{"lic": 2}') == {"lic": 2}
    for text, says in [('{"lic": 0}', "1 to"), ('{"Lic": 1}', "tag 'Lic'"), ("[1]", "object")]:
        with pytest.raises(BadParameter, match=says):
            Settings.from_env({"FARM_TAG_LIMITS": text})
    with pytest.raises(BadParameter, match="FARM_WORKER_TAGS"):
        Settings.from_env({"FARM_WORKER_TAGS": "big ram"})


def test_first_last_middle_then_the_rest_in_order() -> None:
    assert ordered_frames([1, 2, 3, 4, 5, 6], "first-last-middle") == [1, 6, 4, 2, 3, 5]
    assert ordered_frames([1, 2], "first-last-middle") == [1, 2]
    assert ordered_frames([3, 1, 2], "sequential") == [3, 1, 2]


# --- the pick ----------------------------------------------------------------------------------


def test_tagged_tiles_go_only_to_workers_with_every_tag_in_frame_order(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    _, queue = farm
    tagged = _job(farm, frames="1-5", tags="big,gpu-a", frame_order="first-last-middle")
    plain = _job(farm)
    # a worker with one of the two tags, and one with none, take the untagged job only
    assert _picks(queue, Picker("w-big", frozenset({"big"}))) == [
        f"tile-{plain}-1-0-1",
        f"tile-{plain}-2-0-1",
    ]
    assert _picks(queue, Picker("w-none")) == []
    got = _picks(queue, Picker("w-both", frozenset({"big", "gpu-a", "x"})))
    assert got == [f"tile-{tagged}-{f}-0-1" for f in (1, 5, 3, 2, 4)]


def test_a_tag_limit_holds_k_slots_until_released_or_expired(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, queue = farm
    _job(farm, frames="1-4", tags="lic")
    picker = Picker("w1", frozenset({"lic"}), {"lic": 2}, slot_lease_s=60)
    first = _picks(queue, picker)
    assert len(first) == 2  # the limit: two tiles of the tag at once, farm-wide
    assert _picks(queue, Picker("w2", frozenset({"lic"}), {"lic": 2})) == []
    assert tagslots.running(store.conn, "lic") == 2
    tagslots.release(store.conn, ["lic"], first[0])
    assert len(_picks(queue, picker)) == 1
    # a slot whose holder died frees itself when its lease would have expired
    store.conn.zadd(keys.tag_slots("lic"), {first[1]: 1.0})
    assert len(_picks(queue, picker)) == 1


def test_a_blocklisted_worker_passes_over_the_jobs_tiles_and_others_take_them(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, queue = farm
    bad = _job(farm, frames="1-3")
    good = _job(farm)
    assert not blocklist.record_failure(store.conn, bad, "w1", threshold=2)
    assert blocklist.record_failure(store.conn, bad, "w1", threshold=2)
    assert not blocklist.record_failure(store.conn, bad, "w1", threshold=2)  # once
    assert _picks(queue, Picker("w1")) == [f"tile-{good}-1-0-1", f"tile-{good}-2-0-1"]
    # nothing was taken from the blocklisted job, no attempt counted
    assert queue.waiting_ids() == [f"tile-{bad}-{f}-0-1" for f in (1, 2, 3)]
    assert [(e.worker, e.failures, e.blocklisted) for e in blocklist.entries(store.conn, bad)] == [
        ("w1", 3, True)
    ]
    events = [e.message for e in store.events(bad) if e.type == "warning"]
    assert events == ["worker w1 is blocklisted for this job after 2 failed tiles; other "
                      "workers render its tiles"]  # fmt: skip
    assert blocklist.none_left(store.conn, bad, (), ["w1"])
    blocklist.announce(store.conn, "w2", frozenset(), 30)
    assert not blocklist.none_left(store.conn, bad, (), ["w1", "w2"])
    assert blocklist.none_left(store.conn, bad, ("big",), ["w1", "w2"])  # w2 lacks the tag
    assert blocklist.clear(store.conn, bad, "alice") == 1
    assert blocklist.entries(store.conn, bad) == []
    assert len(_picks(queue, Picker("w1"))) == 3


def test_a_blocklisted_worker_with_only_the_jobs_tiles_waiting_neither_takes_nor_spins(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, queue = farm
    bad = _job(farm, frames="1-3")
    blocklist.record_failure(store.conn, bad, "w1", threshold=1)
    cls: type[_BandedQueue] = type("_Q", (_BandedQueue,), {"picker": Picker("w1")})
    store.conn.config_resetstat()
    with pytest.raises(DequeueTimeout):
        cls.dequeue_any([cls(queue.queue.name, connection=queue.conn)], 2, queue.conn)
    assert len(queue.waiting_ids()) == 3
    # it looked about once a second (BLOCKED_RETRY_S), not in a loop
    picks = store.conn.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert 1 <= picks <= 4, picks


def test_a_blocklisted_worker_waiting_on_an_empty_queue_puts_back_the_jobs_tile_it_got(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    """An idle worker blocks on its queue (BLMOVE cannot skip a job): a tile of a job it is
    blocklisted for that arrives then goes back to the front, and the worker takes the next
    job's tile instead."""
    store, queue = farm
    bad = _job(farm, frames="1")
    blocklist.record_failure(store.conn, bad, "w1", threshold=1)
    (bad_tile,) = queue.waiting_ids()
    queue.conn.lrem(queue.queue.key, 1, bad_tile)  # the queue is empty: the worker blocks
    cls: type[_BandedQueue] = type("_Q", (_BandedQueue,), {"picker": Picker("w1")})

    def picks() -> int:
        stats = store.conn.info("commandstats").get("cmdstat_evalsha", {})
        return int(stats.get("calls", 0))

    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(
            cls.dequeue_any, [cls(queue.queue.name, connection=queue.conn)], 10, queue.conn
        )
        until(lambda: blocked_on_a_queue(store.conn), 5, "the worker blocking on its queue")
        before = picks()
        queue.conn.lpush(queue.queue.key, bad_tile)  # e.g. requeued by the sweep
        # the blocking take got it and put it back, and the worker picks again
        until(lambda: picks() > before, 5, "the worker's pick after its blocking take")
        good = _job(farm)
        got = taking.result(15)
    assert got is not None and str(got[0].id) == f"tile-{good}-1-0-1"
    assert queue.waiting_ids()[0] == bad_tile, "the blocklisted job's tile left the front"
    intermediate = queue.conn.lrange(queue.queue.key + ":intermediate", 0, -1)
    assert bad_tile.encode() not in intermediate


# --- dependencies -------------------------------------------------------------------------------


def test_a_dependent_waits_unqueued_and_fails_with_its_dependency_down_the_chain(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, queue = farm
    first = _job(farm)
    second = _job(farm, depends_on=first)
    third = _job(farm, depends_on=[second, first])
    assert store.state(second) == store.state(third) == JobState.WAITING
    assert queue.depth() == 2  # the first job's tiles only
    store.end_job(first, JobState.CANCELED, "canceled by alice")
    assert (store.status(second).state, store.status(second).reason) == (
        "failed",
        f"dependency {first} canceled",
    )
    # the third fails with whichever of its dependencies ended first
    assert store.status(third).state == "failed"
    assert store.status(third).reason in (f"dependency {second} failed",
                                          f"dependency {first} canceled")  # fmt: skip
    assert set(store.tile_states(third).values()) == {"canceled"}
    # a job submitted on a failed dependency fails at once
    late = _job(farm, depends_on=second)
    assert store.status(late).reason == f"dependency {second} failed"


def test_a_lost_release_is_healed_by_the_sweeps_recheck_and_tiles_go_out_in_order(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, queue = farm
    first = _job(farm)
    second = _job(farm, frames="1-5", depends_on=first, frame_order="first-last-middle")
    # the first job ends done by a write that skipped the job scripts (a lost transition)
    store.conn.hset(keys.job(first), "state", "done")
    assert store.state(second) == JobState.WAITING
    assert dependencies.recheck(store) == 1
    assert store.state(second) == JobState.QUEUED
    assert dependencies.push_released(store, queue.conn) == [second]
    waiting = [i for i in queue.waiting_ids() if second in i]
    assert waiting == [f"tile-{second}-{f}-0-1" for f in (1, 5, 3, 2, 4)]
    assert store.conn.zcard(keys.WAITING) == 0


def test_a_trimmed_job_leaves_no_blocklist_or_dependents_behind(
    farm: tuple[JobStore, RenderQueue],
) -> None:
    store, _ = farm
    job = _job(farm)
    _job(farm, depends_on=job)
    for _ in range(3):
        blocklist.record_failure(store.conn, job, "w9", threshold=3)
    assert store.conn.sismember(keys.worker_blocked("w9"), job)
    assert store.conn.ttl(keys.worker_blocked("w9")) >= blocklist.MIN_KEEP_S - 5
    store.end_job(job, JobState.CANCELED)
    store.job_retention_s = 0
    store.trim()
    assert not store.conn.exists(keys.blocklist(job), keys.dependents(job))
    assert not store.conn.sismember(keys.worker_blocked("w9"), job)
