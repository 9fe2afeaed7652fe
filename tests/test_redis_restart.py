"""A Redis restart in the middle of a job (AOF on): the job completes, every process reconnects."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from farm import jobstore
from farm.redisserver import RedisServer
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, wait_for


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", unix_socket=False, appendonly=True)
    server.start()
    yield server
    server.stop()


def test_redis_restarts_mid_job_and_the_job_completes_with_every_frame(
    aof_redis: RedisServer, tmp_path: Path
) -> None:
    # about half a second a tile, so the restart lands with most of the job still to do
    scene = make_scene(tmp_path / "anim.blend", frame_end=3, samples=150)
    w = WorkerProcess(aof_redis.url, tmp_path, "w1")
    try:
        store, job_id = submit(w.settings, scene, tmp_path, tiles="2x2")
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "done")
        assert store.status(job_id).tiles_done < 6, "the restart must come mid-job"
        aof_redis.restart()
        # the job, its tiles and the queue came back from the AOF; the worker carries on
        done = jobstore.JobStore(jobstore.connect(aof_redis.url))
        wait_for(done, job_id, lambda e: e.type == "job_state" and e.state == "done", 180)
        status = done.status(job_id)
        assert status.frames_done == 3 and status.tiles_done == 12
        for frame in (1, 2, 3):
            assert (tmp_path / "o" / f"frame_{frame:04d}.exr").stat().st_size > 0
        assert w.proc.poll() is None, "the worker died with the Redis restart"
    finally:
        w.stop()
