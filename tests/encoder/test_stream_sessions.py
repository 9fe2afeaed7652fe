"""Sessions' lives: admission through the slot allocator, the ends (request, no viewers, lost
lease), what the API refuses, and `farm stream` as a process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import redis

from encoder.app import running
from encoder.service import StreamService
from farm import browserrules, keys, workerstate
from farm.alloc import agent as agent_module
from farm.alloc.allocator import Lease, Request, SlotAllocator
from farm.errors import LeaseLost
from farm.gpu.fake import FakeNvml
from farm.settings import Settings
from tests.encoder.rtcviewer import RtcViewer
from tests.encoder.serviceprocess import ServiceProcess
from tests.encoder.test_stream_video import api
from tests.encoder.tokens import operator_headers

SMALL_PATTERN = {"app": "testpattern", "width": 512, "height": 64, "fps": 10}

pytestmark = pytest.mark.usefixtures("no_orphans")


def until(pred: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout_s} s")


async def until_ended(http: aiohttp.ClientSession, url: str, sid: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, state = await api(http, "GET", f"{url}/api/streams/sessions/{sid}")
        if status == 200 and state["state"] == "ended":
            return str(state["reason"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"session {sid} did not end within {timeout_s} s")


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command: state, ppid, pgrp
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def test_with_room_for_two_sessions_the_third_is_refused_with_the_reason(
    stream_settings: Settings, redis_url: str
) -> None:
    settings = stream_settings.with_(cpu_encode_sessions=2, nvenc="fake")

    async def body(url: str) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            created = []
            for _ in range(2):
                status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                            SMALL_PATTERN)  # fmt: skip
                assert status == 201, session
                # FARM_NVENC=fake: the NVENC path (over libx264 underneath)
                assert session["encoder"] == "h264_nvenc"
                created.append(session["session_id"])
            status, refused = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            assert status == 503
            assert refused["error"]["code"] == "no_capacity"
            assert "full: 2/2 encoder sessions" in refused["error"]["message"]
            status, sessions = await api(http, "GET", f"{url}/api/streams/sessions")
            assert len(sessions["sessions"]) == 2
            # ending one makes room at once
            status, _ = await api(http, "DELETE", f"{url}/api/streams/sessions/{created[0]}")
            assert status == 204
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            assert status == 201, session

    with running(settings) as service:
        asyncio.run(body(service.url))
    # the service's stop ended its sessions and released every lease
    (device,) = SlotAllocator(redis.Redis.from_url(redis_url)).devices()
    assert device.used_encoder_sessions == 0


def test_a_session_ends_a_grace_period_after_its_last_viewer_leaves(
    stream_settings: Settings,
) -> None:
    async def body(url: str) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            sid = session["session_id"]
            viewer = await RtcViewer(http, url, sid).join("spectator")
            await viewer.next_frame()
            t_left = time.monotonic()
            status, _ = await api(
                http, "DELETE", f"{url}/api/streams/sessions/{sid}/viewers/{viewer.viewer_id}"
            )
            assert status == 204
            await viewer.close()
            reason = await until_ended(http, url, sid, 10)
            assert reason == "no viewers for 1 s"
            assert time.monotonic() - t_left >= 0.9

    with running(stream_settings.with_(stream_grace_s=1.0)) as service:
        asyncio.run(body(service.url))


def test_a_session_whose_lease_is_lost_ends_and_stops_its_app(
    stream_settings: Settings, redis_url: str
) -> None:
    allocator = SlotAllocator(redis.Redis.from_url(redis_url))

    async def body(url: str, service_sessions: dict[str, object]) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            desktop = {"app": "desktop", "width": 320, "height": 240}
            status, session = await api(http, "POST", f"{url}/api/streams/sessions", desktop)
            assert status == 201, session
            sid = session["session_id"]
            live = service_sessions[sid]
            pids = live.pids()  # type: ignore[attr-defined]
            app_group = pids[1]
            # the desktop is a window manager and a terminal in one process group
            until(lambda: len(group_members(app_group)) >= 2, 10, "openbox and xterm running")
            # the lease disappears under the session (an operator, or the allocator)
            assert allocator.release(live.lease)  # type: ignore[attr-defined]
            reason = await until_ended(http, url, sid, 10)
            assert reason.startswith("lease lost"), reason
            assert group_members(app_group) == [] and group_members(pids[0]) == []

    with running(stream_settings.with_(lease_ttl_s=1.5)) as service:
        asyncio.run(body(service.url, service.sessions))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"app": "nope"}, 404, "not_found"),
        ({"app": "game", "width": 99}, 400, "bad_parameter"),
        ({"app": "game", "fps": "60"}, 400, "bad_parameter"),
        ({"app": "testpattern", "width": 320, "height": 240}, 400, "bad_parameter"),
        ([1, 2], 400, "bad_parameter"),
    ],
)
def test_bad_session_requests_get_a_clear_4xx(
    stream_service: object, body: object, status: int, code: str
) -> None:
    url = stream_service.url  # type: ignore[attr-defined]

    async def main() -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            got, answer = await api(http, "POST", f"{url}/api/streams/sessions", body)
            assert (got, answer["error"]["code"]) == (status, code), answer
            assert answer["error"]["message"]
            got, _ = await api(http, "GET", f"{url}/api/streams/sessions")
            assert got == 200

    asyncio.run(main())


def test_an_offer_without_video_and_an_unknown_session_are_refused(stream_service: object) -> None:
    url = stream_service.url  # type: ignore[attr-defined]

    async def main() -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            sid = session["session_id"]
            viewers = f"{url}/api/streams/sessions/{sid}/viewers"
            status, answer = await api(http, "POST", viewers, {"type": "offer", "sdp": "v=0"})
            assert status == 400, answer
            status, answer = await api(http, "POST", viewers, {"type": "offer"})
            assert status == 400
            status, answer = await api(http, "POST", f"{url}/api/streams/sessions/x/control",
                                       {"viewer_id": "y"})  # fmt: skip
            assert (status, answer["error"]["code"]) == (404, "not_found")
            status, answer = await api(http, "POST", f"{url}/api/streams/sessions/{sid}/control",
                                       {"viewer_id": "y"})  # fmt: skip
            assert status == 404

    asyncio.run(main())


def test_farm_stream_serves_registers_and_unregisters(
    stream_settings: Settings, redis_url: str
) -> None:
    env = {**os.environ, **stream_settings.to_env()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm", "stream"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = json.loads(proc.stdout.readline())
        conn = redis.Redis.from_url(redis_url, decode_responses=True)
        entry = json.loads(conn.hget(keys.STREAM_SERVICES, line["device_id"]) or "{}")
        assert entry["url"] == line["url"] and entry["pid"] == proc.pid
        assert entry["alive_until"] > time.time()
        # and on the workers page: a stream service of its device, idle
        registry = workerstate.registry_for(conn, stream_settings)
        (listed,) = [w for w in registry.list() if w.pid == proc.pid]
        assert (listed.kind, listed.device_id, listed.state) == ("stream", line["device_id"],
                                                                 "idle")  # fmt: skip

        async def apps() -> list[str]:
            async with aiohttp.ClientSession(headers=operator_headers()) as http:
                _status, body = await api(http, "GET", f"{line['url']}/api/streams/apps")
                return [a["name"] for a in body["apps"]]

        assert {"desktop", "game", "testpattern"} <= set(asyncio.run(apps()))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert conn.hget(keys.STREAM_SERVICES, line["device_id"]) is None
        assert registry.get(listed.name) is None, "a service that stops leaves the list"
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_services_heartbeat_registration_and_workers_page_entry_are_one_round_trip(
    stream_service: StreamService, stream_settings: Settings, round_trips: Counter[str]
) -> None:
    """Its device agent's heartbeat (the device alive in the pool), its registration (the web
    finds it there) and its entry on the workers page were three round trips every beat."""
    agent = stream_service.agent
    assert agent is not None
    conn = redis.Redis.from_url(stream_settings.redis_url, decode_responses=True)
    conn.delete(keys.STREAM_SERVICES, keys.worker(stream_service.name))
    me = threading.current_thread().name
    before = round_trips[me]
    agent.beat()
    assert round_trips[me] - before == 1
    entry = json.loads(conn.hget(keys.STREAM_SERVICES, stream_service.device.id) or "{}")
    assert entry["url"] == stream_service.url
    listed = workerstate.registry_for(conn, stream_settings).get(stream_service.name)
    assert listed is not None and (listed.kind, listed.state) == ("stream", "idle")
    (device,) = SlotAllocator(conn).devices([stream_service.device.id])
    assert device.alive
    conn.close()


def test_a_services_beat_carries_its_sessions_renewals_in_its_round_trip(
    stream_service: StreamService, stream_settings: Settings, round_trips: Counter[str]
) -> None:
    """The sessions' leases were renewed in a round trip of their own each tick, beside the
    agent's heartbeat; the heartbeat now carries them (``StreamService._beat``, the
    renewals' carrier), and each session gets its own lease's outcome."""
    conn = redis.Redis.from_url(stream_settings.redis_url, decode_responses=True)
    alloc = SlotAllocator(conn, ttl_s=stream_settings.lease_ttl_s)
    mine = Request("stream", encoder_sessions=1, device_ids=(stream_service.device.id,))
    held = [alloc.acquire(f"session-{i}", mine) for i in range(2)]
    gone = alloc.acquire("session-gone", mine)
    alloc.release(gone)
    conn.delete(keys.STREAM_SERVICES)
    time.sleep(0.05)
    me = threading.current_thread().name
    before = round_trips[me]
    outcomes = stream_service._beat([*held, gone])
    assert round_trips[me] - before == 1
    renewed = [o for o in outcomes if isinstance(o, Lease)]
    assert [lease.id for lease in renewed] == [lease.id for lease in held]
    assert all(new.expires_ms > old.expires_ms for new, old in zip(renewed, held, strict=True))
    assert isinstance(outcomes[2], LeaseLost) and outcomes[2].fields["why"] == "unknown lease"
    assert conn.hexists(keys.STREAM_SERVICES, stream_service.device.id)  # the beat went too
    for lease in renewed:
        alloc.release(lease)
    conn.close()


def test_a_farm_stream_process_on_the_fake_t4_runs_through_the_test_entry_point(
    stream_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    # the fakes are test doubles: `python -m farm` refuses them (tests/farm/test_settings.py),
    # `python -m tests.doubles` is farm with them installed
    settings = stream_settings.with_(device="gpu", gpu_index=0, nvml="fake:t4", nvenc="fake")
    command = [sys.executable, "-m", "tests.doubles", "stream"]
    allocator = SlotAllocator(redis.Redis.from_url(redis_url))

    async def body(url: str) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            assert status == 201, session
            assert session["encoder"] == "h264_nvenc"
            (gpu,) = allocator.devices()
            assert (gpu.device_class, gpu.used_encoder_sessions) == ("t4", 1)

    with ServiceProcess(command, settings.to_env(), log=tmp_path / "stream.log") as service:
        asyncio.run(body(service.url))


def test_a_session_defaults_to_the_app_s_720p60(stream_service: object) -> None:
    url = stream_service.url  # type: ignore[attr-defined]

    async def main() -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        {"app": "testpattern"})  # fmt: skip
            assert status == 201, session
            assert (session["width"], session["height"], session["fps"]) == (1280, 720, 60)
            sid = session["session_id"]
            status, _ = await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")
            assert status == 204

    asyncio.run(main())


def test_a_cells_service_names_its_cell_in_its_sessions_ids(stream_settings: Settings) -> None:
    """In a farm of cells (farm.cells) the front door sends a session's requests to its cell by
    the id alone."""

    async def main(url: str) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            body = {"app": "testpattern", "width": 640, "height": 360}
            status, session = await api(http, "POST", f"{url}/api/streams/sessions", body)
            assert status == 201, session
            sid = session["session_id"]
            assert sid.startswith("c2-") and len(sid) == len("c2-") + 16, sid
            status, _ = await api(http, "DELETE", f"{url}/api/streams/sessions/{sid}")
            assert status == 204

    with running(stream_settings.with_(cell="c2")) as service:
        asyncio.run(main(service.url))


def test_an_app_that_quits_ends_its_session_and_one_that_cannot_start_is_refused(
    stream_settings: Settings, redis_url: str, tmp_path: Path
) -> None:
    apps = tmp_path / "apps.json"
    apps.write_text(json.dumps([
        {"name": "brief", "command": ["sleep", "0.5"], "width": 320, "height": 240, "fps": 10},
        {"name": "broken", "command": [str(tmp_path / "no-such-program")]},
    ]))  # fmt: skip

    async def body(url: str) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        {"app": "brief"})  # fmt: skip
            assert status == 201, session
            reason = await until_ended(http, url, session["session_id"], 10)
            assert reason == "app brief exited with status 0"
            status, refused = await api(http, "POST", f"{url}/api/streams/sessions",
                                        {"app": "broken", "width": 320, "height": 240})  # fmt: skip
            assert (status, refused["error"]["code"]) == (503, "source_failed"), refused
            assert "app broken could not start" in refused["error"]["message"]

    with running(stream_settings.with_(stream_apps=apps)) as service:
        asyncio.run(body(service.url))
        assert service.sessions == {}
    (device,) = SlotAllocator(redis.Redis.from_url(redis_url)).devices()
    assert device.used_encoder_sessions == 0 and device.leases == []


def test_a_gpu_service_accounts_nvenc_sessions_and_vram_on_its_gpu(
    stream_settings: Settings, redis_url: str
) -> None:
    # a T4 has one NVENC engine; one session per engine here, so the second is refused
    settings = stream_settings.with_(
        device="gpu", gpu_index=0, nvml="fake:t4", encoder_sessions_per_engine=1, nvenc="fake"
    )
    allocator = SlotAllocator(redis.Redis.from_url(redis_url))

    async def body(url: str, gpu_index: int | None) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, session = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            assert status == 201, session
            assert session["encoder"] == "h264_nvenc" and gpu_index == 0
            (gpu,) = allocator.devices()
            assert (gpu.device_class, gpu.used_encoder_sessions) == ("t4", 1)
            assert gpu.used_vram_mib == settings.stream_vram_mib
            status, refused = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            assert status == 503 and "1/1 encoder sessions" in refused["error"]["message"]

    with running(settings) as service:
        asyncio.run(body(service.url, service.device.index))
        (live,) = service.sessions.values()
        assert live.pipeline is not None and live.pipeline.encoder.options["gpu"] == "0"
        # its next heartbeat puts its session and its GPU's utilisation on the workers page
        service.nvml.set_usage(0, utilization_pct=37)  # type: ignore[union-attr]
        assert service.agent is not None
        service.agent.beat()
        conn = redis.Redis.from_url(redis_url, decode_responses=True)
        listed = workerstate.registry_for(conn, settings).get(service.name)
        conn.close()
        assert listed is not None
        assert (listed.kind, listed.device_class, listed.state, listed.task) == (
            "stream", "t4", "streaming", "1 session")  # fmt: skip
        assert listed.utilization_pct == 37


def test_a_gpu_service_whose_nvml_hangs_keeps_renewing_its_sessions(
    stream_settings: Settings, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sessions' renewals ride the agent's heartbeat, which read NVML first (twice: its
    reading, then the workers page's utilisation): a driver that stopped answering held the
    beat, and the leases lapsed under sessions still streaming. The beat now waits for NVML
    no longer than ``NVML_WAIT_S``, and reports no utilisation without a reading."""
    monkeypatch.setattr(agent_module, "NVML_WAIT_S", 0.2)
    settings = stream_settings.with_(device="gpu", gpu_index=0, nvml="fake:t4", nvenc="fake")
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    alloc = SlotAllocator(conn, ttl_s=settings.lease_ttl_s)
    with running(settings) as service:
        nvml = service.nvml
        assert isinstance(nvml, FakeNvml)
        held = alloc.acquire("session-1", Request("stream", encoder_sessions=1,
                                                  device_ids=(service.device.id,)))  # fmt: skip
        nvml.set_usage(0, utilization_pct=37)
        nvml.stall()
        try:
            # past a tick of the service's own beats (every second here): a beat that read NVML
            # before it hung has written its reading, and every later beat finds NVML late
            time.sleep(1.2)
            outcomes: list[Lease | LeaseLost] = []
            beat = threading.Thread(target=lambda: outcomes.extend(service._beat([held])))
            beat.start()
            beat.join(2.0)
            assert not beat.is_alive(), "the beat is held by NVML"
            # read while NVML still hangs: once it answers, the next tick shows its reading
            listed = workerstate.registry_for(conn, settings).get(service.name)
        finally:
            nvml.answer()
        (renewed,) = outcomes
        assert isinstance(renewed, Lease) and renewed.expires_ms > held.expires_ms
        assert listed is not None and listed.utilization_pct is None  # not the stale 37
        alloc.release(renewed)
    conn.close()


def test_a_gpu_without_nvenc_refuses_streams_for_good(stream_settings: Settings) -> None:
    settings = stream_settings.with_(device="gpu", gpu_index=0, nvml="fake:h200")

    async def body(url: str) -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            status, refused = await api(http, "POST", f"{url}/api/streams/sessions",
                                        SMALL_PATTERN)  # fmt: skip
            assert (status, refused["error"]["code"]) == (422, "never_fits")
            assert "can never hold a stream session" in refused["error"]["message"], refused

    with running(settings) as service:
        asyncio.run(body(service.url))


def test_the_player_and_the_api_carry_the_farm_s_browser_rules(stream_service: object) -> None:
    # the player is a page of the stream service too: no inline script, never framed, and API
    # answers (tokens) never kept by a shared cache
    url = stream_service.url  # type: ignore[attr-defined]

    async def main() -> None:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            for path in ("/player", "/player.js", "/api/streams/sessions", "/no-such-page"):
                async with http.get(f"{url}{path}") as resp:
                    assert resp.headers.get("Content-Security-Policy") == browserrules.CSP, path
                    assert resp.headers["X-Frame-Options"] == "DENY"
                    assert resp.headers["Server"] == "tessera", path
            async with http.get(f"{url}/api/streams/sessions") as resp:
                assert resp.headers["Cache-Control"] == "no-store"

    asyncio.run(main())
