"""Session features in a real headless Chromium against a running stream service and its
player: the clipboard both ways (the controlling viewer only), the display resized to the
player's size (read back from a probe app, encoder/probeapp.py, that reports what it
receives), files into and out of the session's home, recording to the project's storage,
gamepads from the page to the app (read back from the probe app too; this
headless Chromium has no pad: the page's Gamepad API is given one)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import av
import pytest
from playwright.sync_api import Browser, FilePayload, Page

from encoder.app import running
from encoder.gamepad import SHIM, UINPUT, PadState
from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, FAKE_PAD_JS, TIMEOUT_MS, until
from tests.encoder.test_player_chromium import end_session

OPERATOR = tokens.operator()
#: the largest a viewer may resize the test service's displays to
MAX_SIZE = (1024, 576)

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]

#: what the user pastes into the page (Ctrl+V): a paste event with the text on it
PASTE_JS = """
(text) => {
  const data = new DataTransfer();
  data.setData("text/plain", text);
  window.dispatchEvent(new ClipboardEvent("paste", { clipboardData: data }));
}
"""

#: every text the page is given from here on, in order
RECORD_CLIPS_JS = """
() => {
  window.clips = [];
  let value = tessera.clipboard;
  Object.defineProperty(tessera, "clipboard", {
    get() { return value; },
    set(text) { value = text; window.clips.push(text); },
  });
}
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[StreamService]:
    work = tmp_path_factory.mktemp("stream-features")
    apps = work / "apps.json"
    probe = {"name": "probe", "command": [sys.executable, "-m", "encoder.probeapp"]}
    apps.write_text(json.dumps([probe]))
    settings = Settings().with_(
        redis_url=redis_server.url.rsplit("/", 1)[0] + "/2",
        work_dir=work,
        storage_dir=work / "storage",
        stream_port=0,
        stream_apps=apps,
        cpu_encode_sessions=4,
        stream_grace_s=2.0,
        stream_secret=tokens.STREAM_SECRET,
        stream_resize_max_width=MAX_SIZE[0],
        stream_resize_max_height=MAX_SIZE[1],
        stream_file_max_mib=1,
    )
    with running(settings) as svc:
        yield svc


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    page = browser.new_page(viewport={"width": 800, "height": 600})
    yield page
    page.close(run_before_unload=True)


def _play_probe(service: StreamService, page: Page, size: str = "320x240") -> str:
    width, height = size.split("x")
    page.goto(
        f"{service.url}/player?app=probe&width={width}&height={height}&fps=30&autostart=1"
        f"&token={OPERATOR}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.controlling && tessera.stats.frames_decoded > 0"),
        timeout=TIMEOUT_MS,
    )
    return str(page.evaluate("tessera.sessionId"))


def test_clipboard_goes_both_ways_for_the_controlling_viewer(
    service: StreamService, browser: Browser, page: Page
) -> None:
    sid = _play_probe(service, page)
    # the user pastes into the page: the app reads it, and what the app copies comes back
    page.evaluate(PASTE_JS, "hello, clipboard ✓")
    page.wait_for_function(
        until("tessera.clipboard === 'echo:hello, clipboard ✓'"), timeout=TIMEOUT_MS
    )
    page.evaluate("tessera.paste('second')")
    page.wait_for_function(until("tessera.clipboard === 'echo:second'"), timeout=TIMEOUT_MS)

    spectator = browser.new_page(viewport={"width": 640, "height": 480})
    try:
        spectator.goto(
            f"{service.url}/player?session={sid}&role=spectator&token={tokens.viewer(sid)}"
        )
        spectator.wait_for_function(
            until(
                "window.tessera && tessera.role === 'spectator' && tessera.stats.frames_decoded > 0"
            ),
            timeout=TIMEOUT_MS,
        )
        page.evaluate(RECORD_CLIPS_JS)
        # a spectator's paste reaches nobody, and it is not told what the app copies
        assert spectator.evaluate("tessera.paste('from a spectator')") is False
        denied = service.sessions[sid].control.denied
        spectator.evaluate("tessera.send({t: 'clip', text: 'sneaked'})")
        _wait(lambda: service.sessions[sid].control.denied > denied)
        page.evaluate("tessera.paste('third')")
        page.wait_for_function(until("tessera.clipboard === 'echo:third'"), timeout=TIMEOUT_MS)
        assert spectator.evaluate("tessera.clipboard") is None
        assert page.evaluate("window.clips") == ["echo:third"]
    finally:
        spectator.close(run_before_unload=True)
    end_session(page, service)


def _wait(done: Callable[[], bool], timeout_s: float = TIMEOUT_MS / 1000) -> None:
    """Until ``done()`` (the service's state, read from its own thread), or fail."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not done():
        assert time.monotonic() < deadline, "timed out"
        tick.wait(0.02)


def test_the_display_takes_the_players_size_within_the_limit(
    service: StreamService, page: Page
) -> None:
    _play_probe(service, page)
    assert page.evaluate("[tessera.frameWidth, tessera.frameHeight]") == [320, 240]
    # the window changes: the app's screen and the decoded video take the picture area's size
    page.set_viewport_size({"width": 700, "height": 500})
    page.wait_for_function(until("tessera.askedSize !== null"), timeout=TIMEOUT_MS)
    width, height = page.evaluate("tessera.askedSize")
    assert (width, height) != (320, 240) and width <= MAX_SIZE[0] and height <= MAX_SIZE[1]
    page.wait_for_function(
        until(
            f"tessera.clipboard === 'size:{width}x{height}' && video.videoWidth === {width}"
            f" && video.videoHeight === {height}"
        ),
        timeout=TIMEOUT_MS,
    )
    # larger than the limit: the display stops at it
    page.set_viewport_size({"width": 1600, "height": 1000})
    page.wait_for_function(
        until(f"tessera.askedSize[0] > {MAX_SIZE[0]} && tessera.askedSize[1] > {MAX_SIZE[1]}"),
        timeout=TIMEOUT_MS,
    )
    page.wait_for_function(
        until(
            f"tessera.clipboard === 'size:{MAX_SIZE[0]}x{MAX_SIZE[1]}'"
            f" && video.videoWidth === {MAX_SIZE[0]} && video.videoHeight === {MAX_SIZE[1]}"
        ),
        timeout=TIMEOUT_MS,
    )
    end_session(page, service)


def test_a_recording_is_announced_and_stored_playable_with_every_frame(
    service: StreamService, browser: Browser, page: Page
) -> None:
    sid = _play_probe(service, page)
    session = service.sessions[sid]
    spectator = browser.new_page(viewport={"width": 640, "height": 480})
    try:
        spectator.goto(
            f"{service.url}/player?session={sid}&role=spectator&token={tokens.viewer(sid)}"
        )
        spectator.wait_for_function(
            until(
                "window.tessera && tessera.role === 'spectator' && tessera.stats.frames_decoded > 0"
            ),
            timeout=TIMEOUT_MS,
        )
        assert spectator.is_hidden("#record") and page.is_visible("#record")
        # opt-in: nothing records until the controlling viewer asks; then everyone is told
        assert session.recording is None and not page.evaluate("tessera.recording")
        page.click("#record")
        for viewer in (page, spectator):
            viewer.wait_for_function(until("tessera.recording"), timeout=TIMEOUT_MS)
            assert viewer.is_visible("#rec")
        assert spectator.evaluate("tessera.record(false)") is False
        _wait(lambda: session.recording is not None and session.recording.frames >= 20)
        page.click("#record")
        for viewer in (page, spectator):
            viewer.wait_for_function(until("!tessera.recording"), timeout=TIMEOUT_MS)
            assert viewer.is_hidden("#rec")
        _wait(lambda: len(session.recorded) == 1)
        # a second recording runs until the session ends, and is stored then
        page.click("#record")
        _wait(lambda: session.recording is not None and session.recording.frames >= 10)
    finally:
        spectator.close(run_before_unload=True)
    end_session(page, service)
    assert len(session.recorded) == 2
    storage = service.settings.storage_dir
    for stored in session.recorded:
        assert stored["key"].startswith(f"projects/{session.project or '_'}/recordings/{sid}")
        with av.open(str(storage / stored["key"])) as container:
            stream = container.streams.video[0]
            frames = list(container.decode(stream))
        assert len(frames) == stored["frames"]
        assert (frames[0].width, frames[0].height) == (320, 240)


def test_the_controlling_viewers_gamepad_reaches_the_session(
    service: StreamService, page: Page
) -> None:
    page.add_init_script(FAKE_PAD_JS)
    sid = _play_probe(service, page)
    control = service.sessions[sid].control
    page.evaluate("window.plugPad()")
    page.wait_for_function(until("tessera.gamepadsSent >= 1"), timeout=TIMEOUT_MS)
    page.evaluate("window.movePad(0, -0.5)")  # A pressed, left stick half left
    page.wait_for_function(until("tessera.gamepadsSent >= 2"), timeout=TIMEOUT_MS)
    _wait(lambda: 0 in control.pads and control.pads[0].buttons[:1] == (1.0,))
    want = PadState((1.0,) + (0.0,) * 16, (-0.5, 0.0, 0.0, 0.0))
    assert control.pads[0] == want
    # The app reads it from its /dev/input/js0: uinput's controller where the host has it,
    # else the pad shim's. Button 0 is A; axis 0 the left stick (-0.5 of 32767); axes 2 and 5
    # the triggers at rest.
    assert UINPUT.exists() or SHIM.is_file(), "no uinput, and the pad shim is not built (.ci/setup)"
    seen = "pad:buttons=0;axes=-16384,0,-32767,0,0,-32767,0,0"
    page.wait_for_function(until(f"tessera.clipboard === {seen!r}"), timeout=TIMEOUT_MS)
    end_session(page, service)


def test_files_go_into_and_out_of_the_sessions_home_for_its_controller_only(
    service: StreamService, page: Page
) -> None:
    sid = _play_probe(service, page)
    home = service.sessions[sid].source.home
    assert home is not None
    page.wait_for_function(until("tessera.files !== null"), timeout=TIMEOUT_MS)
    # into the home: the page's file picker, and the app finds it in its own home folder
    upload: FilePayload = {"name": "notes ü.txt", "mimeType": "text/plain", "buffer": b"hi app"}
    page.set_input_files("#upload", files=[upload])
    page.wait_for_function(
        until("tessera.files.some((f) => f.name === 'notes ü.txt' && f.size === 6)"),
        timeout=TIMEOUT_MS,
    )
    assert (home / "notes ü.txt").read_bytes() == b"hi app"
    if os.geteuid() == 0:
        assert (home / "notes ü.txt").stat().st_uid == service.settings.sandbox_uid
    # out of it: a file the app wrote, and never what a link the app made points to
    for command in ("file:from-app.txt=made in the sandbox", "link:leak=/etc/hostname"):
        page.evaluate("(text) => tessera.paste(text)", command)
        page.wait_for_function(
            "(text) => tessera.clipboard === 'echo:' + text", arg=command, timeout=TIMEOUT_MS
        )
    names = [f["name"] for f in page.evaluate("tessera.listFiles()")]
    assert names == ["from-app.txt", "notes ü.txt"]
    got = page.evaluate("tessera.download('from-app.txt').then((blob) => blob.text())")
    assert got == "made in the sandbox"
    refused = page.evaluate(
        "tessera.download('leak').then(() => 'served', (e) => [e.status, e.message])"
    )
    assert refused == [404, "no file 'leak' in the session's home folder"]
    # over the limit (1 MiB here): refused, and nothing is left behind
    too_big = page.evaluate(
        "tessera.uploadFile(new File([new Uint8Array((1 << 20) + 1)], 'big.bin'))"
        ".then(() => 'stored', (e) => e.message)"
    )
    assert "limit" in too_big
    assert sorted(p.name for p in home.iterdir()) == ["from-app.txt", "leak", "notes ü.txt"]
    # only the session's controllers: a spectator's token, or another session's, gets nothing
    files = f"{service.url}/api/streams/sessions/{sid}/files"
    for token in (tokens.viewer(sid, "spectator"), tokens.viewer("another-session")):
        assert page.request.get(files, headers={"Authorization": f"Bearer {token}"}).status == 403
    listed = page.request.get(files, headers={"Authorization": f"Bearer {tokens.viewer(sid)}"})
    assert listed.status == 200 and [f["name"] for f in listed.json()["files"]] == names
    end_session(page, service)
    assert not home.exists()
