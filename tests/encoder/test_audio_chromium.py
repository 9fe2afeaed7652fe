"""A session's sound in a real headless Chromium: an app that beeps and flashes together
(encoder/beepflash.py) in its sandbox, its sound through the session's own PulseAudio server,
Opus over the viewer's peer connection (or the WebSocket fallback), played by the player; the
page hears each beep (WebAudio on the received track, or on the WebSocket player's sound in
its own context) and sees each flash (the decoded video
read back from a canvas), and their offset (median) is printed and bounded. A recording of the
session holds the sound too, each beep with its flash.

Issue #18 asks for 50 ms. The player holds each video frame for its sound (lip sync,
encoder/static/player.js), over WebRTC from the receivers' stats, over the WebSocket from the
sound's own capture-to-heard delay, both counting the sound's wait in the session's sound
server (encoder/audio.py reads it from the server). The app draws each flash when its tone
leaves its own pipe to the sound server (what an app buffers before its sound server nothing
else can see). Medians here (2026-12-06, quiet machine): 15 to 31 ms over WebRTC in 7 runs, -9
to 28 ms over the WebSocket in 6, against 82 to 88 ms over WebRTC with the hold cut to 30 %.
Without the hold the sound is late by the Opus packet (20 ms and the encoder's look-ahead), the
browser's jitter buffer or the WebSocket player's margin (10-45 ms, deeper as the machine's
load jitters the packets) and the output device (30 ms headless), while a frame is shown as
soon as it is decoded. Bound: 60 ms either way, the issue's 50 ms and room for a loaded
machine."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from playwright.sync_api import Browser, Page

from encoder.app import running
from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.chromium import CHROMIUM, TIMEOUT_MS, until
from tests.encoder.test_player_chromium import end_session

OPERATOR = tokens.operator()
#: pairs of beep and flash measured
PAIRS = 8
#: the largest median offset between hearing a beep and seeing its flash, by transport (the
#: module's docstring says why 10 ms over the 50 ms issue #18 asks for)
MAX_OFFSET_MS = {"webrtc": 60.0, "ws": 60.0}
#: the largest offset between a beep and its flash in a recording: both are placed by their
#: capture times, so only the app's own sound buffer and the frame tick part them. One pair
#: may miss it: under a second load of 70 % of a core one flash of eight was captured 50-70
#: ms late (the capture thread not run in time: -54 ms, the others 17 to 21 ms)
MAX_RECORDED_OFFSET_MS = 50.0
#: the largest median offset of a recording's pairs
MAX_RECORDED_MEDIAN_MS = 30.0

pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium"),
    pytest.mark.usefixtures("no_orphans"),
]

#: records when each beep is played (its first loud sample, on the page's clock, from the
#: audio buffer's own playback time) and when each flash is shown (the decoded frame's
#: expected display time). Over WebRTC the received track is heard through a context of the
#: listener's own; over the WebSocket the player's sound node, in the context that plays it
#: (a second context fed by a MediaStream hears it 25-35 ms late: measured side by side)
LISTEN_JS = """
() => {
  window.beeps = []; window.flashes = [];
  const node = tessera.soundNode;
  const ctx = node ? node.context : new AudioContext();
  const source = node || ctx.createMediaStreamSource(tessera.audioStream);
  const tap = ctx.createScriptProcessor(256, 1, 1);
  const silent = ctx.createGain();
  silent.gain.value = 0;
  source.connect(tap); tap.connect(silent); silent.connect(ctx.destination);
  let loud = false;
  tap.onaudioprocess = (event) => {
    const data = event.inputBuffer.getChannelData(0);
    let peak = 0;
    for (let i = 0; i < data.length; i++) {
      const level = Math.abs(data[i]);
      peak = Math.max(peak, level);
      if (!loud && level > 0.2) {
        loud = true;
        const at = ctx.getOutputTimestamp();
        const played = event.playbackTime + i / ctx.sampleRate;
        const time = at.performanceTime + (played - at.contextTime) * 1000;
        // one beep is 100 ms: a quieter moment inside it is not a new one
        if (!beeps.length || time - beeps[beeps.length - 1] > 300) beeps.push(time);
      }
    }
    if (peak < 0.02) loud = false;
  };
  const video = document.getElementById("video");
  const canvas = document.createElement("canvas");
  canvas.width = canvas.height = 8;
  const g = canvas.getContext("2d", { willReadFrequently: true });
  let bright = false;
  const onFrame = (now, meta) => {
    g.drawImage(video, 0, 0, 8, 8);
    const px = g.getImageData(0, 0, 8, 8).data;
    let sum = 0;
    for (let i = 0; i < px.length; i += 4) sum += px[i + 1];
    const level = sum / 64;
    if (!bright && level > 128) { bright = true; flashes.push(meta.expectedDisplayTime); }
    else if (bright && level < 64) bright = false;
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
  window.audioRunning = () => ctx.state;
}
"""


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, redis_server: Any) -> Iterator[StreamService]:
    work = tmp_path_factory.mktemp("stream-audio")
    apps = work / "apps.json"
    beep = {"name": "beepflash", "command": [sys.executable, "-m", "encoder.beepflash", "1"],
            "audio": True}  # fmt: skip
    # the same app, its picture's latency first (as the built-in game)
    latency_first = {**beep, "name": "beepfirst", "lip_sync": False}
    apps.write_text(json.dumps([beep, latency_first]))
    settings = Settings().with_(
        redis_url=redis_server.url.rsplit("/", 1)[0] + "/2",
        work_dir=work,
        storage_dir=work / "storage",
        stream_port=0,
        stream_apps=apps,
        cpu_encode_sessions=4,
        stream_grace_s=2.0,
        stream_secret=tokens.STREAM_SECRET,
    )
    with running(settings) as svc:
        yield svc


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    page = browser.new_page(viewport={"width": 800, "height": 600})
    yield page
    page.close(run_before_unload=True)


def offsets(beeps: list[float], flashes: list[float]) -> list[float]:
    """Each flash's offset to the beep nearest it (beep later: positive), ms."""
    return [min((b - f for b in beeps), key=abs) for f in flashes]


def test_offsets_pair_each_flash_with_its_own_beep() -> None:
    assert offsets([1000.0, 1510.0, 2020.0], [990.0, 1500.0, 2050.0]) == [10.0, 10.0, -30.0]


@pytest.mark.parametrize("transport", ["webrtc", "ws"])
def test_the_player_hears_each_beep_close_to_its_flash(
    service: StreamService, page: Page, transport: str
) -> None:
    page.goto(
        f"{service.url}/player?app=beepflash&width=320&height=240&fps=60&autostart=1"
        f"&token={OPERATOR}&transport={transport}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.audioStream && tessera.stats.frames_decoded > 0"),
        timeout=TIMEOUT_MS,
    )
    assert page.evaluate("tessera.muted") is False  # the page plays the sound
    # the picture is held for the sound once both have stats
    held = until("tessera.lipSync && tessera.lipSync.hold_ms > 0")
    page.wait_for_function(held, timeout=TIMEOUT_MS)
    page.evaluate(LISTEN_JS)
    page.wait_for_function(
        until(f"beeps.length >= {PAIRS + 2} && flashes.length >= {PAIRS + 2}"), timeout=TIMEOUT_MS
    )
    beeps, flashes = page.evaluate("[beeps, flashes]")
    # the first flash's beep may be cut by when listening started, the last's not heard yet
    measured = offsets(beeps, flashes[1:-1])
    median = statistics.median(measured)
    print(f"beep - flash offsets (ms): {[round(m, 1) for m in measured]}, median {median:.1f}")
    # every flash has its beep (in its own period), and the median is bounded
    assert all(abs(m) < 400 for m in measured), measured
    assert abs(median) <= MAX_OFFSET_MS[transport], measured
    print(f"lip sync: {page.evaluate('tessera.lipSync')}")
    if transport == "ws":
        assert page.evaluate("tessera.transport") == "websocket"
        sound = page.evaluate("tessera.sound")
        print(f"sound over the WebSocket: {sound}")
        assert sound["played"] > 20 * PAIRS
    page.click("#sound")
    assert page.evaluate("tessera.muted && document.getElementById('audio').muted") is True
    end_session(page, service)


@pytest.mark.parametrize(
    ("app", "asked"), [("beepflash", "&lipsync=0"), ("beepfirst", ""), ("beepfirst", "&lipsync=1")]
)
def test_a_viewer_or_the_app_may_put_the_pictures_latency_first(
    service: StreamService, page: Page, app: str, asked: str
) -> None:
    page.goto(
        f"{service.url}/player?app={app}&width=320&height=240&fps=60&autostart=1"
        f"&token={OPERATOR}{asked}"
    )
    page.wait_for_function(until("tessera.stats.frames_decoded > 60"), timeout=TIMEOUT_MS)
    page.wait_for_timeout(2500)  # two stats periods: a hold would be set by now
    held, buffer_ms = page.evaluate("[tessera.lipSync, tessera.stats.jitter_buffer_ms]")
    if asked == "&lipsync=1":  # the viewer asks for it where the app does not
        assert held is not None and held["hold_ms"] > 0, held
    else:
        assert held is None and buffer_ms is not None and buffer_ms < 30, (held, buffer_ms)
    end_session(page, service)


def recorded_pairs(path: Path) -> tuple[list[float], list[float]]:
    """The times (ms from the file's start) at which a recording's beeps start and its
    flashes are first shown."""
    with av.open(str(path)) as container:
        assert [s.codec_context.name for s in container.streams] == ["h264", "opus"]
        flashes, bright = [], False
        for frame in container.decode(video=0):
            level = float(frame.to_ndarray(format="gray").mean())
            if not bright and level > 128:
                flashes.append(float(frame.time or 0) * 1000)
            bright = level > 64 if bright else level > 128
        container.seek(0)
        beeps: list[float] = []
        loud = False
        for sound in container.decode(audio=0):
            samples = np.abs(sound.to_ndarray()[0])
            loud_at = np.flatnonzero(samples > 0.2)
            if not loud and loud_at.size:
                time_ms = (float(sound.time or 0) + loud_at[0] / sound.sample_rate) * 1000
                if not beeps or time_ms - beeps[-1] > 300:  # one beep is 100 ms
                    beeps.append(time_ms)
            # a beep lasts until a packet is nearly silent
            loud = bool(samples.max() > 0.02) if loud else bool(loud_at.size)
    return beeps, flashes


def test_a_recording_keeps_each_beep_with_its_flash(service: StreamService, page: Page) -> None:
    page.goto(
        f"{service.url}/player?app=beepflash&width=320&height=240&fps=60&autostart=1"
        f"&token={OPERATOR}"
    )
    page.wait_for_function(
        until("window.tessera && tessera.audioStream && tessera.stats.frames_decoded > 0"),
        timeout=TIMEOUT_MS,
    )
    session = service.sessions[page.evaluate("tessera.sessionId")]
    page.click("#record")
    page.wait_for_function(until("tessera.recording"), timeout=TIMEOUT_MS)
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while session.recording is None or session.recording.frames < 60 * (PAIRS // 2 + 1):
        assert time.monotonic() < deadline, "the recording did not grow"
        page.wait_for_timeout(100)
    page.click("#record")
    page.wait_for_function(until("!tessera.recording"), timeout=TIMEOUT_MS)
    while not session.recorded:
        assert time.monotonic() < deadline, "the recording was not stored"
        page.wait_for_timeout(100)
    end_session(page, service)
    stored = session.recorded[0]
    assert stored["sound"] > 50 * (PAIRS // 2)  # 20 ms packets
    beeps, flashes = recorded_pairs(service.settings.storage_dir / stored["key"])
    # a recording stopped between a flash and its beep ends on a flash without one
    measured = offsets(beeps, [f for f in flashes if f <= beeps[-1] + 500])
    print(f"recorded beep - flash offsets (ms): {[round(m, 1) for m in measured]}")
    assert len(measured) >= PAIRS // 2
    assert sum(abs(m) > MAX_RECORDED_OFFSET_MS for m in measured) <= 1, measured
    assert abs(statistics.median(measured)) <= MAX_RECORDED_MEDIAN_MS, measured
