"""How the web's pages handle what the server says, in a real headless Chromium against the real
web app and Redis (no worker: jobs stay queued): an error answer is shown, never swallowed; an
event kind a page does not know is shown and said once; the stream player runs on the web's
origin with the one request helper both serve."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import pytest
import redis
from playwright.sync_api import Browser, Page, Route, expect, sync_playwright

from farm import keys
from farm.models import Event
from farm.redisserver import RedisServer
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS
from tests.web.conftest import make_job, make_web_settings
from tests.web.test_addon_client import LiveWeb, member_token

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")

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


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


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
