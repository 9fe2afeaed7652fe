"""Job control on a real farm: a render worker, the web API on loopback, real renders.

Suspend lets the rendering tile finish and starts none; requeue of two frames of a done job
renders and delivers exactly those again, bit for bit; a canceled job requeued ends done;
delete needs a confirmation and removes the job's records and files; the batch endpoint
answers per job; other projects' jobs are 404; the jobs list in Chromium acts on a selection
and follows the project's live feed."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import pytest
import redis
from playwright.sync_api import Browser, expect

from farm import jobstore, keys, queue, submission
from farm.accept import accept
from farm.accounts import Accounts
from farm.models import BlendSource, Event, InspectionReport
from farm.redisserver import RedisServer
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, wait_for
from tests.web.conftest import wait_for_worker
from tests.web.test_addon_client import LiveWeb

PROJECT = "film"


@dataclass
class Farm:
    live: LiveWeb
    worker: WorkerProcess
    store: jobstore.JobStore
    source: BlendSource
    report: InspectionReport
    tmp: Path
    #: member of film, member of other, viewer of film
    ana: str
    bob: str
    vera: str
    jobs: int = 0

    def submit(self, project: str = PROJECT, **kw: Any) -> tuple[str, Path]:
        """A job of the scene (its inspection at hand: no worker needed to accept it)."""
        self.jobs += 1
        out = self.tmp / f"out{self.jobs}"
        rq = queue.connect(self.live.settings.redis_url)
        try:
            kw.setdefault("tiles", "1x1")
            req = submission.RenderRequest(output=out, formats="exr", project=project, **kw)
            q = queue.RenderQueue(rq, "cpu")
            job_id = accept(self.live.settings, self.store, q, req, self.source, self.report).job_id
        finally:
            rq.close()
        return job_id, out

    def post(self, path: str, token: str, body: Any = None) -> Reply:
        data = json.dumps(body).encode() if body is not None else b""
        return self._call(urllib.request.Request(self.live.url + path, data=data, method="POST",
                          headers={"Authorization": f"Bearer {token}",
                                   "Content-Type": "application/json"}))  # fmt: skip

    def get(self, path: str, token: str) -> Reply:
        return self._call(urllib.request.Request(self.live.url + path,
                          headers={"Authorization": f"Bearer {token}"}))  # fmt: skip

    @staticmethod
    def _call(req: urllib.request.Request) -> Reply:
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return Reply(r.status, r.read().decode())
        except urllib.error.HTTPError as e:
            return Reply(e.code, e.read().decode())


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


@pytest.fixture(scope="module")
def farm(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    tmp = tmp_path_factory.mktemp("control-farm")
    conn = redis.Redis.from_url(redis_server.url, decode_responses=True)
    conn.flushall()
    # about a second a tile at the scene's samples (the suspend test's); others ask for fewer
    blend = make_scene(tmp / "shot.blend", width=48, height=32, frame_end=4,
                       seconds_per_frame_hint=2.0)  # fmt: skip
    worker = WorkerProcess(redis_server.url, tmp)
    try:
        wait_for_worker(redis_server.url)
        settings = worker.settings
        source = LocalStorage(settings.storage_dir).put_upload(blend)
        rq = queue.connect(redis_server.url)
        report = submission.inspect(conn, queue.RenderQueue(rq, "cpu"), source, 120,
                                    project=PROJECT)  # fmt: skip
        rq.close()
        accounts = Accounts(conn)
        accounts.set_role("ana", PROJECT, "member")
        accounts.set_role("bob", "other", "member")
        accounts.set_role("vera", PROJECT, "viewer")
        tokens = [accounts.create_token(u).token for u in ("ana", "bob", "vera")]
        live = LiveWeb(settings)
        try:
            ana, bob, vera = tokens
            yield Farm(live, worker, jobstore.JobStore(conn, settings.lease_ttl_s), source,
                       report, tmp, ana, bob, vera)  # fmt: skip
        finally:
            live.close()
    finally:
        worker.stop()
        conn.flushall()
        conn.close()


def _ended(ev: Event) -> bool:
    return ev.type == "job_state" and ev.state in ("done", "failed", "canceled")


def _after(store: jobstore.JobStore, job_id: str, after: str) -> list[Event]:
    return store.events(job_id, after)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_suspend_lets_the_rendering_tile_finish_starts_none_and_resume_ends_the_job(
    farm: Farm,
) -> None:
    job_id, _out = farm.submit(tiles="2x1", frames="1")
    store = farm.store
    wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
    reply = farm.post(f"/api/jobs/{job_id}/suspend", farm.ana)
    assert reply.status_code == 200, reply.text
    assert reply.json()["state"] == "suspended"
    assert farm.post(f"/api/jobs/{job_id}/suspend", farm.vera).status_code == 403
    # the rendering tile finishes; the worker draws the other and holds it back
    first = wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "done")
    held = wait_for(store, job_id, lambda e: e.type == "tile_state" and "held" in e.message,
                    timeout_s=30)  # fmt: skip
    assert held.tile != first.tile
    rendered = [e.tile for e in store.events(job_id) if e.state == "rendering"]
    assert rendered == [first.tile], "no tile started after the suspend"
    assert store.state(job_id) == "suspended"
    assert queue.RenderQueue(queue.connect(farm.live.settings.redis_url), "cpu").depth() == 0
    reply = farm.post(f"/api/jobs/{job_id}/resume", farm.ana)
    assert (reply.status_code, reply.json()["resumed_tiles"]) == (200, 1), reply.text
    end = wait_for(store, job_id, _ended, timeout_s=120)
    assert end.state == "done", farm.worker.log_text()[-3000:]
    status = store.status(job_id)
    assert (status.tile_failures, status.tiles_done) == (0, 2)
    actions = [e.message for e in store.events(job_id) if e.type == "job_action"]
    assert actions == ["suspended by ana", "resumed by ana"]


def test_requeue_of_two_frames_of_a_done_job_renders_and_delivers_exactly_those(
    farm: Farm,
) -> None:
    store = farm.store
    job_id, out = farm.submit(frames="1-4", samples=2)
    assert wait_for(store, job_id, _ended, timeout_s=120).state == "done"
    files = {f: out / f"frame_{f:04d}.exr" for f in range(1, 5)}
    before = {f: (_sha(p), p.stat().st_mtime_ns) for f, p in files.items()}
    mark = store.events(job_id)[-1].id
    # each frame's EXR delivered (the animation's MP4 preview goes with the last)
    delivered = rf"event=file_(?:already_)?delivered job={job_id} frame=(\d+) url=\S+\.exr"
    deliveries = len(re.findall(delivered, farm.worker.log_text()))
    assert deliveries == 4

    # the MP4 preview is made again with the new frames: a stale one (the frames of an earlier
    # render) must be replaced
    mp4 = out / "preview.mp4"
    assert mp4.stat().st_size > 0
    mp4.write_bytes(b"stale")
    reply = farm.post(f"/api/jobs/{job_id}/requeue", farm.ana, {"frames": [2, 4]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert (body["state"], body["requeued_tiles"], body["redelivered_frames"]) == (
        "running", 2, [2, 4])  # fmt: skip
    assert wait_for(store, job_id, lambda e: _ended(e) and e.id > mark).state == "done"
    later = _after(store, job_id, mark)
    assert {e.frame for e in later if e.type == "tile_state"} == {2, 4}
    assert sorted(e.frame or 0 for e in later if e.type == "frame_done") == [2, 4]
    assert {e.attempt for e in later if e.type == "tile_state"} == {2}
    log = farm.worker.log_text()
    again = re.findall(delivered, log)
    assert sorted(int(f) for f in again[deliveries:]) == [2, 4], "delivered again: those two"
    for f, path in files.items():
        assert _sha(path) == before[f][0], f"frame {f} is bit-exact"
        if f in (1, 3):
            assert path.stat().st_mtime_ns == before[f][1], f"frame {f} untouched"
    status = store.status(job_id)
    assert (status.frames_done, status.tiles_done) == (4, 4)
    with av.open(str(mp4)) as video:
        shapes = [(f.width, f.height) for f in video.decode(video=0)]
    assert shapes == [(48, 32)] * 4, "the preview is rebuilt with every frame"
    manifest = json.loads((out / "manifest.json").read_text())
    listed = [f for e in manifest["frames"] for f in e["files"] if f["name"] == "preview.mp4"]
    assert [f["sha256"] for f in listed] == [_sha(mp4)], "listed once, as it is now"

    # delete: only with a confirmation; then its records and files are gone
    reply = farm.post(f"/api/jobs/{job_id}/delete", farm.ana, {})
    assert reply.status_code == 400 and "confirm" in reply.json()["error"]["message"]
    assert farm.post(f"/api/jobs/{job_id}/delete", farm.bob, {"confirm": True}).status_code == 404
    reply = farm.post(f"/api/jobs/{job_id}/delete", farm.ana, {"confirm": True})
    assert reply.status_code == 200, reply.text
    assert not list(store.conn.scan_iter(match=f"{keys.PREFIX}:*{job_id}*"))
    assert store.conn.zscore(keys.project_jobs(PROJECT), job_id) is None
    assert not list(out.iterdir()), "its frames, preview and manifest are deleted"
    assert not (farm.live.settings.storage_dir / "jobs" / job_id).exists()
    assert farm.get(f"/api/jobs/{job_id}", farm.ana).status_code == 404


def test_a_canceled_job_requeued_renders_its_unfinished_tiles_and_ends_done(farm: Farm) -> None:
    store = farm.store
    os.kill(farm.worker.proc.pid, signal.SIGSTOP)  # nothing starts before the cancel
    try:
        job_id, _out = farm.submit(frames="1", samples=2)
        assert farm.post(f"/api/jobs/{job_id}/cancel", farm.ana).status_code == 200
    finally:
        os.kill(farm.worker.proc.pid, signal.SIGCONT)
    reply = farm.post(f"/api/jobs/{job_id}/requeue", farm.ana, {})
    assert reply.status_code == 200, reply.text
    assert (reply.json()["state"], reply.json()["requeued_tiles"]) == ("running", 1)
    assert wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done").state


def test_batch_answers_per_job_and_other_projects_jobs_are_404(farm: Farm) -> None:
    theirs, _ = farm.submit(project="other", frames="1", samples=2)
    os.kill(farm.worker.proc.pid, signal.SIGSTOP)
    try:
        waiting, _ = farm.submit(frames="1", samples=2)
        ended, _ = farm.submit(frames="1", samples=2)
        farm.post(f"/api/jobs/{ended}/cancel", farm.ana)
        reply = farm.post("/api/jobs/batch", farm.ana, {
            "action": "archive", "ids": [ended, waiting, theirs, "no-such-job"]})  # fmt: skip
        assert reply.status_code == 200, reply.text
        results = {r["job_id"]: r for r in reply.json()["results"]}
        assert results[ended]["ok"] and results[ended]["archived_s"]
        assert (results[waiting]["ok"], results[waiting]["status"]) == (False, 409)
        assert results[theirs]["status"] == results["no-such-job"]["status"] == 404
        assert farm.post(f"/api/jobs/{theirs}/suspend", farm.ana).status_code == 404
        assert farm.get("/api/events?project=other", farm.ana).status_code == 404
        assert farm.post("/api/jobs/batch", farm.ana, {"action": "explode", "ids": [ended]}
                         ).status_code == 400  # fmt: skip
        # archived jobs leave the default list, and come back with archived=1
        listed = [j["job_id"] for j in farm.get("/api/jobs", farm.ana).json()["jobs"]]
        assert waiting in listed and ended not in listed
        shown = farm.get("/api/jobs?archived=1", farm.ana).json()["jobs"]
        assert [j["job_id"] for j in shown] == [ended]
        by_state = farm.get("/api/jobs?archived=all&sort=state&order=asc", farm.ana).json()
        names = [j["job_id"] for j in by_state["jobs"]]
        assert names.index(ended) < names.index(waiting), "canceled sorts before queued"
        assert farm.get("/api/jobs?sort=size", farm.ana).status_code == 400
        reply = farm.post("/api/jobs/batch", farm.ana, {"action": "cancel", "ids": [waiting]})
        assert reply.json()["results"][0]["state"] == "canceled"
    finally:
        os.kill(farm.worker.proc.pid, signal.SIGCONT)


def test_jobs_list_batch_archives_the_selection_and_follows_the_live_feed(
    farm: Farm, browser: Browser
) -> None:
    os.kill(farm.worker.proc.pid, signal.SIGSTOP)
    try:
        first, _ = farm.submit(frames="1", samples=2)
        second, _ = farm.submit(frames="1", samples=2)
        for job_id in (first, second):
            farm.post(f"/api/jobs/{job_id}/cancel", farm.ana)
    finally:
        os.kill(farm.worker.proc.pid, signal.SIGCONT)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("dialog", lambda d: d.accept())
        page.goto(farm.live.url + "/")
        page.fill("#token", farm.ana)
        page.click("#signin")
        expect(page.locator("body[data-ready]")).to_have_count(1)
        expect(page.locator("#live.on")).to_have_count(1)  # the feed is open
        for job_id in (first, second):
            page.locator(f'tr[data-id="{job_id}"] input.pick').check()
        expect(page.locator("#batch-count")).to_have_text("2 selected")
        page.click('#batch button[data-action="archive"]')
        expect(page.locator(f'tr[data-id="{first}"]')).to_have_count(0)
        expect(page.locator(f'tr[data-id="{second}"]')).to_have_count(0)
        expect(page.locator("#batch")).to_be_hidden()
        # live: a job submitted elsewhere appears and is seen to end, without a reload
        late, _ = farm.submit(frames="1", samples=2)
        expect(page.locator(f'tr[data-id="{late}"]')).to_have_count(1, timeout=15_000)
        expect(page.locator(f'tr[data-id="{late}"][data-state="done"]')).to_have_count(
            1, timeout=60_000)  # fmt: skip
        # the job page requeues a frame of the done job and follows it to done again
        page.goto(f"{farm.live.url}/jobs/{late}")
        expect(page.locator("body[data-ready]")).to_have_count(1)
        page.fill("#requeue-frames", "1")
        page.click("#requeue")
        expect(page.locator("#log")).to_contain_text("frame 1 requeued by ana")
        expect(page.locator("#job-state .badge")).to_have_text("done", timeout=60_000)
        assert farm.store.status(late).tiles_done == 1
        page.goto(farm.live.url + "/")
        expect(page.locator("body[data-ready]")).to_have_count(1)
        page.select_option("#archived", "1")
        for job_id in (first, second):
            expect(page.locator(f'tr.archived[data-id="{job_id}"]')).to_have_count(1)
        expect(page.locator(f'tr[data-id="{late}"]')).to_have_count(0)
        assert not errors, errors
    finally:
        context.close()
