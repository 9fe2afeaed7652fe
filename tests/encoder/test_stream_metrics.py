"""The stream service's /metrics: sessions, viewers, fps, bitrate and round trip of its sessions."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from encoder.service import StreamService
from tests.encoder.rtcviewer import RtcViewer
from tests.encoder.test_stream_video import PATTERN, PATTERN_FPS, api, run

pytestmark = pytest.mark.usefixtures("no_orphans")

#: (name, sorted labels) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: aiohttp.ClientSession, url: str) -> Samples:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metrics_show_a_running_session_and_forget_it_when_it_ends(
    stream_service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", PATTERN)
        assert status == 201, session
        sid, device = session["session_id"], session["device_id"]
        viewer = await RtcViewer(http, url, sid).join()
        try:
            for _ in range(PATTERN_FPS):  # about a second of video
                await viewer.next_frame()
            rtt = None
            for _ in range(50):  # receiver reports come every second or so
                samples = await scrape(http, url)
                rtt = _value(samples, "tessera_stream_round_trip_seconds", session=sid)
                if rtt is not None:
                    break
                await asyncio.sleep(0.2)
            assert _value(samples, "tessera_stream_sessions", device=device,
                          encoder="libx264") == 1  # fmt: skip
            assert _value(samples, "tessera_stream_viewers", device=device) == 1
            fps = _value(samples, "tessera_stream_fps", session=sid)
            assert fps is not None and 0 < fps <= PATTERN_FPS * 1.5, fps
            bitrate = _value(samples, "tessera_stream_bitrate_bits_per_second", session=sid)
            assert bitrate is not None and bitrate > 100_000
            frames = _value(samples, "tessera_stream_frames_encoded_total", encoder="libx264")
            assert frames is not None and frames >= PATTERN_FPS
            assert rtt is not None and 0 <= rtt < 1.0, "RTCP round trip to the player"
        finally:
            await viewer.close()
        assert (await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}"))[0] == 204
        after = await scrape(http, url)
        assert _value(after, "tessera_stream_fps", session=sid) is None
        assert _value(after, "tessera_stream_viewers", device=device) == 0

    run(stream_service, body)
