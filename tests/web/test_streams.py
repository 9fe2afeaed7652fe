"""Stream routes through the web: catalog, launch for a project, who sees it, end."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from farm import jobstore
from farm.accounts import Accounts
from farm.settings import Settings
from tests.clocks import host_clock, off_by, process_clock
from tests.encoder.tokens import STREAM_SECRET
from tests.web.conftest import Tokens, api, bearer
from web.appkeys import CONN


async def test_launch_list_and_end_a_stream_through_the_web(
    web_settings: Settings, tokens: Tokens
) -> None:
    from encoder.app import serving

    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(
        device="cpu", stream_port=0, cpu_encode_sessions=2, lease_ttl_s=3.0, agent_timeout_s=3.0
    )
    alice, bob, vera = bearer(tokens.alice), bearer(tokens.bob), bearer(tokens.vera)
    async with api(web_settings) as client:
        none = await client.get("/api/streams/apps", headers=alice)
        assert none.status == 503
        assert "farm stream" in (await none.json())["error"]["message"]
        async with serving(stream_settings):
            apps = await (await client.get("/api/streams/apps", headers=alice)).json()
            assert "testpattern" in {a["name"] for a in apps["apps"]}
            ice = await client.get("/api/streams/ice", headers=alice)
            assert "iceServers" in await ice.json()
            refused = await client.post(
                "/api/streams/sessions",
                json={"app": "testpattern", "project": "A"},
                headers=vera,
            )
            assert refused.status == 403
            made = await client.post(
                "/api/streams/sessions",
                json={"app": "testpattern", "project": "A", "width": 640, "height": 360},
                headers=alice,
            )
            assert made.status == 201, await made.text()
            session = await made.json()
            sid = session["session_id"]
            assert (session["project"], session["owner"]) == ("A", "alice")
            listed = await (await client.get("/api/streams/sessions", headers=vera)).json()
            assert [s["session_id"] for s in listed["sessions"]] == [sid]
            assert (await (await client.get("/api/streams/sessions", headers=bob)).json()) == {
                "sessions": []
            }
            assert (await client.get(f"/api/streams/sessions/{sid}", headers=bob)).status == 404
            assert (await client.delete(f"/api/streams/sessions/{sid}", headers=vera)).status == 403
            got = await (await client.get(f"/api/streams/sessions/{sid}", headers=vera)).json()
            assert got["app"] == "testpattern"
            ended = await client.delete(f"/api/streams/sessions/{sid}", headers=alice)
            assert ended.status == 204
            gone = await client.get(f"/api/streams/sessions/{sid}", headers=alice)
            assert gone.status == 404
            # a farm admin sets project A's policy: members off the CPU, no stream for alice
            put = await client.put(
                "/api/projects/A/policy",
                json={"role": "member", "devices": ["gpu"]},
                headers=bearer(tokens.admin),
            )
            assert put.status == 200, await put.text()
            assert (await put.json())["policy"]["member"] == ["gpu"]
            denied = await client.post(
                "/api/streams/sessions", json={"app": "testpattern", "project": "A"}, headers=alice
            )
            assert denied.status == 403
            assert "'cpu'" in (await denied.json())["error"]["message"]


async def test_a_websocket_viewer_through_the_web_is_project_checked_and_gets_the_video(
    web_settings: Settings, tokens: Tokens
) -> None:
    from encoder.app import serving
    from encoder.wsviewer import HEADER, KEYFRAME

    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(
        device="cpu", stream_port=0, cpu_encode_sessions=2, lease_ttl_s=3.0, agent_timeout_s=3.0
    )
    alice, bob, vera = bearer(tokens.alice), bearer(tokens.bob), bearer(tokens.vera)
    async with api(web_settings) as client, serving(stream_settings):
        made = await client.post(
            "/api/streams/sessions",
            json={"app": "testpattern", "project": "A", "width": 640, "height": 360},
            headers=alice,
        )
        assert made.status == 201, await made.text()
        sid = (await made.json())["session_id"]
        path = f"/api/streams/sessions/{sid}/ws"
        # another project's member does not see the session; a cookie from another site is
        # refused (a cross-site WebSocket would ride the user's login)
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(path, headers=bob)
        assert refused.value.status == 404
        login = await client.post("/api/login", json={"token": tokens.alice})
        assert login.status == 200
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(path, headers={"Origin": "https://elsewhere.example"})
        assert refused.value.status == 403
        own = str(client.make_url("/")).rstrip("/")
        async with client.ws_connect(path, headers={"Origin": own}) as ws:
            assert (await ws.receive_json(timeout=10))["t"] == "hello"
        client.session.cookie_jar.clear()
        # a project viewer joins as a spectator whatever it asks, and gets a keyframe at once
        async with client.ws_connect(path + "?role=player", headers=vera) as ws:
            hello = await ws.receive_json(timeout=10)
            assert (hello["t"], hello["role"], hello["controlling"]) == (
                "hello",
                "spectator",
                False,
            )
            msg = await ws.receive(timeout=10)
            assert msg.type == aiohttp.WSMsgType.BINARY
            _version, flags, _at = HEADER.unpack_from(msg.data)
            assert flags & KEYFRAME
            await ws.send_json({"t": "ping", "ts": 7})
            while True:
                msg = await ws.receive(timeout=10)
                if msg.type == aiohttp.WSMsgType.TEXT and msg.json().get("t") == "pong":
                    break
        async with client.ws_connect(path, headers=alice) as ws:
            hello = await ws.receive_json(timeout=10)
            assert (hello["role"], hello["controlling"]) == ("player", True)
        ended = await client.delete(f"/api/streams/sessions/{sid}", headers=alice)
        assert ended.status == 204


async def test_desktop_apps_follow_the_projects_policy(
    web_settings: Settings, tokens: Tokens
) -> None:
    from encoder.app import serving

    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(
        device="cpu", stream_port=0, cpu_encode_sessions=2, lease_ttl_s=3.0, agent_timeout_s=3.0
    )
    conn = jobstore.connect(web_settings.redis_url)
    try:
        accounts = Accounts(conn)
        accounts.set_role("ada", "A", "admin")
        ada = bearer(accounts.create_token("ada").token)
    finally:
        conn.close()
    alice = bearer(tokens.alice)
    desktop = {"app": "desktop", "project": "A", "width": 640, "height": 360, "fps": 10}

    async def launchable() -> set[str]:
        got = await client.get("/api/streams/apps?project=A", headers=alice)
        assert got.status == 200, await got.text()
        return {a["name"] for a in (await got.json())["apps"]}

    async with api(web_settings) as client, serving(stream_settings):
        # by default a shell is for project admins: a member neither sees nor launches one
        assert "desktop" not in await launchable()
        refused = await client.post("/api/streams/sessions", json=desktop, headers=alice)
        assert refused.status == 403
        assert "policy" in (await refused.json())["error"]["message"]
        bad = await client.put(
            "/api/projects/A/policy", json={"desktop_apps": "viewer"}, headers=ada
        )
        assert bad.status == 400
        member_may = await client.put(
            "/api/projects/A/policy", json={"desktop_apps": "member"}, headers=alice
        )
        assert member_may.status == 403  # a member cannot widen its own rights
        opened = await client.put(
            "/api/projects/A/policy", json={"desktop_apps": "member"}, headers=ada
        )
        assert opened.status == 200 and (await opened.json())["desktop_apps"] == "member"
        assert "desktop" in await launchable()
        made = await client.post("/api/streams/sessions", json=desktop, headers=alice)
        assert made.status == 201, await made.text()
        sid = (await made.json())["session_id"]
        assert (await client.delete(f"/api/streams/sessions/{sid}", headers=alice)).status == 204


async def test_a_drained_stream_service_starts_no_session_and_its_running_one_continues(
    web_settings: Settings, tokens: Tokens
) -> None:
    from encoder.app import serving

    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(
        device="cpu", stream_port=0, cpu_encode_sessions=2, lease_ttl_s=3.0, agent_timeout_s=3.0
    )
    alice, admin = bearer(tokens.alice), bearer(tokens.admin)
    launch = {"app": "testpattern", "project": "A", "width": 640, "height": 360}

    async def services() -> list[dict[str, Any]]:
        body = await (await client.get("/api/workers", headers=admin)).json()
        return [w for w in body["workers"] if w["kind"] == "stream"]

    async with api(web_settings) as client, serving(stream_settings):
        made = await client.post("/api/streams/sessions", json=launch, headers=alice)
        assert made.status == 201, await made.text()
        sid = (await made.json())["session_id"]
        (service,) = await services()
        drain = await client.post(f"/api/workers/{service['name']}/disable", headers=admin)
        assert drain.status == 200, await drain.text()
        refused = await client.post("/api/streams/sessions", json=launch, headers=alice)
        assert refused.status == 503
        assert "drained" in (await refused.json())["error"]["message"]
        running = await client.get(f"/api/streams/sessions/{sid}", headers=alice)
        assert running.status == 200 and (await running.json())["state"] == "running"
        # the workers page shows it draining: disabled, with its running session
        deadline = time.monotonic() + 10
        while (await services())[0]["state"] != "draining":
            assert time.monotonic() < deadline, await services()
            await asyncio.sleep(0.1)
        assert (await client.delete(f"/api/streams/sessions/{sid}", headers=alice)).status == 204
        enable = await client.post(f"/api/workers/{service['name']}/enable", headers=admin)
        assert enable.status == 200
        again = await client.post("/api/streams/sessions", json=launch, headers=alice)
        assert again.status == 201, await again.text()
        gone = await client.delete(
            f"/api/streams/sessions/{(await again.json())['session_id']}", headers=alice
        )
        assert gone.status == 204


@pytest.mark.parametrize("skewed", ["web", "service"])
async def test_stream_tokens_hold_between_hosts_whose_clocks_differ(
    web_settings: Settings, tokens: Tokens, monkeypatch: pytest.MonkeyPatch, skewed: str
) -> None:
    """The web signs each call's stream token and the service checks it, both on Redis's
    clock (farm.redisclock). One host's clock is 10 minutes off, past a token's life
    (FARM_STREAM_TOKEN_TTL_S, 300 s): a web behind, or a service ahead. The web still
    reaches the service; on the hosts' own clocks every token had expired for it (401)."""
    from encoder.app import serving

    wrong = off_by(-600.0 if skewed == "web" else 600.0)
    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(device="cpu", stream_port=0, cpu_encode_sessions=2)
    async with serving(stream_settings) as service, api(web_settings) as client:
        wrong_conn = client.app[CONN] if skewed == "web" else service.conn
        assert wrong_conn is not None
        host_clock(wrong_conn, wrong)
        # this process's clock while the call goes through: the wrong host's (the other
        # side's farm.redisclock keeps the right one)
        with process_clock(monkeypatch, wrong):
            got = await client.get("/api/streams/apps", headers=bearer(tokens.alice))
        assert got.status == 200, await got.text()
        assert "testpattern" in {a["name"] for a in (await got.json())["apps"]}


async def test_a_stream_service_whose_clock_runs_behind_stays_listed(
    web_settings: Settings, tokens: Tokens, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream service registers itself alive until a deadline the web checks: on Redis's
    clock, a service host 10 minutes behind stays listed. On its own clock its registration
    had expired as it was written, and the web said no stream service was running (503)."""
    from encoder.app import serving

    behind = off_by(-600.0)
    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(device="cpu", stream_port=0, cpu_encode_sessions=2)
    async with serving(stream_settings) as service, api(web_settings) as client:
        assert service.conn is not None
        host_clock(service.conn, behind)
        with process_clock(monkeypatch, behind):  # the service's heartbeat, on that host
            assert service.agent is not None
            await asyncio.to_thread(service.agent.beat)
        got = await client.get("/api/streams/apps", headers=bearer(tokens.alice))
        assert got.status == 200, await got.text()
