"""The player's latency overlay in a real headless Chromium: off until the user turns it on, then
a live figure that agrees with the latency measured off the picture itself; and the browser
holds no frame back (playout delay zero)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from encoder.app import running
from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS, until

OPERATOR = tokens.operator()

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]

#: capture -> expected display (ms) of ``count`` frames, from the test pattern's stamp (the
#: capture time, epoch microseconds, in rows 1 and 2) read off each frame Chromium presents
MEASURE_JS = """
(count) => new Promise((resolve) => {
  const video = document.getElementById("video");
  const canvas = document.createElement("canvas");
  canvas.width = 512; canvas.height = 48;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  const out = [];
  const word = (px, row) => {
    let value = 0;
    for (let i = 31; i >= 0; i--) {
      const at = ((row * 16 + 8) * 512 + i * 16 + 8) * 4;
      value = value * 2 + (px[at] + px[at + 1] + px[at + 2] >= 384 ? 1 : 0);
    }
    return value;
  };
  const onFrame = (now, meta) => {
    ctx.drawImage(video, 0, 0, 512, 48, 0, 0, 512, 48);
    const px = ctx.getImageData(0, 0, 512, 48).data;
    const captureMs = (word(px, 1) + word(px, 2) * 4294967296) / 1000;
    out.push(performance.timeOrigin + meta.expectedDisplayTime - captureMs);
    if (out.length >= count) resolve(out); else video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
})
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[StreamService]:
    settings = Settings().with_(
        redis_url=redis_server.url,
        work_dir=tmp_path_factory.mktemp("stream-work"),
        stream_port=0,
        cpu_encode_sessions=2,
        stream_grace_s=2.0,
        stream_secret=tokens.STREAM_SECRET,
    )
    with running(settings) as svc:
        yield svc


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as pw:
        browser: Browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 800})
        yield page
        page.close(run_before_unload=True)
        browser.close()


@pytest.mark.parametrize("transport", ["webrtc", "ws"])
def test_the_latency_overlay_is_off_until_asked_and_then_agrees_with_the_picture(
    service: StreamService, page: Page, transport: str
) -> None:
    page.goto(
        f"{service.url}/player?app=testpattern&width=1280&height=720&fps=30&autostart=1"
        f"&token={OPERATOR}&transport={transport}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.stats.frames_decoded > 0"), timeout=TIMEOUT_MS
    )
    assert page.locator("#latency").is_hidden()

    page.click("#latency-toggle")
    assert page.get_attribute("#latency-toggle", "aria-pressed") == "true"
    # every part in: the service's (from a pong), the network's, the browser's (60 frames)
    page.wait_for_function(until("tessera.stats.latency_ms !== null"), timeout=TIMEOUT_MS)
    page.evaluate(MEASURE_JS, 60)
    shown = page.text_content("#latency") or ""
    assert re.fullmatch(
        r"latency [\d.]+ ms · service [\d.]+ · network [\d.]+ · browser -?[\d.]+", shown
    ), shown

    # against the picture: the same seconds, capture time read off the decoded frames
    overlay, measured = [], []
    for _ in range(5):
        page.wait_for_function(until("tessera.stats.service_ms !== null"), timeout=TIMEOUT_MS)
        measured.append(statistics.median(page.evaluate(MEASURE_JS, 30)))
        overlay.append(float(page.evaluate("tessera.stats.latency_ms")))
    # pair by pair: the overlay's figure is the last stats second's, read after the picture's
    # window, so it may still be the second before that window: each is compared with its own
    # window's picture or the one before, whichever is nearer (a fresh-clone CI run: picture
    # 5, 21, 21, 5, 21 ms as the refresh phase stepped, overlay 6, 7, 22, 22, 5). Where the
    # picture's own latency moved from second to second by more than the bound (a loaded
    # machine: 29 to 65 ms over three seconds in another), half that move is allowed: a
    # second's figure cannot follow it closer
    real = statistics.median(measured)
    apart = statistics.median(
        min(abs(o - m) for m in measured[max(0, i - 1) : i + 1]) for i, o in enumerate(overlay)
    )
    moved = max(measured) - min(measured)
    bound = max(8.0, 0.25 * real, moved / 2)
    assert apart <= bound, f"overlay {overlay} ms, picture {measured} ms"
    print(f"{transport}: overlay {overlay} ms, picture {measured} ms")
    if transport == "ws":
        assert page.evaluate("tessera.transport") == "websocket"
        page.click("#latency-toggle")
        assert page.locator("#latency").is_hidden()
        return
    # the playout-delay extension (min = max = 0): Chromium holds no frame back to smooth
    # playback (without it, its jitter buffer held each frame 22-29 ms here)
    held_ms = page.evaluate("tessera.stats.jitter_buffer_ms")
    assert held_ms is not None and held_ms < 5, f"jitter buffer {held_ms} ms"

    page.click("#latency-toggle")
    assert page.locator("#latency").is_hidden()


#: each WebSocket picture message's arrival, by its frame's timestamp (µs), recorded by a
#: listener the page's own handler runs after, in the same task
ARRIVALS_JS = """
(() => {
  window.arrivals = new Map();
  const Native = window.WebSocket;
  window.WebSocket = class extends Native {
    constructor(...args) {
      super(...args);
      this.addEventListener("message", (event) => {
        if (typeof event.data === "string" || event.data.byteLength < 10) return;
        const view = new DataView(event.data);
        if (view.getUint8(0) !== 1 || (view.getUint8(1) & 2) === 2) return;
        window.arrivals.set(Number(view.getBigUint64(2)), performance.now());
      });
    }
  };
})();
"""

#: message arrival -> expected display (ms) of ``count`` frames, each by its own timestamp
BROWSER_JS = """
(count) => new Promise((resolve) => {
  const video = document.getElementById("video");
  const out = [];
  const onFrame = (now, meta) => {
    const arrived = window.arrivals.get(Math.round(meta.mediaTime * 1e6));
    if (arrived !== undefined) out.push(meta.expectedDisplayTime - arrived);
    if (out.length >= count) resolve(out); else video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
})
"""


def test_over_the_websocket_the_browsers_share_runs_from_each_frames_own_message(
    service: StreamService, page: Page
) -> None:
    """A frame's video callback may run after the next frame was decoded (a fresh-clone CI run
    showed "browser -11.2": the next frame's arrival taken for each): the overlay's browser
    share must agree with the one measured here frame by frame, by each frame's timestamp."""
    page.add_init_script(ARRIVALS_JS)
    page.goto(
        f"{service.url}/player?app=testpattern&width=1280&height=720&fps=30&autostart=1"
        f"&token={OPERATOR}&transport=ws"
    )
    page.wait_for_function(
        until("window.tessera && tessera.stats.frames_decoded > 0"), timeout=TIMEOUT_MS
    )
    page.click("#latency-toggle")
    overlay, measured = [], []
    for _ in range(5):
        page.wait_for_function(until("tessera.stats.browser_ms !== null"), timeout=TIMEOUT_MS)
        measured.append(statistics.median(page.evaluate(BROWSER_JS, 30)))
        overlay.append(float(page.evaluate("tessera.stats.browser_ms")))
    # as above: each reading against its own window or the one before, whichever is nearer.
    # The overlay may go below zero only where the picture's own measure does: beside a process
    # busy 70 % of the time one window measured -7.4 ms frame by frame (Chromium's expected
    # display time came before the message listener's time), and the overlay showed the same
    apart = statistics.median(
        min(abs(o - m) for m in measured[max(0, i - 1) : i + 1]) for i, o in enumerate(overlay)
    )
    below = min(0.0, min(measured) - 1.0)  # 1 ms: the overlay is rounded, a second apart
    assert min(overlay) >= below and apart <= max(5.0, (max(measured) - min(measured)) / 2), (
        f"overlay {overlay} ms, measured {measured} ms"
    )
    print(f"browser share: overlay {overlay} ms, measured {measured} ms")
