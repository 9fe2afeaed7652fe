"""What Redis keeps of a job: once FARM_JOB_RETENTION_S has passed since it ended, the sweep
leaves only its summary and its place in the job indexes; active jobs are never touched."""

from __future__ import annotations

import json
import time

import pytest
import redis

from farm import cli, keys
from farm.jobstore import JobStore
from farm.models import BlendSource, JobSpec, TileTask
from farm.states import JobState

RETENTION_S = 3600.0


class Clock:
    """The job store's clock (epoch s), moved by the test."""

    def __init__(self) -> None:
        self.s = time.time()

    def __call__(self) -> float:
        return self.s


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(redis_url: str, clock: Clock) -> JobStore:
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    return JobStore(conn, clock=clock, job_retention_s=RETENTION_S)


def _spec(frames: int = 2, project: str = "film") -> JobSpec:
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    return JobSpec(source, tuple(range(1, frames + 1)), "2x1", 64, 32, "/tmp/out",
                   max_attempts=1, project=project, name="shot")  # fmt: skip


def _create(store: JobStore, spec: JobSpec) -> str:
    """A job with its records, its index entries and no queue (so no rq keys to tell apart)."""
    job_id = store.new_job_id()
    pipe = store.conn.pipeline(transaction=True)
    store.stage_job(pipe, job_id, spec, [], scripts_blocked=False)
    pipe.execute()
    return job_id


def _run_to_done(store: JobStore, job_id: str) -> None:
    spec = store.spec(job_id)
    for frame in spec.frames:
        for index in (0, 1):
            task = TileTask(job_id, frame, index, 1)
            assert store.start_tile(task) == "ok"
            store.finish_tile(task, tiles_per_frame=2)
        assert store.claim_frame(job_id, frame)
        # the delivery's record of the frame's files (farm.delivery writes the same hash)
        files = [{"name": f"frame_{frame:04d}.png", "size": 10, "sha256": "0" * 64}]
        store.conn.hset(keys.delivered(job_id), str(frame), json.dumps(files))
        assert store.finish_frame(job_id, frame) == "ok"
    assert store.state(job_id) == JobState.DONE


def _fail(store: JobStore, job_id: str) -> None:
    task = TileTask(job_id, 1, 0, 1)
    assert store.start_tile(task) == "ok"
    assert store.fail_tile(task, "Blender exited with SIGSEGV", 1)[0] == "failed"


def _keys_of(conn: redis.Redis, job_id: str) -> set[str]:
    """Every farm key whose name holds the job's id."""
    return {str(k) for k in conn.scan_iter(match=f"{keys.PREFIX}:*{job_id}*", count=1000)}


def _members_of(conn: redis.Redis, job_id: str) -> set[str]:
    """The farm's sorted sets (indexes) that list the job."""
    out = set()
    for key in conn.scan_iter(match=f"{keys.PREFIX}:*", _type="zset", count=1000):
        if conn.zscore(key, job_id) is not None:
            out.add(str(key))
    return out


def test_ended_jobs_are_trimmed_to_their_summary_after_the_retention_and_active_ones_never(
    store: JobStore,
    clock: Clock,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    done, failed, active = (_create(store, _spec()) for _ in range(3))
    _run_to_done(store, done)
    _fail(store, failed)
    conn = store.conn
    # assembling: each done frame's last assembly attempt (a requeue goes above it)
    every = {
        keys.job(done), keys.tiles(done), keys.frame_counts(done), keys.events(done),
        keys.delivered(done), keys.assembling(done),
    }  # fmt: skip
    assert _keys_of(conn, done) == every
    active_before = {k: conn.dump(k) for k in _keys_of(conn, active)}

    # within the retention: nothing is trimmed
    clock.s += RETENTION_S - 1
    assert store.sweep("w1", 15.0).trimmed_jobs == 0
    assert _keys_of(conn, done) == every

    clock.s += 2
    sweep = store.sweep("w1", 15.0)
    assert sweep.leader and sweep.trimmed_jobs == 2
    for job_id in (done, failed):
        assert _keys_of(conn, job_id) == {keys.job(job_id)}, "only the summary is left"
        assert _members_of(conn, job_id) == {keys.JOBS, keys.project_jobs("film")}
        assert store.events(job_id) == [] and store.tile_states(job_id) == {}
    assert {k: conn.dump(k) for k in _keys_of(conn, active)} == active_before, "untouched"
    assert store.state(active) == JobState.QUEUED
    assert store.sweep("w1", 15.0).trimmed_jobs == 0, "a trimmed job is not trimmed again"

    # the summary answers `farm status` and the web's list as before
    status = store.status(done)
    assert (status.state, status.frames_done, status.tiles_done) == ("done", 2, 4)
    assert status.spec.output == "/tmp/out" and status.finished_s is not None
    assert "SIGSEGV" in store.status(failed).reason
    assert {j for j, _ in store.project_job_ids("film")} == {active, failed, done}
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    assert cli.main(["status", done, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["state"], shown["frames_done"]) == ("done", 2)


def test_a_retried_job_is_not_trimmed_while_it_runs_again(store: JobStore, clock: Clock) -> None:
    job_id = _create(store, _spec())
    _fail(store, job_id)
    outcome, _tasks = store.retry_failed(job_id)
    assert outcome == "ok"
    clock.s += RETENTION_S * 2
    assert store.sweep("w1", 15.0).trimmed_jobs == 0
    assert keys.tiles(job_id) in _keys_of(store.conn, job_id)


def test_after_n_jobs_and_the_trim_redis_holds_the_baseline_plus_their_summaries(
    store: JobStore, clock: Clock, rconn: redis.Redis
) -> None:
    n = 40
    store.sweep("w1", 15.0)  # scripts loaded, the sweeper's lease taken: the baseline's own
    base_keys, base_mem = rconn.dbsize(), rconn.info("memory")["used_memory"]
    jobs = [_create(store, _spec(frames=25)) for _ in range(n)]
    for job_id in jobs:
        _run_to_done(store, job_id)
    full_keys, full_mem = rconn.dbsize(), rconn.info("memory")["used_memory"]
    clock.s += RETENTION_S + 1
    assert store.sweep("w1", 15.0).trimmed_jobs == n
    after_keys, after_mem = rconn.dbsize(), rconn.info("memory")["used_memory"]
    summaries = sum(int(rconn.memory_usage(keys.job(j)) or 0) for j in jobs)
    indexes = sum(int(rconn.memory_usage(k) or 0) for k in (keys.JOBS, keys.project_jobs("film")))
    # the project's live feed of the jobs list, capped by length (farm.jobscripts)
    feed = int(rconn.memory_usage(keys.project_events("film")) or 0)
    print(f"keys: base={base_keys} full={full_keys} trimmed={after_keys}; used_memory bytes: "
          f"base={base_mem} full={full_mem} trimmed={after_mem} summaries={summaries} "
          f"indexes={indexes} feed={feed}")  # fmt: skip
    # the n summaries, the two job indexes and the project's feed; the ended-jobs index is
    # empty, so gone
    assert after_keys == base_keys + n + 3
    assert rconn.xlen(keys.project_events("film")) < 1200
    assert after_mem - base_mem <= summaries + indexes + feed + 64 * 1024
    assert full_mem - after_mem > (full_mem - base_mem) / 2
