"""The player page in a real headless Chromium against a running stream service: it starts a
session, plays it at the asked size, shows live stats, and its clicks land where they point."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page

from encoder.app import running
from encoder.gamepad import SHIM, UINPUT
from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, FAKE_PAD_JS, TIMEOUT_MS, until

OPERATOR = tokens.operator()


pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]

#: the test pattern's stamp (encoder/testpattern.py), read from the playing video via a canvas
READ_STAMP_JS = """
() => {
  const video = document.getElementById("video");
  const canvas = document.createElement("canvas");
  canvas.width = 512; canvas.height = 48;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.drawImage(video, 0, 0, 512, 48, 0, 0, 512, 48);
  const px = ctx.getImageData(0, 0, 512, 48).data;
  let counter = 0;
  for (let i = 31; i >= 0; i--) {
    const at = (8 * 512 + i * 16 + 8) * 4;
    counter = counter * 2 + (px[at] + px[at + 1] + px[at + 2] >= 384 ? 1 : 0);
  }
  return counter;
}
"""
#: where the game's pure-green sprite is in the video's own pixels (its centre), or null
FIND_SPRITE_JS = """
() => {
  const video = document.getElementById("video");
  const w = video.videoWidth, h = video.videoHeight;
  const canvas = document.createElement("canvas");
  canvas.width = w; canvas.height = h;
  const ctx = canvas.getContext("2d", { willReadFrequently: true });
  ctx.drawImage(video, 0, 0);
  const px = ctx.getImageData(0, 0, w, h).data;
  let n = 0, sx = 0, sy = 0;
  for (let y = 0; y < h; y += 2) for (let x = 0; x < w; x += 2) {
    const at = (y * w + x) * 4;
    if (px[at + 1] > 180 && px[at] < 90 && px[at + 2] < 90) { n++; sx += x; sy += y; }
  }
  return n ? [sx / n, sy / n] : null;
}
"""


#: every button of the page's pad let go (FAKE_PAD_JS's pad)
RELEASE_PAD_JS = """
() => {
  const pad = navigator.getGamepads()[0];
  pad.buttons = pad.buttons.map(() => ({ pressed: false, touched: false, value: 0 }));
  pad.timestamp += 1;
}
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[StreamService]:
    settings = Settings().with_(
        redis_url=redis_server.url,
        work_dir=tmp_path_factory.mktemp("stream-work"),
        stream_port=0,
        cpu_encode_sessions=4,
        stream_grace_s=2.0,
        stream_secret=tokens.STREAM_SECRET,
    )
    with running(settings) as svc:
        yield svc


@pytest.fixture(scope="module")
def full_service(
    tmp_path_factory: pytest.TempPathFactory, redis_server: Any
) -> Iterator[StreamService]:
    """A service whose device can never hold a session (each wants more memory than it has);
    on a Redis database of its own so its device does not meet the other service's."""
    settings = Settings().with_(
        redis_url=redis_server.url.rsplit("/", 1)[0] + "/1",
        work_dir=tmp_path_factory.mktemp("stream-full"),
        stream_port=0,
        stream_vram_mib=1 << 40,
        stream_secret=tokens.STREAM_SECRET,
    )
    with running(settings) as svc:
        yield svc


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    # wider than 16:9, so the picture is letterboxed and clicks must be mapped, not copied
    page = browser.new_page(viewport={"width": 1500, "height": 700})
    yield page
    page.close(run_before_unload=True)


def test_player_starts_a_720p_session_and_plays_it(
    service: StreamService, page: Page, tmp_path: Path
) -> None:
    page.goto(
        f"{service.url}/player?app=testpattern&width=1280&height=720&fps=30&autostart=1&token={OPERATOR}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.stats.frames_decoded > 0 && tessera.frameWidth > 0"),
        timeout=TIMEOUT_MS,
    )
    state = page.evaluate(
        "({state: tessera.state, w: tessera.frameWidth, h: tessera.frameHeight,"
        " vw: video.videoWidth, vh: video.videoHeight, session: tessera.sessionId,"
        " role: tessera.role})"
    )
    assert (state["w"], state["h"]) == (1280, 720)
    assert (state["vw"], state["vh"]) == (1280, 720)
    assert state["state"] == "playing" and state["role"] == "player"
    # a reload of the page rejoins the same session: its id is in the address now
    assert f"session={state['session']}" in page.url

    # the picture is live: the test pattern's frame counter moves on
    first = page.evaluate(READ_STAMP_JS)
    page.wait_for_function(until(f"({READ_STAMP_JS})() > {first}"), timeout=TIMEOUT_MS)

    # the stats panel fills in: frame rate, bitrate, decode time, data-channel round trip
    page.wait_for_function(
        until(
            "tessera.stats.fps > 0 && tessera.stats.bitrate_kbps > 0 &&"
            " tessera.stats.decode_ms !== null && tessera.stats.ping_ms !== null"
        ),
        timeout=TIMEOUT_MS,
    )
    assert page.text_content("#s-res") == "1280\u00d7720"
    assert re.fullmatch(r"\d+(\.\d+)? ms", page.text_content("#s-ping") or "")
    assert "H264" in (page.evaluate("tessera.stats.codec") or "")
    shot = tmp_path / "player.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    end_session(page, service)


def end_session(page: Page, service: StreamService) -> None:
    """The "End session" button: the session is gone from the service, its programs stopped."""
    sid = page.evaluate("tessera.sessionId")
    page.click("#end")
    page.wait_for_function(until("tessera.state === 'closed'"), timeout=TIMEOUT_MS)
    ended = page.request.get(
        f"{service.url}/api/streams/sessions/{sid}", headers=tokens.operator_headers()
    ).json()
    assert ended["state"] == "ended"


def _play_game(service: StreamService, page: Page) -> None:
    """The built-in game at 640x480 in the player, until its sprite shows."""
    page.goto(
        f"{service.url}/player?app=game&width=640&height=480&fps=30&autostart=1&token={OPERATOR}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.stats.frames_decoded > 0 && video.videoWidth === 640"),
        timeout=TIMEOUT_MS,
    )
    page.wait_for_function(until(f"({FIND_SPRITE_JS})() !== null"), timeout=TIMEOUT_MS)


def test_a_click_in_the_letterboxed_player_lands_on_that_pixel_of_the_game(
    service: StreamService, page: Page
) -> None:
    _play_game(service, page)
    box = page.locator("#video").bounding_box()
    assert box is not None
    # the video's pixel (480, 120), through the page's letterboxing (object-fit: contain)
    scale = min(box["width"] / 640, box["height"] / 480)
    left = box["x"] + (box["width"] - 640 * scale) / 2
    top = box["y"] + (box["height"] - 480 * scale) / 2
    page.mouse.click(left + 480.5 * scale, top + 120.5 * scale)
    page.wait_for_function(
        until(
            f"(() => {{ const p = ({FIND_SPRITE_JS})();"
            " return p && Math.abs(p[0] - 480) < 6 && Math.abs(p[1] - 120) < 6; })()"
        ),
        timeout=TIMEOUT_MS,
    )
    # and the arrow keys move it: one step to the left
    page.keyboard.press("ArrowLeft")
    page.wait_for_function(
        until(f"(() => {{ const p = ({FIND_SPRITE_JS})(); return p && p[0] < 470; }})()"),
        timeout=TIMEOUT_MS,
    )
    end_session(page, service)


def test_a_gamepad_steers_the_game_while_held(service: StreamService, page: Page) -> None:
    """The page's pad reaches the sandboxed game's /dev/input/js0 (uinput's controller, or the
    pad shim's where the host has none): the d-pad held right moves the sprite right, and it
    stops when let go."""
    assert UINPUT.exists() or SHIM.is_file(), "no uinput, and the pad shim is not built (.ci/setup)"
    page.add_init_script(FAKE_PAD_JS)
    _play_game(service, page)
    start = page.evaluate(FIND_SPRITE_JS)
    page.evaluate("window.plugPad()")
    page.wait_for_function(until("tessera.gamepadsSent >= 1"), timeout=TIMEOUT_MS)
    page.evaluate("window.movePad(15, 0)")  # the d-pad's right, held
    page.wait_for_function(
        until(
            f"(() => {{ const p = ({FIND_SPRITE_JS})(); return p && p[0] > {start[0] + 60}; }})()"
        ),
        timeout=TIMEOUT_MS,
    )
    assert abs(page.evaluate(FIND_SPRITE_JS)[1] - start[1]) < 4  # straight right
    sent = page.evaluate("tessera.gamepadsSent")  # before the release: the page may send it at once
    page.evaluate(RELEASE_PAD_JS)
    page.wait_for_function(until(f"tessera.gamepadsSent > {sent}"), timeout=TIMEOUT_MS)
    page.wait_for_timeout(300)  # what was on its way lands
    stopped = page.evaluate(FIND_SPRITE_JS)
    page.wait_for_timeout(500)
    assert page.evaluate(FIND_SPRITE_JS) == stopped
    end_session(page, service)


def test_a_refused_session_shows_why(full_service: StreamService, page: Page) -> None:
    page.goto(f"{full_service.url}/player?app=testpattern&autostart=1&token={OPERATOR}")
    page.wait_for_function(until("tessera.error !== null"), timeout=TIMEOUT_MS)
    error = page.evaluate("tessera.error")
    assert error["code"] == "never_fits"
    assert page.is_visible("#error")
    text = page.text_content("#error") or ""
    assert text.startswith("This session can never start on this device"), text
    assert error["message"] in text
    assert page.evaluate("tessera.state") == "refused"
    assert page.is_hidden("#video") or page.evaluate("video.videoWidth") == 0


#: counts what the page sends on the input channel, pings aside
COUNT_SENDS_JS = """
window.inputSent = 0;
const send = RTCDataChannel.prototype.send;
RTCDataChannel.prototype.send = function (message) {
  if (!String(message).includes('"ping"')) window.inputSent++;
  return send.call(this, message);
};
"""


def test_a_spectator_sends_nothing_until_it_takes_control(
    service: StreamService, page: Page, browser: Browser
) -> None:
    page.goto(
        f"{service.url}/player?app=game&width=640&height=480&fps=30&autostart=1&token={OPERATOR}"
    )
    page.wait_for_function(until("tessera.controlling && tessera.sessionId"), timeout=TIMEOUT_MS)
    sid = page.evaluate("tessera.sessionId")
    spectator = browser.new_page(viewport={"width": 1000, "height": 700})
    try:
        spectator.add_init_script(COUNT_SENDS_JS)
        # a project member's token, joining as spectator (they may take control)
        spectator.goto(
            f"{service.url}/player?session={sid}&role=spectator&token={tokens.viewer(sid)}"
        )
        spectator.wait_for_function(
            until(f"tessera.stats.frames_decoded > 0 && ({FIND_SPRITE_JS})() !== null"),
            timeout=TIMEOUT_MS,
        )
        assert spectator.evaluate("[tessera.role, tessera.controlling]") == ["spectator", False]
        assert spectator.is_visible("#control")
        start = spectator.evaluate(FIND_SPRITE_JS)
        spectator.locator("#video").click()
        spectator.keyboard.press("ArrowRight")
        assert spectator.evaluate("window.inputSent") == 0

        spectator.click("#control")
        spectator.wait_for_function(until("tessera.controlling"), timeout=TIMEOUT_MS)
        assert spectator.is_hidden("#control")
        spectator.locator("#video").focus()
        spectator.keyboard.press("ArrowRight")
        spectator.wait_for_function(
            until(
                f"(() => {{ const p = ({FIND_SPRITE_JS})(); "
                f"return p && p[0] > {start[0] + 12}; }})()"
            ),
            timeout=TIMEOUT_MS,
        )
    finally:
        spectator.close(run_before_unload=True)
    end_session(page, service)
