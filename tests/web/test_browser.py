"""The web UI in a real headless Chromium against the real web app, Redis and a render worker."""

from __future__ import annotations

import io
import os
import signal
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from playwright.sync_api import Browser, Page, expect

from encoder.app import running
from farm import blocklist, jobstore
from farm.redisserver import RedisServer
from tests.blendscenes import make_scene
from tests.encoder.tokens import STREAM_SECRET
from tests.farmprocs import WorkerProcess
from tests.web.conftest import wait_for_worker
from tests.web.test_addon_client import LiveWeb, client, member_token

#: how long a page may take to show what the farm did (a 2x2 render of a tiny scene on 2 cores)
RENDER_TIMEOUT_MS = 60_000

# Every tile cell's class as it changes, recorded from before the page's own script runs, so the
# test sees how the grid filled in (queued -> rendering -> done), not only where it ended.
_RECORD_TILES = """
window.__tiles = [];
new MutationObserver((records) => {
  for (const r of records) {
    const n = r.target;
    if (n.classList && n.classList.contains("tile")) {
      window.__tiles.push([n.dataset.tile, n.className]);
    }
  }
}).observe(document, { subtree: true, attributes: true, attributeFilter: ["class"] });
"""


@dataclass
class Site:
    live: LiveWeb
    token: str
    blend: Path  # renders in about 2 s on 2 cores
    missing: Path  # wants //textures/missing_texture.png
    worker: WorkerProcess


@pytest.fixture(scope="module")
def site(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """The web app, one render worker and a member token of project "shorts", for this module."""
    tmp = tmp_path_factory.mktemp("browser-farm")
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    # about half a second per tile, so the page sees tiles render one after another
    blend = make_scene(tmp / "teapot_shot.blend", width=64, height=40, seconds_per_frame_hint=2.0)
    missing = make_scene(tmp / "lost_texture.blend", width=32, height=24, missing_texture=True)
    worker = WorkerProcess(redis_server.url, tmp)
    try:
        wait_for_worker(redis_server.url)
        live = LiveWeb(worker.settings.with_(stream_secret=STREAM_SECRET))
        try:
            token = member_token(redis_server.url, "ana", "shorts")
            yield Site(live, token, blend, missing, worker)
        finally:
            live.close()
    finally:
        worker.stop()
        conn.flushall()
        conn.close()


def _sign_in(page: Page, site: Site, path: str) -> None:
    page.goto(site.live.url + path)
    page.fill("#token", site.token)
    page.click("#signin")
    expect(page).to_have_url(site.live.url + path)
    expect(page.locator("body[data-ready]")).to_have_count(1)  # the page's handlers are on


@contextmanager
def _paused(worker: WorkerProcess) -> Iterator[None]:
    """The worker process stopped (SIGSTOP) for the block: it takes no work until the end."""
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker.proc.pid, signal.SIGCONT)


def _shot(page: Page, out: Path, name: str) -> None:
    page.evaluate("window.scrollTo(0, 0)")  # the sticky top bar at the top of a full-page shot
    page.screenshot(path=str(out / f"{name}.png"), full_page=True)


def test_login_upload_submit_watch_tiles_and_download(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    live, token, blend = site.live, site.token, site.blend
    shots = tmp_path / "screenshots"
    shots.mkdir()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(_RECORD_TILES)
    try:
        # signing in: the jobs page sends a stranger to the login page, a token lets them in
        page.goto(live.url + "/upload")
        expect(page).to_have_url(live.url + "/login?next=%2Fupload")
        page.fill("#token", "tsr_wrong")
        page.click("#signin")
        expect(page.locator("#error")).to_contain_text("not valid")
        _shot(page, shots, "1-login")
        page.fill("#token", token)
        page.click("#signin")
        expect(page).to_have_url(live.url + "/upload")
        expect(page.locator("#user")).to_have_text("ana")
        expect(page.locator("body[data-ready]")).to_have_count(1)
        page.goto(live.url + "/login")  # signed in: the login page goes straight on
        expect(page).to_have_url(live.url + "/")
        page.goto(live.url + "/upload")
        expect(page.locator("body[data-ready]")).to_have_count(1)

        # upload: the page shows what the farm found in the file
        page.set_input_files("#file", str(blend))
        report = page.locator("#report")
        expect(report.locator("[data-field=resolution]")).to_have_text(
            "64 \u00d7 40 px", timeout=RENDER_TIMEOUT_MS
        )
        expect(report.locator("[data-field=frame-range]")).to_contain_text("1 \u2013 1")
        expect(report.locator("[data-field=engine]")).to_have_text("CYCLES")
        expect(report.locator("[data-field=cameras]")).to_contain_text("Camera")
        expect(page.locator("#problems")).to_contain_text("Ready to render")
        expect(page.locator("#submit")).to_be_enabled()
        _shot(page, shots, "2-inspected")

        # submit a 2x2 tile grid; the job page opens. The worker takes no tile until the page
        # shows the grid queued, so the page sees the tiles render however loaded the machine is
        expect(page.locator("#denoise")).to_be_checked()  # as the file asks
        page.uncheck("#denoise")  # (a denoiser run costs this test seconds)
        page.fill("#tiles", "2x2")
        page.fill("#name", "browser test shot")
        with _paused(site.worker):
            page.click("#submit")
            page.wait_for_url(live.url + "/jobs/*")
            expect(page.locator("#job-name")).to_have_text("browser test shot")
            expect(page.locator(".frame[data-frame='1'] .tile.queued")).to_have_count(4)

        # the grid fills in from the event stream and the frame's thumbnail appears
        thumb = page.locator(".frame[data-frame='1'] img.thumb.shown")
        expect(thumb).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        expect(page.locator("#job-state")).to_have_text("done", timeout=RENDER_TIMEOUT_MS)
        assert page.evaluate("document.querySelector('.frame img.thumb').naturalWidth") > 0
        expect(page.locator(".frame[data-frame='1'] .tile.done")).to_have_count(4)
        seen = page.evaluate("window.__tiles")
        states = {i: [cls.split()[-1] for tile, cls in seen if tile == i] for i in "0123"}
        # every tile ended done, and the page saw tiles render (they were queued when it opened)
        assert all(s and s[-1] == "done" for s in states.values()), states
        assert any("rendering" in s for s in states.values()), states
        expect(page.locator("#log")).to_contain_text("frame 1 done")
        expect(page.locator(".frame[data-frame='1'] .files a")).not_to_have_count(0)
        _shot(page, shots, "3-job-done")

        # downloads: one frame, and a zip of all, with the session cookie
        png = page.locator(".frame[data-frame='1'] .files a", has_text="png")
        single = context.request.get(live.url + str(png.get_attribute("href")))
        assert single.ok and single.body()[:8] == b"\x89PNG\r\n\x1a\n"
        whole = context.request.get(live.url + str(page.get_attribute("#download-all", "href")))
        assert whole.ok
        with zipfile.ZipFile(io.BytesIO(whole.body())) as zf:
            assert any(n.endswith("frame_0001.png") for n in zf.namelist())

        # the jobs list shows it, and its state filter works
        page.click("nav >> text=Jobs")
        expect(page.locator("body[data-ready]")).to_have_count(1)
        expect(page.locator("#jobs tbody tr")).to_have_count(1)
        expect(page.locator("#jobs tbody tr")).to_contain_text("browser test shot")
        page.select_option("#state", "failed")
        expect(page.locator("#jobs tbody tr")).to_have_count(0)
        page.select_option("#state", "done")
        expect(page.locator("#jobs tbody tr")).to_have_count(1)
        _shot(page, shots, "4-jobs")

        # signing out ends the session: the pages send the visitor back to the login page
        page.click("#logout")
        expect(page).to_have_url(live.url + "/login")
        page.goto(live.url + "/")
        expect(page).to_have_url(live.url + "/login?next=%2F")
    finally:
        _shot(page, shots, "last")
        context.close()
    assert not errors, errors
    assert sorted(p.name for p in shots.iterdir())[:4] == [
        "1-login.png",
        "2-inspected.png",
        "3-job-done.png",
        "4-jobs.png",
    ]


def test_missing_files_block_submission_until_accepted(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        _sign_in(page, site, "/upload")
        page.set_input_files("#file", str(site.missing))
        missing = page.locator("#missing-files")
        expect(missing).to_contain_text("missing_texture.png", timeout=RENDER_TIMEOUT_MS)
        # shown as the user named it, not where the farm keeps the upload
        assert "storage" not in missing.inner_text()
        expect(page.locator("#submit")).to_be_disabled()
        page.check("#accept-missing")
        expect(page.locator("#submit")).to_be_enabled()
        page.uncheck("#accept-missing")
        expect(page.locator("#submit")).to_be_disabled()
    finally:
        _shot(page, tmp_path, "missing-files")
        context.close()


def test_streams_page_launches_lists_and_ends_a_session(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    settings = site.live.settings.with_(
        device="cpu", stream_port=0, cpu_encode_sessions=2, stream_grace_s=30.0
    )
    with running(settings):
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        # Launch opens the player in a new tab; the player has tests of its own, so here it is a
        # stub page (no WebRTC peer eating the CPU)
        context.route("**/player?*", lambda route: route.fulfill(body="player", status=200))
        page = context.new_page()
        page.on("dialog", lambda d: d.accept())
        try:
            _sign_in(page, site, "/streams")
            card = page.locator(".app", has=page.locator("[data-app=testpattern]"))
            expect(card).to_contain_text("testpattern")
            with context.expect_page() as popup:
                card.locator("button").click()
            player = popup.value
            player.wait_for_load_state()
            assert "/player?session=" in player.url and "role=player" in player.url
            player.close()
            rows = page.locator("#sessions tbody tr")
            expect(rows).to_have_count(1)
            expect(rows.first).to_contain_text("testpattern")
            spectate = rows.first.locator("a", has_text="Spectate")
            assert "role=spectator" in str(spectate.get_attribute("href"))
            _shot(page, tmp_path, "streams")
            rows.first.locator("button", has_text="End").click()
            expect(rows).to_have_count(0)
            expect(page.locator("#sessions-empty")).to_be_visible()
        finally:
            context.close()


def test_job_page_changes_priority_and_cancels(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    farm = client.FarmClient(site.live.url, site.token)
    options = client.SubmitOptions(frames="1-3", tiles="2x2", formats="png", name="long shot")
    job_id = farm.submit_blend(str(site.blend), options, "shorts").job_id
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.on("dialog", lambda d: d.accept())
    # a worker that failed three of the job's tiles is blocklisted for it (farm.blocklist)
    conn = jobstore.connect(site.worker.settings.redis_url)
    for _ in range(3):
        blocklist.record_failure(conn, job_id, "host-cpu-7", threshold=3)
    conn.close()
    try:
        _sign_in(page, site, f"/jobs/{job_id}")
        expect(page.locator("#job-name")).to_have_text("long shot")
        expect(page.locator(".frame")).to_have_count(3)
        expect(page.locator("#blocklist")).to_have_text("host-cpu-7: 3 failed tile(s)")
        page.click("#clear-blocklist")
        expect(
            page.locator(".toast", has_text="1 worker(s) may render this job again")
        ).to_have_count(1)
        expect(page.locator("#blocklist-panel")).to_be_hidden()
        page.fill("#priority", "7")
        page.click("#set-priority")
        expect(page.locator(".toast", has_text="Priority set to 7")).to_have_count(1)
        assert farm.job(job_id)["priority"] == 7
        page.click("#cancel")
        expect(page.locator("#job-state")).to_have_text("canceled")
        expect(page.locator("#notes")).to_contain_text("canceled by ana")
        expect(page.locator("#cancel")).to_be_disabled()
        expect(page.locator("#live")).to_contain_text("finished")
        _shot(page, tmp_path, "canceled")
    finally:
        context.close()
    assert farm.job(job_id)["state"] == "canceled"


def test_failed_job_shows_its_reason_and_retries_failed_tiles(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    farm = client.FarmClient(site.live.url, site.token)
    # a tile may run for 0.3 s: this scene needs longer, so its one attempt fails
    impatient = {"tile_timeout_s": 0.3, "max_attempts": 1}
    options = client.SubmitOptions(frames="1", tiles="1x1", formats="png", extra=impatient)
    job_id = farm.submit_blend(str(site.blend), options, "shorts").job_id
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    try:
        _sign_in(page, site, f"/jobs/{job_id}")
        expect(page.locator("#job-state")).to_have_text("failed", timeout=RENDER_TIMEOUT_MS)
        expect(page.locator("#reason")).to_contain_text("frame 1")
        expect(page.locator(".tile.failed")).to_have_count(1)
        expect(page.locator("#log .err")).not_to_have_count(0)
        # the cause comes first, in the job's reason and in the task table, its log a click away
        expect(page.locator("#reason")).to_contain_text("timed out after 0.3 s in frame 1")
        failed = page.locator("#tasks tbody tr[data-state=failed]")
        expect(failed).to_contain_text("timed out after 0.3 s in frame 1")
        expect(page.locator("#task-failures")).to_contain_text(
            "timed out after 0.3 s in frame 1" + "1 failed attempt · frame 1"
        )
        log = context.request.get(
            site.live.url + str(failed.locator("a.log-link").get_attribute("href"))
        )
        assert log.ok and "cause: timed out after 0.3 s in frame 1" in log.text(), log.text()
        _shot(page, tmp_path, "failed")
        page.click("#retry")
        expect(page.locator(".toast")).to_contain_text("1 tile(s) queued again")
        # the retried tile fails again (same time limit), and the page follows it live
        failures = page.locator("#log div", has_text="job failed")
        expect(failures).to_have_count(2, timeout=RENDER_TIMEOUT_MS)
        expect(page.locator("#job-state")).to_have_text("failed")
        expect(page.locator("#live")).to_contain_text("finished")
    finally:
        context.close()
    assert farm.job(job_id)["state"] == "failed"


def test_task_table_sorts_filters_and_shows_blenders_figures(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    """The job page's task table: a row per tile with worker, times and Blender's figures,
    sorted by a column header, filtered by state. With FARM_SCREENSHOT_DIR set it saves the
    README's picture of it there (task-table.png)."""
    farm = client.FarmClient(site.live.url, site.token)
    # 8 samples, not the scene's measured count: the table needs finished tasks, not slow ones
    options = client.SubmitOptions(
        frames="1-2", tiles="2x1", samples=8, formats="exr,png", name="table shot"
    )
    job_id = farm.submit_blend(str(site.blend), options, "shorts").job_id
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        _sign_in(page, site, f"/jobs/{job_id}")
        expect(page.locator("#job-state")).to_have_text("done", timeout=RENDER_TIMEOUT_MS)
        rows = page.locator("#tasks tbody tr")
        expect(page.locator("#tasks tbody tr[data-state=done]")).to_have_count(
            4, timeout=RENDER_TIMEOUT_MS
        )
        expect(rows.first).to_contain_text(site.worker.name)
        expect(page.locator("#task-progress")).to_contain_text("4 / 4 tasks done")

        def order() -> list[tuple[int, int]]:
            cells = page.evaluate(
                "() => [...document.querySelectorAll('#tasks tbody tr')]"
                ".map((r) => [Number(r.dataset.frame), Number(r.dataset.tile)])"
            )
            return [(f, t) for f, t in cells]

        def api_order(sort: str) -> list[tuple[int, int]]:
            got = context.request.get(f"{site.live.url}/api/jobs/{job_id}/tasks?sort={sort}")
            return [(t["frame"], t["tile"]) for t in got.json()["tasks"]]

        # one click sorts by render time, a second click turns the order round
        header = page.locator("#tasks th[data-sort=render]")
        header.click()
        expect(page.locator("#tasks th[data-sort=render]")).to_have_attribute(
            "aria-sort", "ascending"
        )
        assert order() == api_order("render")
        page.locator("#tasks th[data-sort=render]").click()
        expect(page.locator("#tasks th[data-sort=render]")).to_have_attribute(
            "aria-sort", "descending"
        )
        assert order() == api_order("-render")
        renders = page.locator("#tasks tbody td[data-col=render]").all_inner_texts()
        seconds = [float(t.split()[0]) for t in renders]
        assert seconds == sorted(seconds, reverse=True) and seconds[-1] > 0, renders
        memory = page.locator("#tasks tbody td[data-col=memory]").all_inner_texts()
        assert all(m.endswith("MiB") for m in memory), memory

        # the state filter: none failed, all four done
        page.select_option("#task-state", "failed")
        expect(rows).to_have_count(0)
        expect(page.locator("#tasks-empty")).to_have_text("No failed tasks.")
        page.select_option("#task-state", "done")
        expect(rows).to_have_count(4)
        page.locator(".frame-times summary").click()
        expect(page.locator("#frame-times tr")).to_have_count(2)

        shots = os.environ.get("FARM_SCREENSHOT_DIR")
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.locator("#tasks-panel").screenshot(path=str(Path(shots) / "task-table.png"))

        # a frame opens full size; the exposure slider re-renders its EXR
        page.locator(".frame[data-frame='2'] img.thumb.shown").click()
        expect(page.locator("#viewer")).to_be_visible()
        page.wait_for_function("() => document.querySelector('#viewer-img').naturalWidth === 64")
        page.locator("#exposure").fill("2")
        page.wait_for_function(
            "() => document.querySelector('#viewer-img').src.includes('exposure=2')"
            " && document.querySelector('#viewer-img').complete"
            " && document.querySelector('#viewer-img').naturalWidth === 64"
        )
        expect(page.locator("#exposure-value")).to_have_text("+2 EV")
    finally:
        _shot(page, tmp_path, "task-table")
        context.close()
    assert not errors, errors


def test_the_form_estimates_before_submitting_and_the_job_shows_estimate_against_actual(
    browser: Browser, site: Site, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        _sign_in(page, site, "/upload")
        page.set_input_files("#file", str(site.blend))
        expect(page.locator("#submit")).to_be_enabled(timeout=RENDER_TIMEOUT_MS)
        page.uncheck("#denoise")
        page.fill("#name", "estimated shot")
        # the probe renders on the worker; the table shows the CPU class's figures
        page.click("#estimate")
        row = page.locator("#estimate-table tr[data-class='cpu']")
        expect(row).to_be_visible(timeout=RENDER_TIMEOUT_MS)
        expect(row.locator("[data-field=frame]")).to_contain_text(" s")
        expect(row.locator("[data-field=wall]")).to_contain_text(" s")
        expect(row.locator("[data-field=cost]")).to_contain_text("USD")
        expect(page.locator("#estimate-note")).to_contain_text("a probe rendered on cpu")
        _shot(page, tmp_path, "estimate")
        # submitted: the job page shows the estimate, then the actual against it once done
        page.click("#submit")
        page.wait_for_url(site.live.url + "/jobs/*")
        expect(page.locator("#job-state")).to_have_text("done", timeout=RENDER_TIMEOUT_MS)
        shown = page.locator("#stats .v.estimate")
        expect(shown).to_contain_text("actual", timeout=RENDER_TIMEOUT_MS)
        expect(shown).to_contain_text("est.")
        expect(shown).to_contain_text("%")
    finally:
        context.close()
    assert not errors, errors
