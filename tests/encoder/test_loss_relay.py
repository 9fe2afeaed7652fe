"""The player in headless Chromium through the test's own lossy relay (tests/encoder/udprelay.py):
lost media packets are retransmitted on NACK (RTX), frames' last packets are copied once loss
is reported, and a picture the browser cannot decode is repaired by a keyframe on its PLI, so
the picture never stops for long, and once the path is clean again every frame is current."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Page, Route, sync_playwright

from encoder.service import StreamService
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS, until
from tests.encoder.udprelay import Path, UdpRelay, rewrite_candidates, service_candidate

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]

#: no frame may be missing from the picture longer than this while packets are lost
MAX_FREEZE_S = 0.5

#: every frame Chromium presents: [epoch ms of the callback, latency ms from the stamp]
COLLECT_JS = """
() => {
  const video = document.getElementById("video");
  const canvas = document.createElement("canvas");
  canvas.width = 512; canvas.height = 48;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  window.frames_seen = [];
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
    const shown = performance.timeOrigin + meta.expectedDisplayTime;
    window.frames_seen.push([performance.timeOrigin + now, shown - captureMs]);
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
}
"""


class RelayThread:
    """Relays on an event loop of their own (the Playwright test's loop is not asyncio's)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.relays: list[UdpRelay] = []

    def relay(self, target: tuple[str, int]) -> UdpRelay:
        relay = UdpRelay(target, Path())
        asyncio.run_coroutine_threadsafe(relay.start(), self.loop).result(10)
        self.relays.append(relay)
        return relay

    def impair(self, path: Path) -> None:
        def set_path() -> None:
            for relay in self.relays:
                relay.path = path

        self.loop.call_soon_threadsafe(set_path)

    def close(self) -> None:
        async def close_relays() -> None:
            for relay in self.relays:
                relay.close()
            await asyncio.sleep(0)  # a transport's socket closes on the next loop turn

        asyncio.run_coroutine_threadsafe(close_relays(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def relays() -> Iterator[RelayThread]:
    thread = RelayThread()
    yield thread
    thread.close()


@pytest.fixture
def page() -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1000, "height": 600})
        yield page
        page.close(run_before_unload=True)
        browser.close()


def through_relay(page: Page, relays: RelayThread) -> None:
    """The player's viewer answers come back with the relay's address for candidates."""

    def handle(route: Route) -> None:
        response = route.fetch()
        body: dict[str, Any] = response.json()
        if response.status == 201 or "sdp" in body:
            relay = relays.relay(service_candidate(body["sdp"]))
            body["sdp"] = rewrite_candidates(body["sdp"], relay.address)
        route.fulfill(response=response, json=body)

    page.route("**/api/streams/sessions/*/viewers", handle)


@pytest.mark.parametrize("loss", [0.01, 0.05])
def test_loss_never_freezes_the_player_and_its_picture_is_current_after(
    stream_service: StreamService, page: Page, relays: RelayThread, loss: float
) -> None:
    through_relay(page, relays)
    page.goto(
        f"{stream_service.url}/player?app=testpattern&width=640&height=360&fps=30&autostart=1"
        f"&token={tokens.operator()}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.stats.frames_decoded > 0"), timeout=TIMEOUT_MS
    )
    assert relays.relays, "the player's answer did not go through the relay"
    page.evaluate(COLLECT_JS)
    # measuring windows (clean, lossy, clean again), not synchronisation
    clean_from = time.time()
    page.wait_for_timeout(1500)
    lossy_from = time.time()
    relays.impair(Path(loss=loss, seed=7))
    page.wait_for_timeout(4000)
    relays.impair(Path())
    lossy_to = time.time()
    page.wait_for_timeout(2000)
    records = [(t / 1000, lat) for t, lat in page.evaluate("window.frames_seen")]
    dropped = sum(r.dropped for r in relays.relays)
    viewers = page.request.get(
        f"{stream_service.url}/api/streams/sessions/{page.evaluate('tessera.sessionId')}",
        headers=tokens.operator_headers(),
    ).json()["viewers"]

    assert dropped >= 1, "the relay lost no packet: nothing was tested"
    # the browser asked for what was lost, and from then on each frame's last packet was copied
    (viewer,) = viewers
    assert viewer["nacked_packets"] >= 1 and viewer["tail_copies"] >= 1, viewer
    clean = [lat for t, lat in records if clean_from <= t < lossy_from]
    times = [lossy_from] + [t for t, _ in records if lossy_from <= t <= lossy_to] + [lossy_to]
    freeze_s = max(b - a for a, b in itertools.pairwise(times))
    calm = [t for t, _ in records if clean_from <= t < lossy_from]
    calm_s = max(b - a for a, b in itertools.pairwise(calm))
    assert freeze_s <= MAX_FREEZE_S, (
        f"the picture stopped {freeze_s:.2f} s at {loss:.0%} loss ({calm_s:.2f} s on the clean "
        f"path; {page.evaluate('JSON.stringify(tessera.stats)')}; {viewers})"
    )
    after = [lat for t, lat in records if t > lossy_to + 1.0]
    assert len(after) >= 15, f"{len(after)} frames in the last second, once the path was clean"
    # current: as fresh as on the clean path (a backlog would show as a higher latency)
    assert statistics.median(after) <= 2 * statistics.median(clean) + 20, (
        statistics.median(after),
        statistics.median(clean),
    )
