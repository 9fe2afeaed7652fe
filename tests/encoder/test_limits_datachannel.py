"""What a viewer sends cannot hurt its session: oversized, deeply nested, malformed and flooding
messages are dropped and counted (also in /metrics), the viewer stays connected; a viewer that
never connects is removed after the connect time limit, and its session ends after its grace."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection

from encoder.app import running
from encoder.service import StreamService
from farm.settings import Settings
from tests.encoder.rtcviewer import RtcViewer
from tests.encoder.test_stream_video import api, run

PATTERN = {"app": "testpattern", "width": 640, "height": 360, "fps": 30}
CONNECT_TIMEOUT_S = 1.5
GRACE_S = 1.0
INPUT_RATE = 40.0

pytestmark = pytest.mark.usefixtures("no_orphans")


@pytest.fixture
def service(stream_settings: Settings) -> Iterator[StreamService]:
    settings = stream_settings.with_(
        stream_connect_timeout_s=CONNECT_TIMEOUT_S,
        stream_grace_s=GRACE_S,
        stream_input_rate=INPUT_RATE,
        stream_message_max_bytes=4096,
    )
    with running(settings) as svc:
        yield svc


async def dropped_in_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = re.findall(r'^tessera_stream_messages_dropped_total\{reason="(\w+)"\} (\S+)$', text,
                       re.MULTILINE)  # fmt: skip
    return {reason: float(value) for reason, value in found}


async def stats(http: aiohttp.ClientSession, url: str, sid: str) -> dict[str, Any]:
    status, state = await api(http, "GET", f"{url}/api/streams/sessions/{sid}")
    assert status == 200, state
    return dict(state)


def test_bad_messages_are_dropped_and_counted_and_the_viewer_keeps_playing(
    service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        before = await dropped_in_metrics(http, url)
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", PATTERN)
        assert status == 201, session
        sid = session["session_id"]
        viewer = await RtcViewer(http, url, sid).join("player")
        try:
            await viewer.next_frame()
            # deeper than the parser's recursion limit, yet under the size limit
            nested = '{"t": "mm", "x": ' + "[" * 1500 + "]" * 1500 + "}"
            await viewer.send({"t": "kd", "code": "KeyA" * 2000})  # 8 KB: over 4 KiB
            viewer.channel.send(nested)
            viewer.channel.send("{not json")
            viewer.channel.send("[1, 2, 3]")
            viewer.channel.send(json.dumps({"t": 7}))
            await viewer.roundtrip()
            state = await stats(http, url, sid)
            assert state["stats"]["messages_dropped"] == {
                "too_large": 1, "too_deep": 1, "malformed": 3,
            }  # fmt: skip
            assert [v["state"] for v in state["viewers"]] == ["connected"]

            # a flood of input: the rate's burst passes, the rest is dropped, pings still answer
            for x in range(int(INPUT_RATE) * 5):
                await viewer.send({"t": "mm", "x": x % 300, "y": 10})
            await viewer.roundtrip()
            limited = (await stats(http, url, sid))["stats"]["messages_dropped"]["rate_limited"]
            assert INPUT_RATE * 5 - limited >= INPUT_RATE - 1
            assert limited >= INPUT_RATE * 2, limited

            # still playing: new frames keep coming
            viewer.drain()
            await viewer.next_frame()
            after = await dropped_in_metrics(http, url)
            for reason, count in (("too_large", 1), ("too_deep", 1), ("malformed", 3),
                                  ("rate_limited", limited)):  # fmt: skip
                assert after.get(reason, 0) - before.get(reason, 0) == count, (reason, after)

            # a viewer that did connect outlives the connect time limit
            await asyncio.sleep(CONNECT_TIMEOUT_S * 1.2)
            state = await stats(http, url, sid)
            assert [v["viewer_id"] for v in state["viewers"]] == [viewer.viewer_id]
        finally:
            await viewer.close()
            await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")

    run(service, body)


def test_a_viewer_that_never_connects_is_removed_and_its_session_ends_after_its_grace(
    service: StreamService,
) -> None:
    async def body(http: aiohttp.ClientSession, url: str) -> None:
        status, session = await api(http, "POST", f"{url}/api/streams/sessions", PATTERN)
        assert status == 201, session
        sid = session["session_id"]
        pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        try:
            pc.addTransceiver("video", direction="recvonly")
            pc.createDataChannel("input")
            await pc.setLocalDescription(await pc.createOffer())
            # no ICE candidates: the service's peer can never connect
            sdp = re.sub(r"^a=candidate:.*\r?\n", "", pc.localDescription.sdp, flags=re.M)
            status, answer = await api(
                http, "POST", f"{url}/api/streams/sessions/{sid}/viewers",
                {"type": "offer", "sdp": sdp, "role": "player"},
            )  # fmt: skip
            assert status == 200, answer
            joined = time.monotonic()
            state = await stats(http, url, sid)
            assert [v["viewer_id"] for v in state["viewers"]] == [answer["viewer_id"]]

            deadline = joined + CONNECT_TIMEOUT_S + GRACE_S + 10
            while time.monotonic() < deadline:
                state = await stats(http, url, sid)
                if state["state"] == "ended":
                    break
                await asyncio.sleep(0.1)  # polling the API for the end
            assert state["state"] == "ended", state
            took_s = time.monotonic() - joined
            assert took_s >= CONNECT_TIMEOUT_S + GRACE_S - 0.2, took_s
            assert state["reason"] == f"no viewers for {GRACE_S:g} s"
            assert state["viewers"] == []
        finally:
            await pc.close()

    run(service, body)
