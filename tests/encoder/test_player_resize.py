"""The player asks the session's display to take its picture area's size whenever the area
settles at a new size (the window, or the page's own layout, changed it), once per settled
change: in a real headless Chromium against a running stream service, read back from the service
(the display's size, the video it sends) and from a probe app that reports what it sees
(encoder/probeapp.py)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page

from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, TIMEOUT_MS, until
from tests.encoder.test_player_chromium import end_session

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]

#: how long the picture area stays put before the player asks (player.js RESIZE_SETTLE_MS)
SETTLE_MS = 250

#: when the page's layout engine saw the picture area change (performance.now(), ms), from here on
#: (``stageChanges.length = 0`` starts the list anew). It resolves once the observer has made its
#: first call, the size it found (not a change): a change made before that call would be taken for
#: the starting size, and a loaded machine can make that call late.
WATCH_STAGE_JS = """
() => new Promise((watching) => {
  window.stageChanges = [];
  let first = true;
  new ResizeObserver(() => {
    if (first) watching();
    else stageChanges.push(performance.now());
    first = false;
  }).observe(document.getElementById("stage"));
})
"""

#: the stats panel dragged wider over `steps` displayed frames (the window stays as it is)
DRAG_STATS_JS = """
async (steps) => {
  const stats = document.getElementById("stats");
  const from = stats.getBoundingClientRect().width;
  for (let i = 1; i <= steps; i++) {
    await new Promise(requestAnimationFrame);
    stats.style.width = `${from + 12 * i}px`;
  }
}
"""

#: the picture area in device pixels, as the player measures it (even, at least 64)
AREA_JS = """
() => {
  const stage = document.getElementById("stage"), scale = window.devicePixelRatio || 1;
  const even = (v) => Math.max(64, Math.floor((v * scale) / 2) * 2);
  return [even(stage.clientWidth), even(stage.clientHeight)];
}
"""


@pytest.fixture
def stream_settings(stream_settings: Settings, tmp_path: Path) -> Settings:
    """The package's stream settings, with the probe app and room to resize its display."""
    apps = tmp_path / "apps.json"
    probe = {"name": "probe", "command": [sys.executable, "-m", "encoder.probeapp"]}
    apps.write_text(json.dumps([probe]))
    return stream_settings.with_(
        work_dir=tmp_path,
        stream_apps=apps,
        stream_grace_s=2.0,
        stream_resize_max_width=1280,
        stream_resize_max_height=1024,
    )


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    page = browser.new_page(viewport={"width": 800, "height": 600})
    yield page
    page.close(run_before_unload=True)


def _wait(done: Callable[[], bool], timeout_s: float = TIMEOUT_MS / 1000) -> None:
    """Until ``done()`` (the service's state, read from its own thread), or fail."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not done():
        assert time.monotonic() < deadline, "timed out"
        tick.wait(0.02)


def _settled_changes(page: Page) -> int:
    """How many times the picture area settled since WATCH_STAGE_JS: one, plus one for each
    pause of SETTLE_MS or more between two of its changes (a machine slow enough to pause)."""
    changes = page.evaluate("stageChanges")
    assert changes, "the picture area did not change"
    return 1 + sum(1 for a, b in pairwise(changes) if b - a >= SETTLE_MS)


def _displays(service: StreamService, sid: str, page: Page, size: list[int]) -> None:
    """The session's display, its app and the video it sends are all at ``size`` now."""
    width, height = size
    _wait(lambda: service.sessions[sid].control.screen == (width, height))
    page.wait_for_function(
        until(
            f"tessera.clipboard === 'size:{width}x{height}' && video.videoWidth === {width}"
            f" && video.videoHeight === {height}"
        ),
        timeout=TIMEOUT_MS,
    )
    state = page.request.get(
        f"{service.url}/api/streams/sessions/{sid}", headers=tokens.operator_headers()
    ).json()
    assert [state["width"], state["height"]] == size


def test_the_display_follows_the_picture_area_once_per_settled_change(
    stream_service: StreamService, page: Page
) -> None:
    service = stream_service
    page.goto(
        f"{service.url}/player?app=probe&width=320&height=240&fps=30&autostart=1"
        f"&token={tokens.operator()}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.controlling && tessera.stats.frames_decoded > 0"),
        timeout=TIMEOUT_MS,
    )
    sid = str(page.evaluate("tessera.sessionId"))
    try:
        # a session starts at the size it was started with, whatever the picture area
        assert page.evaluate("tessera.resizesSent") == 0
        assert page.evaluate("tessera.error") is None
        assert service.sessions[sid].control.screen == (320, 240)

        # the window changes: one resize, to the picture area's size
        page.evaluate(WATCH_STAGE_JS)
        page.set_viewport_size({"width": 900, "height": 700})
        page.wait_for_function(until("tessera.resizesSent >= 1"), timeout=TIMEOUT_MS)
        area = page.evaluate(AREA_JS)
        assert page.evaluate("tessera.askedSize") == area
        _displays(service, sid, page, area)
        assert page.evaluate("tessera.resizesSent") == _settled_changes(page) == 1

        # the page's layout changes it, frame after frame, in a window that stays put: the
        # display follows once it settles, and not at each frame
        page.evaluate("stageChanges.length = 0")
        page.evaluate(DRAG_STATS_JS, 8)
        final = page.evaluate(AREA_JS)
        assert final[0] < area[0]
        page.wait_for_function(
            until(f"tessera.askedSize[0] === {final[0]} && tessera.askedSize[1] === {final[1]}"),
            timeout=TIMEOUT_MS,
        )
        _displays(service, sid, page, final)
        assert page.evaluate("tessera.resizesSent") == 1 + _settled_changes(page)
    finally:
        end_session(page, service)
