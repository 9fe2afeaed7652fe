"""A session's sound, part by part: the catalog's ``audio`` field and the farm-wide switch,
the sound server in the session's sandbox (its socket reached by the service, no module but
the native protocol and the null sink), and the app's sound captured and encoded to Opus
once for every viewer's track."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest

from encoder import audio
from encoder.appbox import session_spec
from encoder.catalog import TESTPATTERN, App, Catalog, read_apps
from encoder.source import SandboxedSource, make_source
from farm.errors import BadParameter
from farm.settings import Settings
from tests.encoder.conftest import session_processes

pytestmark = pytest.mark.usefixtures("no_orphans")

BEEP = App(
    "beepflash", "beep", (sys.executable, "-m", "encoder.beepflash", "0.3"), 320, 240, 30,
    audio=True,
)  # fmt: skip


def test_desktop_and_game_have_sound_the_test_pattern_and_file_apps_only_if_asked(
    tmp_path: Path,
) -> None:
    catalog = Catalog.load(None)
    assert catalog.get("desktop").audio and catalog.get("game").audio
    assert not catalog.get(TESTPATTERN).audio
    assert {a["name"]: a["audio"] for a in catalog.to_json()}[TESTPATTERN] is False
    apps = tmp_path / "apps.json"
    apps.write_text(json.dumps([
        {"name": "quiet", "command": ["true"]},
        {"name": "loud", "command": ["true"], "audio": True},
    ]))  # fmt: skip
    assert [(a.name, a.audio) for a in read_apps(apps)] == [("quiet", False), ("loud", True)]
    apps.write_text(json.dumps([{"name": "x", "command": ["true"], "audio": "yes"}]))
    with pytest.raises(BadParameter, match="audio must be true or false"):
        read_apps(apps)


def test_viewers_hold_the_picture_for_the_sound_unless_the_app_puts_latency_first(
    tmp_path: Path,
) -> None:
    catalog = Catalog.load(None)
    assert catalog.get("desktop").lip_sync and not catalog.get("game").lip_sync
    assert {a["name"]: a["lip_sync"] for a in catalog.to_json()}["game"] is False
    apps = tmp_path / "apps.json"
    apps.write_text(json.dumps([
        {"name": "film", "command": ["true"], "audio": True},
        {"name": "shooter", "command": ["true"], "audio": True, "lip_sync": False},
    ]))  # fmt: skip
    assert [(a.name, a.lip_sync) for a in read_apps(apps)] == [("film", True), ("shooter", False)]
    apps.write_text(json.dumps([{"name": "x", "command": ["true"], "lip_sync": 0}]))
    with pytest.raises(BadParameter, match="lip_sync must be true or false"):
        read_apps(apps)


def test_the_app_finds_its_sound_server_only_where_sound_is_on(tmp_path: Path) -> None:
    on = session_spec(Settings(), BEEP, tmp_path, 100, "s")
    assert on.env["PULSE_SERVER"] == "unix:/tmp/.X11-unix/pulse"
    off = session_spec(Settings().with_(stream_audio=0), BEEP, tmp_path, 100, "s")
    assert "PULSE_SERVER" not in off.env and "PULSE_SOCKET" not in off.env
    game = Catalog.load(None).get(TESTPATTERN)
    assert "PULSE_SERVER" not in session_spec(Settings(), game, tmp_path, 100, "s").env


def test_the_switch_off_starts_no_sound_server(tmp_path: Path) -> None:
    settings = Settings().with_(work_dir=tmp_path, stream_audio=0)
    source = make_source(BEEP, settings, "quiet")
    assert isinstance(source, SandboxedSource)
    source.start(lambda reason: None)
    try:
        assert not source.has_audio
        assert not _servers()
    finally:
        source.stop()


def _servers() -> list[str]:
    """The sound servers of the sessions this test process started."""
    return [p for p in session_processes() if p.split()[1] == "pulseaudio"]


def test_the_apps_beep_reaches_every_viewers_track_as_opus(tmp_path: Path) -> None:
    asyncio.run(_beep_reaches_every_track(tmp_path))


async def _beep_reaches_every_track(tmp_path: Path) -> None:
    settings = Settings().with_(work_dir=tmp_path)
    source = make_source(BEEP, settings, "beep")
    assert isinstance(source, SandboxedSource)
    await asyncio.to_thread(source.start, lambda reason: None)
    try:
        assert source.has_audio and source.box.pulse_socket is not None
        assert len(_servers()) == 1
        # the server has the native protocol (its socket) and the null sink, nothing else
        modules = subprocess.run(
            ["pactl", f"--server=unix:{source.box.pulse_socket}", "list", "modules", "short"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
        names = sorted(line.split("\t")[1] for line in modules.splitlines())
        assert names == ["module-always-sink", "module-native-protocol-unix", "module-null-sink"]
        feed = audio.AudioFeed(asyncio.get_running_loop())
        player, spectator = feed.track(), feed.track()
        source.start_audio(feed)
        decoder = av.CodecContext.create("opus", "r")
        peak = 0
        for _ in range(50):  # 1 s: the app beeps every 0.3 s
            packet = await asyncio.wait_for(player.recv(), 5)
            same = await asyncio.wait_for(spectator.recv(), 5)
            assert bytes(same) == bytes(packet)  # encoded once, for both
            # its capture time: before now, by no more than the frame and the queue's wait
            age_us = time.time_ns() // 1000 - player.capture_us(packet.pts)
            assert 0 < age_us < (audio.MAX_PENDING + 1) * audio.FRAME_US, age_us
            for frame in decoder.decode(packet):
                peak = max(peak, int(np.abs(frame.to_ndarray()).max() * 32767))
        assert peak > 5000, "no beep in the session's sound"
        # how long the app's sound waits in the server (its stream's buffer and the sink, the
        # capture's own), from the server's own figures: the least of the first three readings
        deadline = time.monotonic() + 10
        while feed.lead_us == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert 1_000 < feed.lead_us < 200_000, feed.lead_us
        assert player.lead_us() == feed.lead_us
        assert feed.capture_us(0) == feed.capture_us(audio.FRAME_SAMPLES) - audio.FRAME_US
    finally:
        await asyncio.to_thread(source.stop)


def test_the_servers_latency_figures_are_read_per_stream() -> None:
    listing = """Sink Input #0
	Driver: protocol-native.c
	Buffer Latency: 7000 usec
	Sink Latency: 2661 usec
	Resample method: n/a
Sink Input #3
	Buffer Latency: 40000 usec
	Sink Latency: 2500 usec
"""
    assert audio.stream_latencies_us(listing) == [9661, 42500]
    outputs = "Source Output #1\n\tBuffer Latency: 1082 usec\n\tSource Latency: 0 usec\n"
    assert audio.stream_latencies_us(outputs) == [1082]
    assert audio.stream_latencies_us("") == []


def test_sound_after_a_pause_keeps_its_capture_times_true() -> None:
    """A restarted sandbox's capture begins after a pause: its packets' capture times move on
    with the clock, not on from the last packet's. (The one packet that spans the pause, the
    encoder's 2.5 ms look-ahead, keeps the time of the sound before it.)"""

    async def main() -> list[int]:
        feed = audio.AudioFeed(asyncio.get_running_loop())
        track = feed.track()
        ages = []
        for pause_s in (0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0):
            await asyncio.sleep(pause_s)
            feed.push_pcm(bytes(audio.FRAME_BYTES))
            await asyncio.sleep(0.03)  # the packet is handed over on the loop
            packet = await asyncio.wait_for(track.recv(), 1)
            ages.append(time.time_ns() // 1000 - track.capture_us(packet.pts))
        return ages

    ages = asyncio.run(main())
    del ages[3]  # the packet that spans the pause
    assert all(0 < age_us < 150_000 for age_us in ages), ages
