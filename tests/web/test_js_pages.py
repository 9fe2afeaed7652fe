"""How the web's pages handle what the server says, in a real headless Chromium against the real
web app and Redis (no worker: jobs stay queued): an error answer is shown, never swallowed; an
event kind a page does not know is shown and said once; the stream player runs on the web's
origin with the one request helper both serve."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

import pytest
import redis
from playwright.sync_api import Browser, Page, Route, expect

from farm import keys
from farm.models import Event
from farm.redisserver import RedisServer
from tests.conftest import TESTDATA
from tests.encoder.chromium import CHROMIUM
from tests.web.conftest import make_job, make_web_settings, scene_report
from tests.web.test_addon_client import LiveWeb, member_token
from web.uploads import report_json

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")

#: a plain Cycles scene (the upload page's file)
PLAIN = TESTDATA / "01_principled_material.blend"
#: what the web answers when the storage behind a job's files does not answer (farm/errors.py)
STORAGE_DOWN = {
    "error": {"code": "storage_unavailable", "message": "the storage did not answer after 3 tries"}
}


@dataclass
class Site:
    live: LiveWeb
    token: str  # a member of project "shorts"
    out: Path  # where its jobs' frames would go


@pytest.fixture(scope="module")
def site(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("js-pages")
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    live = LiveWeb(make_web_settings(redis_server.url, tmp))
    try:
        yield Site(live, member_token(redis_server.url, "ana", "shorts"), tmp / "out")
    finally:
        live.close()
        conn.flushall()
        conn.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    yield context.new_page()
    context.close()


def _sign_in(page: Page, site: Site, path: str) -> None:
    page.goto(f"{site.live.url}/login?next={path}")
    page.fill("#token", site.token)
    page.click("#signin")
    expect(page).to_have_url(site.live.url + path)


def test_a_failing_file_list_shows_its_error_on_the_job_page_until_it_loads(
    site: Site, page: Page
) -> None:
    job_id = make_job(site.live.settings, "shorts", site.out)
    # the storage behind the file list fails, as the web answers then, until the test says
    failing = True

    def frames_list(route: Route) -> None:
        if failing:
            route.fulfill(status=503, json=STORAGE_DOWN)
        else:
            route.continue_()

    page.route("**/api/jobs/*/frames", frames_list)
    page.on("dialog", lambda d: d.accept())
    _sign_in(page, site, f"/jobs/{job_id}")
    expect(page.locator("body[data-ready]")).to_have_count(1)
    error = page.locator("#files-error")
    expect(error).to_contain_text("Cannot list the frame files")
    expect(error).to_contain_text(STORAGE_DOWN["error"]["message"])
    # the list loads again (the job ends: the page lists what it has): the error goes
    failing = False
    page.click("#cancel")
    expect(page.locator("#job-state")).to_have_text("canceled")
    expect(error).to_have_count(0)


def test_the_job_page_logs_an_event_kind_it_does_not_know_and_warns_once(
    site: Site, page: Page
) -> None:
    job_id = make_job(site.live.settings, "shorts", site.out)
    warnings: list[str] = []
    page.on("console", lambda m: warnings.append(m.text) if m.type == "warning" else None)
    _sign_in(page, site, f"/jobs/{job_id}")
    expect(page.locator("#live")).to_contain_text("live")
    # what a newer server might send: the page shows it in the log, as it came
    conn = redis.Redis.from_url(site.live.settings.redis_url)
    try:
        for n in (1, 2):
            event = Event("gpu_swapped", job_id, time.time(), message=f"swap {n}")
            conn.xadd(keys.events(job_id), event.to_fields())  # type: ignore[arg-type]
    finally:
        conn.close()
    for n in (1, 2):
        expect(page.locator("#log div", has_text=f"gpu_swapped swap {n}")).to_have_count(1)
    # and says once in the console that it does not know the kind
    said = [w for w in warnings if "gpu_swapped" in w]
    assert len(said) == 1, said
    assert said[0].startswith('job page: event kind "gpu_swapped" is not one it handles')


def test_the_player_runs_on_the_webs_origin_and_shows_what_the_web_answers(
    site: Site, page: Page
) -> None:
    # the player's request helper is the encoder package's file, which the web serves too
    helper = page.request.get(site.live.url + "/static/request.js")
    assert helper.ok and helper.headers["content-type"].startswith("text/javascript")
    assert helper.text() == files("encoder").joinpath("static", "request.js").read_text()
    # no stream service runs: the player says so (the web's 503), it does not stay blank
    _sign_in(page, site, "/player")
    # a function, not an expression: Playwright polls an expression with eval(), which the
    # web's CSP (script-src 'self') refuses whenever the first check does not already hold
    page.wait_for_function("() => window.tessera && tessera.error !== null")
    assert page.evaluate("() => tessera.error.code") == "no_capacity"
    expect(page.locator("#error")).to_contain_text("no stream service is running")


def test_a_big_job_pages_its_task_table_and_keeps_its_frame_cards_in_a_box(
    site: Site, page: Page
) -> None:
    # 30 frames of 2 tiles, all queued (no worker): a table of 60 tasks, 50 to a page
    job_id = make_job(site.live.settings, "shorts", site.out, tiles="2x1", frames="1-30")
    _sign_in(page, site, f"/jobs/{job_id}")
    expect(page.locator(".frame")).to_have_count(30)
    rows = page.locator("#tasks tbody tr")
    expect(rows).to_have_count(50)
    expect(page.locator("#task-range")).to_have_text("1\u201350 of 60")
    expect(page.locator("#task-progress")).to_contain_text("0 / 60 tasks done")
    expect(page.locator("#task-progress")).to_contain_text("ETA after the first task")
    # past 24 frames the cards scroll in their own box: the page is not a wall of cards
    expect(page.locator("#frames.many")).to_have_count(1)
    assert page.evaluate("() => document.querySelector('#frames').clientHeight") <= 520
    page.click("#task-next")
    expect(page.locator("#task-range")).to_have_text("51\u201360 of 60")
    expect(rows).to_have_count(10)
    expect(rows.last).to_have_attribute("data-frame", "30")
    expect(page.locator("#task-next")).to_be_disabled()
    page.select_option("#task-state", "done")  # back to the first page of what the filter keeps
    expect(rows).to_have_count(0)
    expect(page.locator("#task-range")).to_have_text("no tasks")


def test_the_upload_page_says_the_farm_renders_an_eevee_file_with_cycles(
    site: Site, page: Page
) -> None:
    # the inspection is answered here (no worker): what the web answers for an EEVEE file
    def eevee(route: Route) -> None:
        upload_id = route.request.url.split("/api/uploads/")[1].split("/")[0]
        report = replace(scene_report(), engine="BLENDER_EEVEE")
        route.fulfill(json={"upload_id": upload_id, **report_json(report)})

    page.route("**/api/uploads/*/inspect*", eevee)
    _sign_in(page, site, "/upload")
    expect(page.locator("body[data-ready]")).to_have_count(1)
    page.set_input_files("#file", str(TESTDATA / "01_principled_material.blend"))
    engine = page.locator("#report [data-field=engine]")
    expect(engine).to_contain_text("EEVEE")
    expect(page.locator("#engine-note")).to_contain_text("The farm renders every job with Cycles")


def test_the_upload_form_sends_tags_dependencies_and_frame_order_and_deletes_an_upload(
    site: Site, page: Page
) -> None:
    """The scheduling fields reach the job (a bad tag is said next to its field); an upload
    that a queued job renders is refused deletion with the reason, and goes once it ended."""
    from farm import jobstore
    from farm.states import JobState

    sha = hashlib.sha256(PLAIN.read_bytes()).hexdigest()
    settings = site.live.settings
    first = make_job(settings, "shorts", site.out)
    conn = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    # the inspection is cached (no worker): the submit route reads it, the page is answered it
    conn.set(keys.inspection(sha), json.dumps(scene_report().to_dict()))
    answer = {"upload_id": sha, **report_json(scene_report())}
    page.route("**/api/uploads/*/inspect*", lambda route: route.fulfill(json=answer))
    page.on("dialog", lambda dialog: dialog.accept())
    _sign_in(page, site, "/upload")
    expect(page.locator("body[data-ready]")).to_have_count(1)
    page.set_input_files("#file", str(PLAIN))
    expect(page.locator("#submit-form")).to_be_visible()
    page.fill("#tags", "Big RAM")
    page.select_option("#frame-order", "first-last-middle")
    page.select_option("#depends-on", first)
    page.click("#submit")
    expect(page.locator("#tags-error")).to_contain_text("tag 'Big RAM' must be")
    expect(page.locator("#submit-error")).to_be_empty()
    page.fill("#tags", "big,lic")
    page.click("#submit")
    page.wait_for_url("**/jobs/*")
    job_id = page.url.rsplit("/", 1)[1]
    store = jobstore.JobStore(conn)
    spec = store.spec(job_id)
    assert (spec.tags, spec.depends_on, spec.frame_order) == (
        ("big", "lic"), (first,), "first-last-middle")  # fmt: skip

    stored = settings.storage_dir / "uploads" / sha
    page.goto(f"{site.live.url}/upload")
    page.click(f"#uploads [data-delete='{sha}']")
    refused = f"used by job(s) {job_id} that have not finished"
    expect(page.locator(".toast.bad")).to_contain_text(refused)
    assert stored.exists()
    store.end_job(job_id, JobState.CANCELED, "test")
    page.click(f"#uploads [data-delete='{sha}']")
    expect(page.locator("#uploads-empty")).to_be_visible()
    assert not stored.exists()
    conn.close()
