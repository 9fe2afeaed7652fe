"""Live preview in a real Chromium: a frame converging pass by pass on the job page (as a WebRTC
video, and on the JPEG/SSE canvas of a viewer over the WebRTC cap), a viewer joining mid-frame,
the final frame against a plain render, and strangers kept out."""

from __future__ import annotations

import io
import json
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import redis
from PIL import Image
from playwright.sync_api import Browser, BrowserContext, Page, expect

from farm import jobstore, livepreview, queue, submission
from farm.accept import accept
from farm.jobstore import JobStore
from farm.passschedule import pass_schedule
from farm.redisserver import RedisServer
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, wait_for
from tests.web.conftest import wait_for_worker
from tests.web.test_addon_client import LiveWeb, member_token
from workers import exr

WIDTH, HEIGHT, SAMPLES, TILES = 64, 40, 64, "2x1"
#: 1, 4, 16, 64 samples: four passes a tile
PASSES = len(pass_schedule(SAMPLES))
#: the sample split's bound (tests/workers/test_samplesplit.py): merging re-weights each pass
#: in float32, so the final frame equals one render of every sample up to a few ULPs
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-6
#: two canvas states differ visibly when their mean absolute difference (0-255) is above this
VISIBLE = 0.5
#: the late viewer must see the frame's current state this soon after navigating (ms)
JOIN_MS = 1000.0
TIMEOUT_MS = 60_000


@dataclass
class Watched:
    """What watching one live-preview job recorded (the tests below judge it)."""

    job_id: str
    #: the first viewer's canvas after each pass it drew (grabbed in the page: GRAB_CANVAS)
    states: list[npt.NDArray[np.float32]] = field(default_factory=list)
    passes: list[dict[str, float]] = field(default_factory=list)
    #: the late viewer: ms from its navigation to the current state drawn, and its canvas
    #: against the first viewer's while the worker was held still
    join_ms: float = 0.0
    join_passes: int = 0
    snapshot_passes: int = 0
    join_same_pixels: bool = False
    #: when its page had loaded (ms from navigation): what the browser itself took
    join_loaded_ms: float = 0.0
    #: the WebRTC viewer: its video's visibly different states (grabbed in the page at each
    #: video frame), what its live link said, and the other viewers' (refused at the cap)
    video_states: list[npt.NDArray[np.float32]] = field(default_factory=list)
    video_errors: list[str] = field(default_factory=list)
    video_link: str = ""
    sse_link: str = ""
    sse_why: str = ""
    live_exr: Path = Path()
    plain_exr: Path = Path()
    web_url: str = ""
    errors: list[str] = field(default_factory=list)


def _canvas(page: Page) -> npt.NDArray[np.float32]:
    png = page.locator("#live-canvas").screenshot()
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), np.float32)


def _sign_in(page: Page, url: str, token: str, path: str) -> None:
    page.goto(url + path)
    page.fill("#token", token)
    page.click("#signin")
    expect(page).to_have_url(url + path)
    expect(page.locator("body[data-ready]")).to_have_count(1)


@pytest.fixture(scope="module")
def watched(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory, browser: Browser
) -> Iterator[Watched]:
    """One live-preview job watched from the job page (opened before its first tile renders),
    a second viewer joining mid-frame, then a plain job of the same scene."""
    tmp = tmp_path_factory.mktemp("live-preview")
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    blend = make_scene(tmp / "converge.blend", width=WIDTH, height=HEIGHT, samples=SAMPLES)
    # every pass of the schedule: these tiles cost so little that the default budget (5 % of a
    # tile's render for the passes' calls) would merge them (tests/farm/test_passschedule.py)
    worker = WorkerProcess(redis_server.url, tmp, FARM_LIVE_PREVIEW_BUDGET="100")
    shots = tmp / "shots"  # the frame as the page showed it, pass by pass (README's sequence)
    shots.mkdir()
    try:
        wait_for_worker(redis_server.url)
        # one WebRTC viewer a job: the second page (and the late viewer) are refused and fall
        # back to JPEG/SSE, which the tests below watch
        live = LiveWeb(replace(worker.settings, live_webrtc_per_job=1))
        token = member_token(redis_server.url, "ana", "shorts")
        context = browser.new_context(viewport={"width": 900, "height": 700})
        page = context.new_page()
        video_context: BrowserContext | None = None
        try:
            _sign_in(page, live.url, token, "/")
            store, job_id = _queued_unseen(worker, blend, tmp / "live")
            seen = Watched(job_id, web_url=live.url)
            # in a window of its own: a page behind another in one window is hidden, and
            # Chromium slows its timers and frames
            video_context = browser.new_context(viewport={"width": 900, "height": 700},
                                                storage_state=context.storage_state())  # fmt: skip
            video = video_context.new_page()
            video.on("pageerror", lambda e: seen.video_errors.append(str(e)))
            try:
                video.goto(f"{live.url}/jobs/{job_id}")
                expect(video.locator("#live-view[data-path=webrtc]")).to_have_count(
                    1, timeout=TIMEOUT_MS
                )
                seen.video_link = video.locator("#live-link").inner_text()
                video.evaluate(GRAB_VIDEO, VISIBLE)
                page.goto(f"{live.url}/jobs/{job_id}")
                expect(page.locator("#live-link.on")).to_have_count(1, timeout=TIMEOUT_MS)
                expect(page.locator("#live-view[data-path=sse]")).to_have_count(1)
                expect(page.locator("#live-link")).to_contain_text("WebRTC refused")
                seen.sse_link = page.locator("#live-link").inner_text()
                seen.sse_why = page.locator("#live-link").get_attribute("title") or ""
                page.evaluate(GRAB_CANVAS)
            finally:
                os.kill(worker.proc.pid, signal.SIGCONT)
            page.on("pageerror", lambda e: seen.errors.append(str(e)))
            drawn, joined = 0, False
            ended = False
            while drawn < 2 * PASSES and not ended:  # every pass of both tiles, or the end
                page.wait_for_function(
                    f"() => Number(document.querySelector('#live-canvas').dataset.passes || 0)"
                    f" > {drawn} || document.querySelector('#live-link').textContent"
                    ".includes('frame done')",
                    timeout=TIMEOUT_MS,
                )
                ended = "frame done" in page.locator("#live-link").inner_text()
                drawn = int(page.locator("#live-canvas").get_attribute("data-passes") or 0)
                if not joined and drawn >= 2:
                    joined = True
                    _late_viewer(browser, context.storage_state(), worker, store.conn, seen,
                                 page)  # fmt: skip
            seen.passes = page.evaluate("window.__livePasses")
            for n, (w, h, rgba) in enumerate(page.evaluate("window.__canvasStates"), 1):
                state = np.asarray(rgba, np.float32).reshape(h, w, 4)[:, :, :3]
                seen.states.append(state)
                Image.fromarray(state.astype(np.uint8)).save(shots / f"converge-{n:02d}.png")
            expect(page.locator("#live-link")).to_contain_text("frame done", timeout=TIMEOUT_MS)
            expect(video.locator("#live-link")).to_contain_text("frame done", timeout=TIMEOUT_MS)
            for n, (w, h, rgba) in enumerate(video.evaluate("window.__videoStates"), 1):
                state = np.asarray(rgba, np.float32).reshape(h, w, 4)[:, :, :3]
                seen.video_states.append(state)
                Image.fromarray(state.astype(np.uint8)).save(shots / f"video-{n:02d}.png")
        finally:
            context.close()
            if video_context is not None:
                video_context.close()
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done")
        seen.live_exr = tmp / "live" / "o" / "frame_0001.exr"
        plain_store, plain_id = submit(worker.settings, blend, tmp / "plain", tiles=TILES,
                                       samples=SAMPLES, project="shorts")  # fmt: skip
        wait_for(plain_store, plain_id, lambda e: e.type == "job_state" and e.state == "done")
        seen.plain_exr = tmp / "plain" / "o" / "frame_0001.exr"
        for opened in (store, plain_store):
            opened.conn.close()
        yield seen
        live.close()
    finally:
        worker.stop()
        conn.flushall()
        conn.close()


#: in the page, each time a pass is drawn on the canvas (live.js counts it in data-passes after
#: drawing): the canvas's pixels. Grabbed there, not screenshot from here: on a loaded machine a
#: screenshot came after the next passes had been drawn, and the test saw only two visibly
#: different states
GRAB_CANVAS = """() => {
  const canvas = document.querySelector('#live-canvas');
  window.__canvasStates = [];
  new MutationObserver(() => {
    const ctx = canvas.getContext('2d');
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    window.__canvasStates.push([canvas.width, canvas.height, Array.from(px)]);
  }).observe(canvas, { attributes: true, attributeFilter: ['data-passes'] });
}"""

#: in the page, at each frame the <video> presents: its pixels, kept when they differ visibly
#: (mean absolute difference above the argument) from the last kept ones
GRAB_VIDEO = """(visible) => {
  const video = document.querySelector('#live-video');
  const canvas = document.createElement('canvas');
  window.__videoStates = [];
  let last = null;
  const grab = () => {
    if (video.videoWidth) {
      canvas.width = video.videoWidth;
      canvas.height = video.videoHeight;
      const ctx = canvas.getContext('2d', { willReadFrequently: true });
      ctx.drawImage(video, 0, 0);
      const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
      let sum = 0;
      for (let i = 0; last && i < px.length; i++) {
        if (i % 4 !== 3) sum += Math.abs(px[i] - last[i]);
      }
      if (!last || sum / (px.length * 0.75) > visible) {
        last = px;
        window.__videoStates.push([canvas.width, canvas.height, Array.from(px)]);
      }
    }
    video.requestVideoFrameCallback(grab);
  };
  video.requestVideoFrameCallback(grab);
}"""


def _queued_unseen(worker: WorkerProcess, blend: Path, out: Path) -> tuple[JobStore, str]:
    """A live-preview job inspected and queued with the worker stopped (SIGSTOP): it takes no
    tile until the caller lets it go on (SIGCONT), so the page can watch from the start."""
    settings = worker.settings
    store = JobStore(jobstore.connect(settings.redis_url), settings.lease_ttl_s)
    q = queue.RenderQueue(queue.connect(settings.redis_url), "cpu")
    source = LocalStorage(settings.storage_dir).put_upload(blend)
    report = submission.inspect(q.conn, q, source, 120, project="shorts")
    req = submission.RenderRequest(output=out / "o", formats="exr", tiles=TILES, samples=SAMPLES,
                                   project="shorts", live_preview=True)  # fmt: skip
    os.kill(worker.proc.pid, signal.SIGSTOP)
    try:
        return store, accept(settings, store, q, req, source, report=report).job_id
    finally:
        q.conn.close()


def _late_viewer(
    browser: Browser,
    state: Any,
    worker: WorkerProcess,
    conn: redis.Redis,
    seen: Watched,
    first: Page,
) -> None:
    """With the worker and its Blender child held still mid-frame (the web shares this
    machine's cores with them here, not on a farm), a second viewer opens the job page."""
    blender = worker.blender_pid()
    os.kill(worker.proc.pid, signal.SIGSTOP)
    os.kill(blender, signal.SIGSTOP)
    try:
        # the first viewer has drawn everything published so far
        _, current = livepreview.snapshot(conn, seen.job_id)
        seen.snapshot_passes = len(current)
        first.wait_for_function(
            "() => window.__livePasses.length > 0 && "
            f"new Set(window.__livePasses.map((p) => p.tile + ':' + p.pass)).size >= "
            f"{sum(p.index for p in current)}",
            timeout=TIMEOUT_MS,
        )
        context = browser.new_context(viewport={"width": 900, "height": 700},
                                      storage_state=state)  # fmt: skip
        try:
            page = context.new_page()
            page.goto(f"{seen.web_url}/jobs/{seen.job_id}")
            page.wait_for_function(
                f"() => window.__livePasses && window.__livePasses.length >= {len(current)}",
                timeout=TIMEOUT_MS,
            )
            # refused WebRTC at the cap, it watches over JPEG/SSE as the first viewer does
            expect(page.locator("#live-link")).to_contain_text("WebRTC refused")
            shown = page.evaluate(
                "() => Math.max(...window.__livePasses.map((p) => p.shown_ms))"
                " - performance.timeOrigin"
            )
            seen.join_ms = float(shown)
            seen.join_loaded_ms = float(
                page.evaluate(
                    "performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd"
                )
            )
            seen.join_passes = int(page.evaluate("window.__livePasses.length"))
            seen.join_same_pixels = bool(np.array_equal(_canvas(page), _canvas(first)))
        finally:
            context.close()
    finally:
        os.kill(blender, signal.SIGCONT)
        os.kill(worker.proc.pid, signal.SIGCONT)


def test_the_page_shows_the_frame_converging(watched: Watched) -> None:
    assert not watched.errors, watched.errors
    # every pass of both tiles reached the page, in order per tile, with growing samples
    for tile in (0, 1):
        got = [(p["pass"], p["samples"]) for p in watched.passes if p["tile"] == tile]
        assert got == [(k, 4 ** (k - 1)) for k in range(1, PASSES + 1)], got
    # and each tile's part of the canvas changed visibly more than once: the page drew a tile
    # converging, not only its last pass (which changes its part once). Measured: 3 changes
    # for the left tile (its first grab already holds pass 1), 4 for the right one
    width = watched.states[0].shape[1]
    for tile in (0, 1):
        part = slice(tile * width // 2, (tile + 1) * width // 2)
        changes = [float(np.abs(after[:, part] - before[:, part]).mean())
                   for before, after in pairwise(watched.states)]  # fmt: skip
        visible = [c for c in changes if c > VISIBLE]
        assert len(visible) >= 2, f"tile {tile}: mean changes {changes}"


def test_the_video_shows_the_frame_converging(watched: Watched) -> None:
    assert not watched.video_errors, watched.video_errors
    assert "WebRTC video" in watched.video_link, watched.video_link
    # the first state is the frame before any pass (the page's background), sent at once
    assert len(watched.video_states) >= 3, f"{len(watched.video_states)} visibly different states"


def test_a_viewer_refused_webrtc_watches_over_sse(watched: Watched) -> None:
    # refused at the cap of one WebRTC viewer a job: the canvas, fed over SSE, shows the frame
    assert "JPEG over SSE (WebRTC refused" in watched.sse_link, watched.sse_link
    assert "1 viewers watch this job over WebRTC" in watched.sse_why, watched.sse_why


def test_a_viewer_joining_mid_frame_sees_its_current_state_at_once(watched: Watched) -> None:
    assert watched.snapshot_passes >= 1
    assert watched.join_passes == watched.snapshot_passes
    assert watched.join_same_pixels, "the late viewer's frame differs from the first viewer's"
    assert watched.join_ms <= JOIN_MS, (
        f"{watched.join_ms:.0f} ms (page loaded at {watched.join_loaded_ms:.0f} ms)"
    )


def test_the_final_frame_equals_a_plain_render(watched: Watched) -> None:
    got, want = exr.read_rgba(watched.live_exr), exr.read_rgba(watched.plain_exr)
    bound = ABSOLUTE_TOLERANCE + RELATIVE_TOLERANCE * np.abs(want)
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


def test_a_member_of_another_project_cannot_watch(
    watched: Watched, redis_server: RedisServer
) -> None:
    url = f"{watched.web_url}/api/jobs/{watched.job_id}/live"
    stranger = member_token(redis_server.url, "otto", "features")
    for headers, status in (({}, 401), ({"Authorization": f"Bearer {stranger}"}, 404)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
        assert refused.value.code == status
        refused.value.close()
    # nor offer for its WebRTC video (or ask for its ICE servers)
    webrtc = f"{watched.web_url}/api/jobs/{watched.job_id}/live/webrtc"
    offer = json.dumps({"type": "offer", "sdp": "v=0"}).encode()
    for method, body in (("GET", None), ("POST", offer)):
        for headers, status in (({}, 401), ({"Authorization": f"Bearer {stranger}"}, 404)):
            req = urllib.request.Request(webrtc, data=body, method=method, headers={
                **headers, "Content-Type": "application/json"})  # fmt: skip
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(req, timeout=10)
            assert refused.value.code == status, (method, headers)
            refused.value.close()
    # a member of the job's project gets the stream
    member = member_token(redis_server.url, "ida", "shorts")
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {member}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        assert resp.readline().startswith(b"event: pass")
