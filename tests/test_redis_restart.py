"""A Redis restart in the middle of a job (AOF on): the job completes, every process reconnects."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from farm import jobstore
from farm.redisserver import RedisServer
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, until, wait_for


@pytest.fixture
def aof_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", unix_socket=False, appendonly=True)
    server.start()
    yield server
    server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get(url: str, token: str) -> Any:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _answers(url: str, token: str) -> bool:
    try:
        _get(url, token)
    except OSError:
        return False
    return True


def test_redis_restarts_mid_job_and_the_job_completes_with_every_frame(
    aof_redis: RedisServer, tmp_path: Path
) -> None:
    # about half a second a tile, so the restart lands with most of the job still to do
    scene = make_scene(tmp_path / "anim.blend", frame_end=3, samples=150)
    w = WorkerProcess(aof_redis.url, tmp_path, "w1")
    port = _free_port()
    env = {**w.env, "FARM_WEB_PORT": str(port)}
    made = subprocess.run(
        [sys.executable, "-m", "farm", "token", "create", "--user", "ops", "--project",
         "default", "--json"], env=env, capture_output=True, check=True, timeout=60,
    )  # fmt: skip
    token = json.loads(made.stdout)["token"]
    web_log = (tmp_path / "web.log").open("wb")
    web = subprocess.Popen([sys.executable, "-m", "farm", "web"], env=env, stdout=web_log,
                           stderr=subprocess.STDOUT)  # fmt: skip
    api = f"http://127.0.0.1:{port}/api"
    try:
        until(lambda: _answers(f"{api}/me", token), 60, "the web answering")
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
        # the web reconnected on its own: the same token, the finished job
        assert _get(f"{api}/jobs/{job_id}", token)["state"] == "done"
        assert web.poll() is None, "the web died with the Redis restart"
    finally:
        w.stop()
        web.terminate()
        web.wait(30)
        web_log.close()
