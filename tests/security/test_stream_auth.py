"""The stream service answers only requests carrying a stream token for what they touch."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from encoder.app import running
from encoder.service import StreamService
from farm import streamauth
from farm.settings import Settings
from tests.encoder import tokens

#: FARM_METRICS_TOKEN of the service under test: Prometheus' static scrape token
SCRAPE_TOKEN = "scrape-" + "y" * 24


@pytest.fixture(scope="module")
def service(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamService]:
    settings = Settings().with_(
        redis_url=redis_server.url.rsplit("/", 1)[0] + "/2",
        work_dir=tmp_path_factory.mktemp("stream-auth"),
        device="cpu",
        stream_port=0,
        cpu_encode_sessions=3,
        stream_secret=tokens.STREAM_SECRET,
        metrics_token=SCRAPE_TOKEN,
    )
    with running(settings) as svc:
        yield svc


def call(
    service: StreamService, method: str, path: str, token: str | None = None, body: Any = None
) -> tuple[int, Any]:
    async def go() -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, service.url + path, json=body, headers=headers) as resp,
        ):
            text = await resp.text()
            if resp.content_type != "application/json":
                return resp.status, text
            return resp.status, json.loads(text)

    return asyncio.run(go())


def launch(service: StreamService, project: str) -> str:
    token = tokens.viewer("", "controller", project=project)
    status, data = call(
        service, "POST", "/api/streams/sessions", token,
        {"app": "testpattern", "width": 512, "height": 64, "fps": 10},
    )  # fmt: skip
    assert status == 201, data
    return str(data["session_id"])


ROUTES = [
    ("GET", "/api/streams/apps"),
    ("GET", "/api/streams/device"),
    ("GET", "/api/streams/ice"),
    ("GET", "/api/streams/sessions"),
    ("POST", "/api/streams/sessions"),
    ("GET", "/api/streams/sessions/{sid}"),
    ("DELETE", "/api/streams/sessions/{sid}"),
    ("POST", "/api/streams/sessions/{sid}/viewers"),
    ("DELETE", "/api/streams/sessions/{sid}/viewers/v1"),
    ("POST", "/api/streams/sessions/{sid}/control"),
    ("GET", "/metrics"),
]


def test_every_route_refuses_no_token_an_expired_one_and_a_forged_one(
    service: StreamService,
) -> None:
    sid = launch(service, "A")
    expired = streamauth.sign(
        tokens.STREAM_SECRET, streamauth.StreamClaims("operator", time.time() - 1)
    )
    forged = streamauth.operator_token("another-farm-secret-" + "y" * 32, 3600)
    for method, path in ROUTES:
        path = path.format(sid=sid)
        for token in (None, expired, forged, "garbage", forged.split(".")[0]):
            status, body = call(service, method, path, token, {"app": "testpattern"})
            assert status == 401, (method, path, token, body)
        status, _ = call(service, method, path + f"?token={expired}")
        assert status == 401, (method, path)
    # the operator reaches them (the session still runs: nothing above touched it)
    assert call(service, "GET", f"/api/streams/sessions/{sid}", tokens.operator())[0] == 200
    assert call(service, "GET", "/metrics", tokens.operator())[0] == 200
    assert call(service, "DELETE", f"/api/streams/sessions/{sid}", tokens.operator())[0] == 204


def test_a_token_for_one_session_cannot_touch_another(service: StreamService) -> None:
    mine, theirs = launch(service, "A"), launch(service, "B")
    token = tokens.viewer(mine, "controller", project="A")
    assert call(service, "GET", f"/api/streams/sessions/{mine}", token)[0] == 200
    for method, path in ROUTES[5:10]:
        status, body = call(service, method, path.format(sid=theirs), token, {"sdp": "v=0"})
        assert status == 403, (method, path, body)
    # the list holds the token's project's sessions only
    status, listed = call(service, "GET", "/api/streams/sessions", token)
    assert status == 200
    assert [s["session_id"] for s in listed["sessions"]] == [mine]
    # its session still runs: another's token ended nothing
    status, state = call(service, "GET", f"/api/streams/sessions/{theirs}", tokens.operator())
    assert (status, state["state"]) == (200, "running")
    for sid in (mine, theirs):
        call(service, "DELETE", f"/api/streams/sessions/{sid}", tokens.operator())


def test_a_spectator_cannot_control_end_launch_or_join_as_player(service: StreamService) -> None:
    sid = launch(service, "A")
    watcher = tokens.viewer(sid, "spectator", project="A")
    assert call(service, "GET", f"/api/streams/sessions/{sid}", watcher)[0] == 200
    refused = [
        call(service, "POST", f"/api/streams/sessions/{sid}/control", watcher, {"viewer_id": "x"}),
        call(service, "POST", f"/api/streams/sessions/{sid}/viewers", watcher,
             {"sdp": "v=0", "role": "player"}),
        call(service, "DELETE", f"/api/streams/sessions/{sid}", watcher),
        call(service, "POST", "/api/streams/sessions", tokens.viewer("", "spectator", "A"),
             {"app": "testpattern"}),
    ]  # fmt: skip
    assert [status for status, _ in refused] == [403, 403, 403, 403], refused
    status, state = call(service, "GET", f"/api/streams/sessions/{sid}", tokens.operator())
    assert (status, state["state"]) == (200, "running")
    call(service, "DELETE", f"/api/streams/sessions/{sid}", tokens.operator())


def test_desktop_apps_are_for_project_admins(service: StreamService) -> None:
    member = tokens.viewer("", "controller", project="A")
    status, body = call(service, "POST", "/api/streams/sessions", member, {"app": "desktop"})
    assert status == 403 and "policy" in body["error"]["message"]
    # operators only here: the routes a project's token does not reach
    assert call(service, "GET", "/api/streams/device", member)[0] == 403
    assert call(service, "GET", "/metrics", member)[0] == 403


def test_the_scrape_token_reads_metrics_and_nothing_else(service: StreamService) -> None:
    status, body = call(service, "GET", "/metrics", SCRAPE_TOKEN)
    assert status == 200 and "tessera_stream" in body
    assert call(service, "GET", "/metrics", SCRAPE_TOKEN[:-1] + "z")[0] == 401
    for method, path in [("GET", "/api/streams/sessions"), ("GET", "/api/streams/device"),
                         ("POST", "/api/streams/sessions")]:  # fmt: skip
        assert call(service, method, path, SCRAPE_TOKEN)[0] == 401, path


def test_the_player_page_itself_needs_no_token(service: StreamService) -> None:
    async def go() -> list[int]:
        async with aiohttp.ClientSession() as http:
            out = []
            for path in ("/player", "/player.js", "/player.css"):
                async with http.get(service.url + path) as resp:
                    out.append(resp.status)
            return out

    assert asyncio.run(go()) == [200, 200, 200]


def test_the_service_refuses_to_start_without_a_secret(tmp_path: Any, redis_url: str) -> None:
    from farm.errors import SetupError

    settings = Settings().with_(redis_url=redis_url, device="cpu", stream_port=0)
    with pytest.raises(SetupError, match="FARM_STREAM_SECRET"), running(settings):
        pass


def test_farm_stream_token_prints_an_operator_token(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from farm import cli

    monkeypatch.setenv("FARM_STREAM_SECRET", tokens.STREAM_SECRET)
    assert cli.main(["stream-token", "--ttl", "60"]) == 0
    claims = streamauth.verify(tokens.STREAM_SECRET, capsys.readouterr().out.strip())
    assert claims.operator and claims.exp <= time.time() + 60
    monkeypatch.setenv("FARM_STREAM_SECRET", "short")
    assert cli.main(["stream-token"]) != 0
    assert "FARM_STREAM_SECRET" in capsys.readouterr().err
