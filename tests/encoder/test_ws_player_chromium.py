"""The player over the WebSocket + WebCodecs fallback in a real headless Chromium: forced by
the URL, and chosen by itself when WebRTC cannot connect (UDP blocked); frames of the right
size decode, clicks and keys land in the game, and the round trip is shown as over WebRTC."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, Playwright, Request, Route, sync_playwright

from encoder.app import running
from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS, until
from tests.encoder.test_player_chromium import FIND_SPRITE_JS, OPERATOR, end_session


def no_candidates(sdp: str) -> str:
    """An SDP without its ICE candidates: a peer with none to try (UDP blocked, no TURN)."""
    return re.sub(r"^a=candidate:.*\r?\n", "", sdp, flags=re.MULTILINE)


def block_ice(route: Route, request: Request) -> None:
    """Both ends of the WebRTC join lose their candidates: ICE can never connect."""
    body = request.post_data_json
    assert isinstance(body, dict)
    body["sdp"] = no_candidates(body["sdp"])
    response = route.fetch(post_data=json.dumps(body))
    answer = response.json()
    if "sdp" in answer:
        answer["sdp"] = no_candidates(answer["sdp"])
    route.fulfill(response=response, json=answer)


pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[StreamService]:
    settings = Settings().with_(
        redis_url=redis_server.url.rsplit("/", 1)[0] + "/2",
        work_dir=tmp_path_factory.mktemp("stream-ws"),
        stream_port=0,
        cpu_encode_sessions=4,
        stream_grace_s=2.0,
        stream_secret=tokens.STREAM_SECRET,
    )
    with running(settings) as svc:
        yield svc


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as pw:
        yield pw


def launch(playwright: Playwright, args: list[str]) -> Browser:
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=args)


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    chromium = launch(playwright, CHROMIUM_ARGS)
    yield chromium
    chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    yield page
    page.close(run_before_unload=True)


def plays_the_game_and_takes_input(page: Page, width: int, height: int) -> None:
    page.wait_for_function(
        until(
            f"tessera.state === 'playing' && tessera.stats.frames_decoded > 0 &&"
            f" tessera.frameWidth === {width} && video.videoWidth === {width}"
        ),
        timeout=TIMEOUT_MS,
    )
    assert page.evaluate("[tessera.frameWidth, tessera.frameHeight]") == [width, height]
    assert page.evaluate("[video.videoWidth, video.videoHeight]") == [width, height]
    page.wait_for_function(until(f"({FIND_SPRITE_JS})() !== null"), timeout=TIMEOUT_MS)
    start = page.evaluate(FIND_SPRITE_JS)
    page.locator("#video").focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        until(
            f"(() => {{ const p = ({FIND_SPRITE_JS})(); return p && p[0] > {start[0] + 12}; }})()"
        ),
        timeout=TIMEOUT_MS,
    )
    # latency is reported as over WebRTC: the input channel's round trip, fps, bitrate
    page.wait_for_function(
        until(
            "tessera.stats.ping_ms !== null && tessera.stats.fps > 0"
            " && tessera.stats.bitrate_kbps > 0"
        ),
        timeout=TIMEOUT_MS,
    )
    assert re.fullmatch(r"\d+(\.\d+)? ms", page.text_content("#s-ping") or "")
    assert page.evaluate("tessera.transport") == "websocket"


def test_the_forced_websocket_path_plays_the_game_and_its_keys_move_the_sprite(
    service: StreamService, page: Page
) -> None:
    page.goto(
        f"{service.url}/player?app=game&width=640&height=480&fps=30&autostart=1"
        f"&transport=ws&token={OPERATOR}"
    )
    plays_the_game_and_takes_input(page, 640, 480)
    sid = page.evaluate("tessera.sessionId")
    state = page.request.get(
        f"{service.url}/api/streams/sessions/{sid}", headers=tokens.operator_headers()
    ).json()
    assert [v["transport"] for v in state["viewers"]] == ["websocket"]
    end_session(page, service)


def test_when_ice_cannot_connect_the_player_falls_back_to_the_websocket_by_itself(
    service: StreamService, page: Page
) -> None:
    page.route("**/viewers", block_ice)
    page.goto(
        f"{service.url}/player?app=game&width=320&height=240&fps=30&autostart=1&token={OPERATOR}"
    )
    plays_the_game_and_takes_input(page, 320, 240)
    sid = page.evaluate("tessera.sessionId")
    state = page.request.get(
        f"{service.url}/api/streams/sessions/{sid}", headers=tokens.operator_headers()
    ).json()
    # the WebRTC viewer that never connected was left, not kept
    assert [v.get("transport", "webrtc") for v in state["viewers"]] == ["websocket"]
    end_session(page, service)
