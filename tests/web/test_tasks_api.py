"""A finished job's task table, ETA figures, thumbnails and exposure view through the API, with
a real worker rendering a real scene (one job for the module)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from PIL import Image, ImageStat

from farm import jobstore
from farm.redisserver import RedisServer
from farm.settings import Settings
from farm.states import JobState
from farm.taskrecords import Attempt, TaskRow
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, until
from tests.web.conftest import Tokens, api, bearer, make_tokens, make_web_settings, wait_for_worker
from web.tasks import select, task_json

#: 2 frames x 2 tiles of 144x64 at 2 samples: seconds on a loaded machine
RENDER_TIMEOUT_S = 120


@dataclass
class Rendered:
    settings: Settings
    tokens: Tokens
    job_id: str
    worker: str


@pytest.fixture(scope="module")
def rendered(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rendered]:
    tmp = tmp_path_factory.mktemp("tasks-api")
    conn = jobstore.connect(redis_server.url)
    conn.flushall()
    settings = make_web_settings(redis_server.url, tmp)
    tokens = make_tokens(redis_server.url)
    blend = make_scene(tmp / "wide.blend", width=288, height=64, samples=2, frame_end=2)
    worker = WorkerProcess(redis_server.url, tmp, name="tasks-w1")
    try:
        wait_for_worker(redis_server.url)
        job_id = asyncio.run(_submit(settings, tokens, blend.read_bytes()))
        store = jobstore.JobStore(conn)
        until(lambda: store.state(job_id) in (JobState.DONE, JobState.FAILED),
              RENDER_TIMEOUT_S, "the job to end")  # fmt: skip
        assert store.state(job_id) == JobState.DONE, worker.log_text()
        yield Rendered(settings, tokens, job_id, worker.name)
    finally:
        worker.stop()
        conn.flushall()
        conn.close()


async def _submit(settings: Settings, tokens: Tokens, blend: bytes) -> str:
    alice = bearer(tokens.alice)
    async with api(settings) as client:
        up = await client.put("/api/uploads/wide.blend?project=A", data=blend, headers=alice)
        assert up.status in (200, 201), await up.text()
        body = {"project": "A", "upload_id": (await up.json())["upload_id"], "tiles": "2x1",
                "formats": ["exr", "png"], "name": "wide"}  # fmt: skip
        made = await client.post("/api/jobs", json=body, headers=alice)
        assert made.status == 201, await made.text()
        return str((await made.json())["job_id"])


async def _tasks(settings: Settings, token: str, job_id: str, query: str = "") -> Any:
    async with api(settings) as client:
        resp = await client.get(f"/api/jobs/{job_id}/tasks{query}", headers=bearer(token))
        return resp.status, await resp.json()


async def test_every_task_of_a_finished_job_has_its_worker_times_and_blenders_figures(
    rendered: Rendered,
) -> None:
    status, data = await _tasks(rendered.settings, rendered.tokens.alice, rendered.job_id)
    assert status == 200, data
    assert data["total"] == 4 and [(t["frame"], t["tile"]) for t in data["tasks"]] == [
        (1, 0), (1, 1), (2, 0), (2, 1)
    ]  # fmt: skip
    for t in data["tasks"]:
        assert (t["state"], t["attempt"], t["worker"], t["cause"], t["cause_log"]) == (
            "done",
            1,
            rendered.worker,
            "",
            None,
        ), t
        assert t["device"] == "the CPU"
        assert t["started_s"] < t["ended_s"] and t["duration_s"] >= t["render_s"] > 0, t
        # Blender's own figure, from the render's stamp: a Cycles render of any scene uses MiBs
        assert t["peak_memory_mib"] > 0, t
        assert [a["outcome"] for a in t["attempts"]] == ["done"]
    # each task's own log: its figures and what Blender said while it rendered
    first = data["tasks"][0]
    assert first["log"] == f"/api/jobs/{rendered.job_id}/tiles/1/0/attempts/1/log"
    async with api(rendered.settings) as client:
        text = await (await client.get(first["log"], headers=bearer(rendered.tokens.alice))).text()
        other = await client.get(first["log"], headers=bearer(rendered.tokens.bob))
    assert "outcome: done" in text and f"render_s: {first['render_s']}" in text, text
    assert "Blender's log (this attempt):" in text and "event=render frame=1 " in text, text
    assert other.status == 404
    assert data["failures"] == [] and data["trimmed"] is False
    progress = data["progress"]
    assert (progress["tasks_total"], progress["tasks_done"], progress["eta_s"]) == (4, 4, None)
    assert progress["median_task_s"] > 0
    assert [f["frame"] for f in progress["frames"]] == [1, 2]
    assert all(f["render_s"] > 0 and f["wall_s"] > 0 for f in progress["frames"])


async def test_tasks_sort_filter_and_page(rendered: Rendered) -> None:
    s, alice, job = rendered.settings, rendered.tokens.alice, rendered.job_id
    _, by_render = await _tasks(s, alice, job, "?sort=-render")
    times = [t["render_s"] for t in by_render["tasks"]]
    assert times == sorted(times, reverse=True)
    _, failed = await _tasks(s, alice, job, "?state=failed")
    assert (failed["total"], failed["tasks"]) == (0, [])
    _, second = await _tasks(s, alice, job, "?frames=2&sort=-tile&limit=1&offset=1")
    assert second["total"] == 2 and [(t["frame"], t["tile"]) for t in second["tasks"]] == [(2, 0)]
    for bad in ("?sort=colour", "?state=lost", "?frames=x", "?limit=0", "?offset=-1"):
        status, body = await _tasks(s, alice, job, bad)
        assert status == 400 and body["error"]["code"] == "bad_parameter", (bad, body)


async def test_another_projects_member_gets_404(rendered: Rendered) -> None:
    job = rendered.job_id
    async with api(rendered.settings) as client:
        for path in (f"/api/jobs/{job}/tasks", f"/api/jobs/{job}/frames/1/thumbnail",
                     f"/api/jobs/{job}/frames/1/view?exposure=1"):  # fmt: skip
            resp = await client.get(path, headers=bearer(rendered.tokens.bob))
            assert resp.status == 404, path
            assert (await resp.json())["error"]["code"] == "not_found"


async def test_the_thumbnail_is_scaled_and_cached(rendered: Rendered) -> None:
    url = f"/api/jobs/{rendered.job_id}/frames/1/thumbnail"
    alice = bearer(rendered.tokens.alice)
    cache = rendered.settings.work_dir / "web-thumbnails"
    async with api(rendered.settings) as client:
        first = await client.get(url, headers=alice)
        data = await first.read()
        assert first.status == 200 and first.content_type == "image/jpeg"
        width, height = Image.open(io.BytesIO(data)).size  # 288x64 scaled, ratio kept
        assert width == 256 and abs(height - 64 * 256 / 288) <= 1
        assert "max-age" in first.headers["Cache-Control"]
        etag = first.headers["ETag"]
        again = await client.get(url, headers={**alice, "If-None-Match": etag})
        assert again.status == 304
        # the second answer comes from the cache: a changed cache file is what is served
        (cached,) = cache.iterdir()
        cached.write_bytes(data + b"cached")
        assert await (await client.get(url, headers=alice)).read() == data + b"cached"


async def test_the_exposure_view_is_the_full_frame_brighter_with_more_stops(
    rendered: Rendered,
) -> None:
    base = f"/api/jobs/{rendered.job_id}/frames/2/view"
    alice = bearer(rendered.tokens.alice)
    means = []
    async with api(rendered.settings) as client:
        for stops in (-2, 0, 2):
            resp = await client.get(f"{base}?exposure={stops}", headers=alice)
            assert resp.status == 200 and resp.content_type == "image/png"
            image = Image.open(io.BytesIO(await resp.read()))
            assert image.size == (288, 64)
            means.append(sum(ImageStat.Stat(image).mean))
        for bad in ("99", "nan", "x"):
            resp = await client.get(f"{base}?exposure={bad}", headers=alice)
            assert resp.status == 400, bad
    assert means[0] < means[1] < means[2], means


def test_attempts_that_never_reported_their_end_read_lost_or_canceled() -> None:
    done = Attempt(2, "w2", "", 5.0, 7.0, outcome="done")
    lost = TaskRow(1, 0, "done", 2, [Attempt(1, "w1", "", 0.0), done])
    canceled = TaskRow(1, 1, "canceled", 1, [Attempt(1, "w1", "", 0.0)])
    rendering = TaskRow(2, 0, "rendering", 1, [Attempt(1, "w2", "", 6.0)])
    outcomes = [[a["outcome"] for a in task_json("j", r)["attempts"]]
                for r in (lost, canceled, rendering)]  # fmt: skip
    assert outcomes == [["lost", "done"], ["canceled"], ["rendering"]]
    # sorting by a figure some tasks lack puts those last, either way round
    for sort in ("ended", "-ended"):
        assert [(r.frame, r.index) for r in select([canceled, lost, rendering], {"sort": sort})][
            -2:
        ] == [(1, 1), (2, 0)]
