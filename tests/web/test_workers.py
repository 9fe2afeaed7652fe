"""The workers page and API against a real farm (a render worker, Redis, bpy renders of a tiny
scene): what a worker is doing, draining it, why a job waits, `farm workers`, and the page in
headless Chromium (its screenshot, with FARM_SCREENSHOT_DIR set, is docs/img/workers.png)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from playwright.sync_api import Browser, expect

from farm import cli, jobstore, keys
from farm.redisserver import RedisServer
from tests.blendscenes import make_scene
from tests.conftest import TESTDATA
from tests.farmprocs import WorkerProcess, until
from tests.web.conftest import Tokens, make_tokens, wait_for_worker
from tests.web.test_addon_client import LiveWeb

WORKER = "w-ops"
#: a job's tiles render in about half a second each on 2 cores
JOB_TIMEOUT_S = 60


@dataclass
class Farm:
    live: LiveWeb
    tokens: Tokens
    worker: WorkerProcess
    upload_id: str  # project A's upload of the scene, inspected once (the web caches it)
    other_scene: Path  # never inspected nor rendered
    samples: int  # the scene's own: a frame in about 2 s
    store: jobstore.JobStore
    tmp: Path


def call(farm: Farm, method: str, path: str, token: str, body: Any = None,
         data: bytes | None = None) -> tuple[int, Any]:  # fmt: skip
    headers = {"Authorization": f"Bearer {token}"}
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(farm.live.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def workers(farm: Farm, token: str) -> dict[str, dict[str, Any]]:
    status, body = call(farm, "GET", "/api/workers", token)
    assert status == 200, body
    return {w["name"]: w for w in body["workers"]}


def submit(farm: Farm, tiles: str = "2x1", device: str = "cpu", **options: Any) -> str:
    status, body = call(farm, "POST", "/api/jobs", farm.tokens.alice,
                        {"project": "A", "upload_id": farm.upload_id, "tiles": tiles,
                         "device": device, "formats": ["exr"], **options})  # fmt: skip
    assert status == 201, body
    return str(body["job_id"])


def wait_done(farm: Farm, job_id: str) -> None:
    until(lambda: farm.store.status(job_id).state in ("done", "failed"), JOB_TIMEOUT_S, "job end")
    status = farm.store.status(job_id)
    assert status.state == "done", status.reason


@pytest.fixture(scope="module")
def farm(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Farm]:
    tmp = tmp_path_factory.mktemp("workers-farm")
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    # the worker imports bpy while the scene is built
    worker = WorkerProcess(redis_server.url, tmp, name=WORKER)
    scene = make_scene(tmp / "shot.blend", width=64, height=40, seconds_per_frame_hint=2.0)
    other = TESTDATA / "01_principled_material.blend"  # a real file, never rendered here
    store = jobstore.JobStore(jobstore.connect(redis_server.url))
    try:
        tokens = make_tokens(redis_server.url)
        wait_for_worker(redis_server.url)
        live = LiveWeb(worker.settings)
        try:
            farm = Farm(live, tokens, worker, "", other, 0, store, tmp)
            status, body = call(farm, "PUT", f"/api/uploads/{scene.name}?project=A",
                                tokens.alice, data=scene.read_bytes())  # fmt: skip
            assert status == 201, body
            farm.upload_id = body["upload_id"]
            status, body = call(farm, "POST", f"/api/uploads/{farm.upload_id}/inspect",
                                tokens.alice)  # fmt: skip
            assert status == 200, body
            farm.samples = body["samples"]
            yield farm
        finally:
            live.close()
    finally:
        worker.stop()
        store.conn.close()
        conn.flushall()
        conn.close()


def test_a_worker_shows_its_tile_to_its_project_and_busy_to_others_then_counts_it(
    farm: Farm,
) -> None:
    me = workers(farm, farm.tokens.alice)[WORKER]
    assert (me["kind"], me["queue"], me["device_class"], me["pid"]) == (
        "render", "cpu", "cpu", farm.worker.proc.pid)  # fmt: skip
    assert me["state"] == "idle" and time.time() - me["last_beat"] < 30
    done_before = me["tiles_done_today"]
    job_id = submit(farm)
    seen: dict[str, dict[str, Any]] = {}

    def rendering_seen_by_all() -> bool:
        for who, token in (("alice", farm.tokens.alice), ("bob", farm.tokens.bob),
                           ("root", farm.tokens.admin)):  # fmt: skip
            w = workers(farm, token)[WORKER]
            if w["state"] == "rendering" and who not in seen:
                seen[who] = w
        return len(seen) == 3

    until(rendering_seen_by_all, JOB_TIMEOUT_S, "every user seeing the worker render")
    # a job queued behind it is told the worker is busy, and how many tasks are before it
    # (the other tile of the first job, or its frame's assembly, as the worker stands)
    second = submit(farm, tiles="1x1")
    status, why = call(farm, "GET", f"/api/jobs/{second}/why", farm.tokens.alice)
    assert status == 200 and why["reason"] == "busy" and why["tasks_ahead"] in (0, 1), why
    assert why["message"].startswith("the only CPU worker is busy; ")
    for who in ("alice", "root"):  # the job's project, a farm admin
        w = seen[who]
        assert (w["task"], w["job"], w["project"]) == ("tile", job_id, "A"), who
        assert w["frame"] == 1 and w["tile"] in (0, 1) and w["lease"], who
    # a member of project B only learns the worker is busy
    assert (seen["bob"]["task"], seen["bob"]["job"], seen["bob"]["project"]) == (
        "busy (another project)", "", "")  # fmt: skip
    assert seen["bob"]["lease"] == "" and seen["bob"]["frame"] is None
    wait_done(farm, job_id)
    wait_done(farm, second)
    until(lambda: workers(farm, farm.tokens.alice)[WORKER]["state"] == "idle", 10, "idle again")
    assert workers(farm, farm.tokens.alice)[WORKER]["tiles_done_today"] == done_before + 3


def test_a_disabled_worker_takes_no_tile_until_enabled_and_the_job_says_why(
    farm: Farm,
) -> None:
    path = f"/api/workers/{WORKER}/disable"
    status, body = call(farm, "POST", path, farm.tokens.bob)
    assert status == 403, body
    status, body = call(farm, "POST", path, farm.tokens.admin)
    assert status == 200 and body["state"] == "disabled" and body["disabled_by"] == "root", body
    job_id = submit(farm, tiles="1x1")
    status, why = call(farm, "GET", f"/api/jobs/{job_id}/why", farm.tokens.alice)
    assert status == 200 and why["reason"] == "all_disabled", why
    assert "disabled by an operator" in why["message"]
    # an inspection now is refused at once with the reason, not after FARM_INSPECT_TIMEOUT_S
    other = farm.other_scene
    status, up = call(farm, "PUT", f"/api/uploads/{other.name}?project=A", farm.tokens.alice,
                      data=other.read_bytes())  # fmt: skip
    t0 = time.monotonic()
    status, body = call(farm, "POST", f"/api/uploads/{up['upload_id']}/inspect", farm.tokens.alice)
    assert status == 503 and body["error"]["code"] == "no_worker", body
    assert "disabled by an operator" in body["error"]["message"]
    assert time.monotonic() - t0 < 5
    # a second disabled: the tile waits (at most handed back once, never counted)
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        assert farm.store.status(job_id).tiles_done == 0
        time.sleep(0.2)
    # a worker blocked on the queue when disabled may take the tile once and hand it back; a
    # worker that kept taking it would be at a higher attempt by now
    attempt = int(farm.store.conn.hget(keys.tiles(job_id), "1:0:a") or 0)
    assert attempt in (1, 2), attempt
    status, body = call(farm, "POST", f"/api/workers/{WORKER}/enable", farm.tokens.admin)
    assert status == 200 and body["state"] == "idle", body
    wait_done(farm, job_id)
    assert farm.store.status(job_id).tile_failures == 0
    status, why = call(farm, "GET", f"/api/jobs/{job_id}/why", farm.tokens.alice)
    assert why["reason"] == "not_queued"


def test_a_gpu_job_with_only_a_cpu_worker_is_told_no_gpu_worker_is_online(farm: Farm) -> None:
    job_id = submit(farm, tiles="1x1", device="gpu")
    status, why = call(farm, "GET", f"/api/jobs/{job_id}/why", farm.tokens.alice)
    assert status == 200 and why["reason"] == "no_worker", why
    assert why["message"].startswith("no GPU worker online: 1 CPU worker idle"), why
    # another project's member cannot ask about the job
    assert call(farm, "GET", f"/api/jobs/{job_id}/why", farm.tokens.bob)[0] == 404
    call(farm, "POST", f"/api/jobs/{job_id}/cancel", farm.tokens.alice)


def test_farm_workers_lists_disables_enables_and_farm_submit_refuses_a_gpu_job_at_once(
    farm: Farm, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in farm.worker.env.items():
        if name.startswith("FARM_"):
            monkeypatch.setenv(name, value)
    assert cli.main(["workers"]) == 0
    header, line = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[:5] == ["WORKER", "KIND", "HOST", "DEVICE", "STATE"]
    assert line.split()[:2] == [WORKER, "render/cpu"] and " idle " in line
    assert cli.main(["workers", "disable", WORKER]) == 0
    assert capsys.readouterr().out == f"{WORKER}: disabled\n"
    assert cli.main(["workers", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert (listed["name"], listed["state"], listed["disabled_by"]) == (WORKER, "disabled", "cli")
    assert cli.main(["workers", "enable", WORKER]) == 0
    assert capsys.readouterr().out == f"{WORKER}: idle\n"
    assert cli.main(["workers", "enable", "nobody"]) == 3
    t0 = time.monotonic()
    out = str(farm.tmp / "gpu-out")
    code = cli.main(["submit", str(farm.other_scene), "--device", "gpu", "--output", out])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 5 and "no GPU worker online: 1 CPU worker idle" in err, err
    assert took < 5, f"farm submit waited {took:.1f} s"


def test_the_workers_page_shows_rendering_draining_and_lets_an_admin_disable_and_enable(
    farm: Farm,
    browser: Browser,
) -> None:
    context = browser.new_context(viewport={"width": 1360, "height": 560})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        url = farm.live.url
        page.goto(url + "/workers")
        page.fill("#token", farm.tokens.admin)
        page.click("#signin")
        expect(page).to_have_url(url + "/workers")
        expect(page.locator("body[data-ready]")).to_have_count(1)
        expect(page.locator("nav a.active")).to_have_text("Workers")
        row = page.locator(f'tr[data-name="{WORKER}"]')
        expect(row).to_have_attribute("data-state", "idle")
        # four tiles of about 2 s each. The page refreshes every 2 s, so it may first show the
        # worker rendering late in a tile; the worker has taken the next one by the time the
        # click lands, and at least one more must be left to wait for the worker (with two
        # tiles, a fresh-clone CI run saw the whole job done before the job page was opened)
        job_id = submit(farm, tiles="4x1", samples=farm.samples * 4)
        # the page refreshes itself: the worker's tile shows without a reload
        expect(row).to_have_attribute("data-state", "rendering", timeout=JOB_TIMEOUT_S * 1000)
        expect(row.locator("td.task a")).to_have_text(job_id)
        shots = os.environ.get("FARM_SCREENSHOT_DIR")
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(shots) / "workers.png"))
        row.locator('button[data-action="disable"]').click()
        expect(row).to_have_attribute("data-state", "disabled", timeout=JOB_TIMEOUT_S * 1000)
        expect(row.locator("td", has_text="by root")).to_have_count(1)
        left = farm.store.status(job_id)
        assert left.tiles_done < left.tiles_total, "every tile was done before the disable"
        # the job page says why the rest of the job waits (to the job's project: alice)
        member = browser.new_context()
        try:
            job_page = member.new_page()
            job_page.goto(f"{url}/jobs/{job_id}")
            job_page.fill("#token", farm.tokens.alice)
            job_page.click("#signin")
            expect(job_page.locator("#why")).to_contain_text("disabled by an operator")
        finally:
            member.close()
        row.locator('button[data-action="enable"]').click()
        wait_done(farm, job_id)  # the rest of the job goes on
        expect(row).to_have_attribute("data-state", "idle")
        assert errors == []
    finally:
        context.close()
