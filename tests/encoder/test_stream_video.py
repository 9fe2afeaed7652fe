"""A stream session seen by real aiortc viewers: decodable frames, keyframes at join and on
request, one encode for every viewer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from encoder.service import StreamService
from encoder.testpattern import read_stamp
from tests.encoder.rtcviewer import RtcViewer
from tests.encoder.tokens import operator_headers

PATTERN_FPS = 20
PATTERN = {"app": "testpattern", "width": 640, "height": 360, "fps": PATTERN_FPS}

pytestmark = pytest.mark.usefixtures("no_orphans")


async def api(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, Any]:
    async with http.request(method, url, json=body) as resp:
        return resp.status, (None if resp.status == 204 else await resp.json())


def run(
    service: StreamService, body: Callable[[aiohttp.ClientSession, str], Awaitable[None]]
) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            await body(http, service.url)

    asyncio.run(main())


def test_a_viewer_gets_a_keyframe_at_join_and_within_two_frames_of_a_pli(
    stream_service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", PATTERN)
        assert status == 201, session
        assert session["encoder"] == "libx264"
        viewer = await RtcViewer(http, url, session["session_id"]).join()
        try:
            first = await viewer.next_frame()
            assert first.keyframe, "the first frame a joining viewer decodes is a keyframe"
            assert (first.frame.width, first.frame.height) == (640, 360)
            counters = [read_stamp(first.luma())[0]]
            for _ in range(10):
                got = await viewer.next_frame()
                counters.append(read_stamp(got.luma())[0])
            # the stamps read back: frames arrive in order, decoded intact
            assert counters == sorted(counters) and counters[-1] > counters[0], counters
            for _attempt in range(3):
                viewer.drain()
                await viewer.send_pli()
                after = [await viewer.next_frame() for _ in range(2)]
                if any(r.keyframe for r in after):
                    break
            else:
                raise AssertionError("no keyframe within 2 frames of a PLI (3 tries)")
            status, state = await api(
                http, "GET", f"{url}/api/streams/sessions/{session['session_id']}"
            )
            assert state["stats"]["keyframes"] >= 2
            assert [v["controlling"] for v in state["viewers"]] == [True]
        finally:
            await viewer.close()
        status, _ = await api(http, "DELETE", f"{url}/api/streams/sessions/{session['session_id']}")
        assert status == 204

    run(stream_service, body)


def test_viewers_share_one_encode_and_the_bitrate_follows_their_estimates_within_bounds(
    stream_service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        _status, session = await api(http, "POST", f"{url}/api/streams/sessions", PATTERN)
        sid = session["session_id"]
        state_url = f"{url}/api/streams/sessions/{sid}"

        async def stats_when(pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
            for _ in range(200):
                _status, state = await api(http, "GET", state_url)
                if pred(state["stats"]):
                    return dict(state["stats"])
                await asyncio.sleep(0.05)
            raise AssertionError(f"stats never matched: {state['stats']}")

        a = await RtcViewer(http, url, sid).join("player", remb=False)
        b = await RtcViewer(http, url, sid).join("spectator", remb=False)
        try:
            seen_a = {read_stamp((await a.next_frame()).luma())[0] for _ in range(8)}
            seen_b = {read_stamp((await b.next_frame()).luma())[0] for _ in range(8)}
            assert seen_a & seen_b, "two viewers of one session saw different frames"
            _status, state = await api(http, "GET", state_url)
            stats = state["stats"]
            # the service counts what each viewer was sent: at least the 8 frames each decoded
            sent = {v["role"]: v["frames_sent"] for v in state["viewers"]}
            assert sent.keys() == {"player", "spectator"} and min(sent.values()) >= 8, sent
            # one encode per captured frame, not one per viewer: both were sent that one encode
            assert stats["frames_encoded"] <= stats["frames_captured"]
            assert stats["frames_sent"] >= stats["frames_encoded"] - 2
            assert max(sent.values()) <= stats["frames_sent"], (sent, stats)
            keyframes = stats["keyframes"]

            await a.send_remb(1_500_000)
            await b.send_remb(2_500_000)
            # one encode serves both: the slower receiver sets the rate
            await stats_when(lambda s: s["bitrate_kbps"] == 1500)
            await a.send_remb(50_000)  # under FARM_STREAM_MIN_KBPS (300)
            await stats_when(lambda s: s["bitrate_kbps"] == 300)
            await a.send_remb(90_000_000)  # over FARM_STREAM_MAX_KBPS (8000): b's 2500 rules
            stats = await stats_when(lambda s: s["bitrate_kbps"] == 2500)
            # changed in place: a rebuilt encoder would have started with a keyframe
            assert stats["keyframes"] == keyframes
        finally:
            await a.close()
            await b.close()

    run(stream_service, body)
