"""Input over the data channel drives the built-in game; only the controlling viewer's counts;
ending the session leaves no process behind and frees its lease."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import redis

from encoder.service import StreamService
from farm.alloc.allocator import SlotAllocator
from tests.encoder.rtcviewer import Received, RtcViewer
from tests.encoder.test_stream_video import api, run

GAME = {"app": "game", "width": 320, "height": 240, "fps": 30}
STEP_PX = 24  # encoder.game.STEP_PX

pytestmark = pytest.mark.usefixtures("no_orphans")


def sprite(received: Received) -> tuple[int, int] | None:
    """Centre of the game's pure-green square in a decoded frame, or None."""
    rgb = received.rgb().astype(np.int16)
    mask = (rgb[..., 1] > 180) & (rgb[..., 0] < 90) & (rgb[..., 2] < 90)
    if mask.sum() < 50:
        return None
    ys, xs = np.nonzero(mask)
    return round(float(xs.mean())), round(float(ys.mean()))


async def sprite_where(viewer: RtcViewer, ok: object, timeout_s: float = 15.0) -> tuple[int, int]:
    """The sprite's position in the first frame where ``ok(position)`` holds."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = sprite(await viewer.next_frame())
        if last is not None and ok(last):  # type: ignore[operator]
            return last
    raise AssertionError(f"the sprite never got there (last seen at {last})")


async def settled(viewer: RtcViewer) -> tuple[int, int]:
    """The sprite's position in frames captured after everything sent so far was handled."""
    await viewer.roundtrip()
    viewer.drain()
    positions = [sprite(await viewer.next_frame()) for _ in range(4)]
    assert positions[-1] is not None
    return positions[-1]


def near(a: tuple[int, int], b: tuple[int, int], tol_px: int = 3) -> bool:
    """Positions equal but for colour bleed at the square's edges (4:2:0, lossy coding)."""
    return abs(a[0] - b[0]) <= tol_px and abs(a[1] - b[1]) <= tol_px


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def test_keys_move_the_sprite_only_for_the_controlling_viewer_and_end_stops_everything(
    stream_service: StreamService, redis_url: str
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", GAME)
        assert status == 201, session
        sid = session["session_id"]
        pids = stream_service.sessions[sid].pids()
        # Xvfb and the game, in their sandbox (bwrap and its init)
        assert len(pids) >= 2 and all(alive(p) for p in pids)
        player = await RtcViewer(http, url, sid).join("player")
        # a second "player" joins as a spectator: the first one controls
        spectator = await RtcViewer(http, url, sid).join("player")
        assert (player.role, spectator.role) == ("player", "spectator")
        try:
            start = await sprite_where(player, lambda p: True)
            await sprite_where(spectator, lambda p: near(p, start))

            for _ in range(2):
                await spectator.send({"t": "kd", "code": "ArrowRight"})
                await spectator.send({"t": "ku", "code": "ArrowRight"})
            assert (await spectator.reply("denied"))["t"] == "denied"
            assert near(await settled(spectator), start), "a spectator's keys moved the sprite"

            for code in ("ArrowRight", "ArrowRight", "KeyS"):
                await player.send({"t": "kd", "code": code})
                await player.send({"t": "ku", "code": code})
            want = (start[0] + 2 * STEP_PX, start[1] + STEP_PX)
            assert near(await sprite_where(player, lambda p: near(p, want)), want)
            # the spectator watches the same stream
            assert near(await sprite_where(spectator, lambda p: near(p, want)), want)

            status, state = await api(
                http, "POST", f"{url}/api/streams/sessions/{sid}/control",
                {"viewer_id": spectator.viewer_id},
            )  # fmt: skip
            assert status == 200
            assert {v["viewer_id"]: v["controlling"] for v in state["viewers"]} == {
                player.viewer_id: False,
                spectator.viewer_id: True,
            }
            await player.send({"t": "kd", "code": "ArrowLeft"})
            assert (await player.reply("denied"))["t"] == "denied"
            # a click teleports the sprite (pointer in video pixels)
            await spectator.send({"t": "mm", "x": 60, "y": 50})
            await spectator.send({"t": "mb", "b": 1, "d": True})
            await spectator.send({"t": "mb", "b": 1, "d": False})
            assert await sprite_where(spectator, lambda p: abs(p[0] - 60) <= 2) is not None
            # a resize makes the display that size (RandR); the pointer still lands where the
            # viewer points
            await spectator.send({"t": "resize", "w": 160, "h": 120})
            deadline = time.monotonic() + 10
            while (await spectator.next_frame()).frame.width != 160:
                assert time.monotonic() < deadline, "the video never came at 160x120"
            await spectator.send({"t": "mm", "x": 100, "y": 70})
            await spectator.send({"t": "mb", "b": 1, "d": True})
            await spectator.send({"t": "mb", "b": 1, "d": False})
            assert near(await sprite_where(spectator, lambda p: near(p, (100, 70))), (100, 70))
        finally:
            await player.close()
            await spectator.close()
        status, _ = await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")
        assert status == 204
        assert not any(alive(p) for p in pids), "the app or Xvfb outlived the session"
        status, ended = await api(http, "GET", f"{url}/api/streams/sessions/{sid}")
        assert (status, ended["state"], ended["reason"]) == (200, "ended", "ended by request")
        status, refused = await api(http, "POST", f"{url}/api/streams/sessions/{sid}/viewers",
                                    {"type": "offer", "sdp": "v=0"})  # fmt: skip
        assert status == 404 and refused["error"]["reason"] == "ended by request"

    run(stream_service, body)
    allocator = SlotAllocator(redis.Redis.from_url(redis_url))
    (device,) = allocator.devices()
    assert device.used_encoder_sessions == 0 and device.leases == []
