"""Scheduling with real workers rendering tiny bpy scenes: tags route tiles, a tag's limit holds
farm-wide, a dependent job starts once its dependency is done, frames go first-last-middle, and a
worker whose Blender crashes on a job is blocklisted for it while the job finishes on another."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis

from farm import blocklist, jobstore, queue, submission
from farm.accept import accept
from farm.models import BlendSource, Event
from farm.redisserver import RedisServer
from farm.settings import Settings
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, until, wait_for
from tests.web.conftest import scene_report

TIMEOUT_S = 120.0
#: one tile of a limited tag at a time, farm-wide (both workers have the tag)
LIMITS = '{"lic": 1}'


@dataclass
class Farm:
    settings: Settings
    store: jobstore.JobStore
    rq_conn: Any
    source: BlendSource
    tmp: Path
    workers: dict[str, WorkerProcess]

    def submit(self, **options: Any) -> str:
        """A job of the 32x24 scene (frames 1-5 in the report) accepted as the web accepts one."""
        values = {"frames": "1", "tiles": "1x1", "formats": "exr", **options}
        req = submission.request_from(values, str(self.tmp / "out"), self.settings)
        report = replace(scene_report(32, 24), frame_end=5)
        q = queue.RenderQueue(self.rq_conn, "cpu")
        return accept(self.settings, self.store, q, req, self.source, report).job_id

    def done(self, job_id: str) -> list[Event]:
        """Wait for the job to be done; its events."""
        ended = wait_for(self.store, job_id, _ended, TIMEOUT_S)
        assert ended.state == "done", (ended, self.store.status(job_id).reason)
        return self.store.events(job_id)


def _ended(e: Event) -> bool:
    return e.type == "job_state" and e.state in ("done", "failed", "canceled")


def _ready(w: WorkerProcess) -> bool:
    return "event=worker_ready" in w.log_text()


def _tiles_done_by(w: WorkerProcess, job_id: str) -> int:
    return w.log_text().count(f"event=tile_done job={job_id} ")


@pytest.fixture(scope="module")
def farm(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    url = redis_server.url
    raw = redis.Redis.from_url(url)
    raw.flushall()
    tmp = tmp_path_factory.mktemp("sched")
    env = {"FARM_CPU_THREADS": "1", "FARM_TAG_LIMITS": LIMITS}
    workers = {
        "lic": WorkerProcess(url, tmp, "w-lic", FARM_WORKER_TAGS="lic", **env),
        "big": WorkerProcess(url, tmp, "w-big", FARM_WORKER_TAGS="big,lic", **env),
    }
    settings = workers["lic"].settings
    scene = make_scene(tmp / "scene" / "scene.blend", width=32, height=24, samples=2,
                       frame_end=5)  # fmt: skip
    source = LocalStorage(settings.storage_dir).put_upload(scene)
    store = jobstore.JobStore(jobstore.connect(url), settings.lease_ttl_s)
    rq_conn = queue.connect(url)
    try:
        for w in workers.values():
            until(partial(_ready, w), TIMEOUT_S, f"{w.name} ready")
        yield Farm(settings, store, rq_conn, source, tmp, workers)
    finally:
        for w in workers.values():
            w.stop()
        store.conn.close()
        rq_conn.close()
        raw.flushall()
        raw.close()


def test_a_tagged_job_renders_only_on_workers_with_its_tags_first_last_middle_first(
    farm: Farm,
) -> None:
    tagged = farm.submit(frames="1-5", tags="big", frame_order="first-last-middle")
    plain = farm.submit(frames="1-2", tiles="2x1")
    events = farm.done(tagged)
    farm.done(plain)
    assert _tiles_done_by(farm.workers["big"], tagged) == 5
    assert _tiles_done_by(farm.workers["lic"], tagged) == 0
    # one worker may take them, so they start in the order they were queued
    started = [e.frame for e in events if e.type == "tile_state" and e.state == "rendering"]
    assert started == [1, 5, 3, 2, 4]
    # the untagged job went to any worker
    assert sum(_tiles_done_by(w, plain) for w in farm.workers.values()) == 4


def test_a_tags_limit_holds_farm_wide(farm: Farm) -> None:
    job_id = farm.submit(frames="1-3", tiles="2x1", tags="lic")
    events = farm.done(job_id)
    running, most = set(), 0
    for e in events:
        if e.type != "tile_state":
            continue
        if e.state == "rendering":
            running.add((e.frame, e.tile))
        else:
            running.discard((e.frame, e.tile))
        most = max(most, len(running))
    assert most == 1, [(e.state, e.frame, e.tile) for e in events if e.type == "tile_state"]


def test_a_dependent_job_starts_only_once_its_dependency_is_done(farm: Farm) -> None:
    first = farm.submit(frames="1-2", tiles="2x1")
    second = farm.submit(depends_on=first, frames="1-2")
    assert farm.store.state(second) in ("waiting", "queued")  # queued only if first was quick
    first_done = next(e for e in farm.done(first) if _ended(e))
    events = farm.done(second)
    states = [e.state for e in events if e.type == "job_state"]
    assert states[:2] == ["waiting", "queued"], states
    # in Redis's own order: an event's stream id is the server's clock as it was written (its
    # ``ts`` is the writer's estimate of that clock, a few ms apart between two processes, and
    # a worker may start the dependent's tile within a millisecond of the dependency's end)
    starts = [_redis_ms(e) for e in events if e.type == "tile_state" and e.state == "rendering"]
    assert min(starts) >= _redis_ms(first_done)


def _redis_ms(event: Event) -> int:
    """When Redis wrote ``event`` (ms): its stream id's time part."""
    return int(event.id.split("-")[0])


def _python_crashing_on_render(folder: Path) -> Path:
    """A Blender python whose child starts and inspects as usual but aborts (SIGABRT, as some
    real files make Blender do) whenever it is asked to render. The sandbox binds its folder."""
    (folder / "bin").mkdir(parents=True, mode=0o755)
    folder.chmod(0o755)
    python = folder / "bin" / "python"
    code = ("import os, sys\nimport workers.blender.render as r\n"
            "r.render = lambda *a, **k: os.abort()\n"
            "from workers.blender.__main__ import main\nsys.exit(main(sys.argv[1:]))")  # fmt: skip
    # the worker runs `python -m workers.blender ARGS`: drop `-m workers.blender`
    python.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" -c \'{code}\' "$@"\n')
    python.chmod(0o755)
    return python


def test_a_worker_that_crashes_on_a_job_is_blocklisted_and_the_job_finishes_on_another(
    farm: Farm,
) -> None:
    url = farm.settings.redis_url
    python = _python_crashing_on_render(farm.tmp / "py")
    crashy = WorkerProcess(url, farm.tmp, "w-crashy", FARM_WORKER_TAGS="solo",
                           FARM_BLOCKLIST_FAILURES="2", FARM_CPU_THREADS="1",
                           FARM_BLENDER_PYTHON=str(python))  # fmt: skip
    good: WorkerProcess | None = None
    try:
        # only workers tagged solo may render it: at first the crashing one alone
        job_id = farm.submit(frames="1", tiles="2x2", tags="solo", max_attempts=5)
        waits: Callable[[Event], bool] = lambda e: e.type == "warning" and "waits" in e.message  # noqa: E731
        wait_for(farm.store, job_id, waits, TIMEOUT_S)
        status = farm.store.status(job_id)
        assert status.state in ("queued", "running"), status.reason  # waiting, not failed
        assert status.tile_failures == 2
        entries = blocklist.entries(farm.store.conn, job_id)
        assert [(e.worker, e.failures, e.blocklisted) for e in entries] == [("w-crashy", 2, True)]
        good = WorkerProcess(url, farm.tmp, "w-solo", FARM_WORKER_TAGS="solo",
                             FARM_CPU_THREADS="1")  # fmt: skip
        farm.done(job_id)
        assert _tiles_done_by(good, job_id) == 4
        assert _tiles_done_by(crashy, job_id) == 0
        assert farm.store.status(job_id).tile_failures == 2  # no attempt counted once blocked
        assert blocklist.clear(farm.store.conn, job_id, "alice") == 1
        assert blocklist.entries(farm.store.conn, job_id) == []
    finally:
        crashy.stop()
        if good is not None:
            good.stop()
