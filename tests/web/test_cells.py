"""A farm split in two cells behind one front door: each cell its own redis-server, web and
storage, the accounts in a control Redis both share (farm.cells, web/frontdoor.py).

Project A is pinned to cell c1, project B to c2; alice is in both. Through the front door a
job, an upload and its deletion land in their project's cell and nowhere else, job ids carry
the cell, the lists of all a user's projects are put together from both cells, an event
stream and a large upload pass through as streams, and a cell's web asked directly about
another cell's project answers 421."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from playwright.sync_api import Browser, expect

from farm import jobstore, keys
from farm.accounts import Accounts
from farm.errors import BadParameter
from farm.metrics import REGISTRY
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.conftest import TESTDATA
from tests.web.conftest import bearer, make_job, make_web_settings, scene_report
from tests.web.test_addon_client import LiveWeb
from web import frontdoor
from web.app import create_app
from web.frontdoor import create_frontdoor
from web.serve import run

PLAIN = TESTDATA / "01_principled_material.blend"


@pytest.fixture
def second_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Cell c2's own redis-server (c1 has the session's)."""
    with RedisServer(tmp_path_factory.mktemp("cell2"), unix_socket=False) as server:
        yield server.url


@dataclass
class Farm:
    c1: Settings
    c2: Settings
    control: str
    alice: str
    bob: str
    root: str


@pytest.fixture
def farm(redis_url: str, second_redis: str, tmp_path: Path) -> Farm:
    control = redis_url.rsplit("/", 1)[0] + "/1"  # the session's server, another database
    conn = jobstore.connect(control)
    try:
        # a project is pinned to the cell of whoever makes it
        Accounts(conn, cell="c1").set_role("alice", "A", "member")
        Accounts(conn, cell="c1").set_role("alice", "C", "member")
        Accounts(conn, cell="c2").set_role("alice", "B", "member")
        Accounts(conn, cell="c2").set_role("bob", "B", "member")
        alice = Accounts(conn).create_token("alice").token
        bob = Accounts(conn).create_token("bob").token
        Accounts(conn).ensure_user("root", admin=True)
        root = Accounts(conn).create_token("root").token
    finally:
        conn.close()
    cells = [
        make_web_settings(url, tmp_path / name).with_(cell=name, control_redis_url=control)
        for name, url in (("c1", redis_url), ("c2", second_redis))
    ]
    return Farm(cells[0], cells[1], control, alice, bob, root)


@asynccontextmanager
async def front_door(farm: Farm) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """Both cells' webs and the front door on loopback ports; a client and the door's URL."""
    async with TestServer(create_app(farm.c1)) as one, TestServer(create_app(farm.c2)) as two:
        cells = f"c1={str(one.make_url('')).rstrip('/')},c2={str(two.make_url('')).rstrip('/')}"
        door = create_frontdoor(Settings().with_(cells=cells, control_redis_url=farm.control))
        async with TestServer(door) as server, aiohttp.ClientSession() as client:
            yield client, str(server.make_url("")).rstrip("/")


def _in_cell(settings: Settings, key: str) -> bool:
    conn = jobstore.connect(settings.redis_url)
    try:
        return bool(conn.exists(key))
    finally:
        conn.close()


def _inspected(settings: Settings, sha: str) -> None:
    """The upload's inspection report cached in its cell: a job submits without a worker."""
    conn = jobstore.connect(settings.redis_url)
    try:
        conn.set(keys.inspection(sha), json.dumps(scene_report().to_dict()))
    finally:
        conn.close()


async def _upload(client: aiohttp.ClientSession, url: str, token: str, project: str) -> str:
    resp = await client.put(f"{url}/api/uploads/scene.blend?project={project}",
                            data=PLAIN.read_bytes(), headers=bearer(token))  # fmt: skip
    assert resp.status == 201, await resp.text()
    return str((await resp.json())["upload_id"])


async def _submit(
    client: aiohttp.ClientSession, url: str, token: str, project: str, sha: str
) -> dict[str, Any]:
    body = {"project": project, "upload_id": sha, "frames": "1"}
    resp = await client.post(f"{url}/api/jobs", json=body, headers=bearer(token))
    assert resp.status == 201, await resp.text()
    job: dict[str, Any] = await resp.json()
    return job


async def test_jobs_and_uploads_live_in_their_projects_cell(
    farm: Farm, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bodies larger than this are streamed to their cell, not read whole
    monkeypatch.setattr(frontdoor, "BUFFERED_BYTES", 4096)
    assert PLAIN.stat().st_size > 4096
    async with front_door(farm) as (client, url):
        sha = await _upload(client, url, farm.alice, "B")
        assert _in_cell(farm.c2, keys.upload("B", sha))
        assert not _in_cell(farm.c1, keys.upload("B", sha))
        _inspected(farm.c2, sha)
        job = await _submit(client, url, farm.alice, "B", sha)
        assert job["job_id"].startswith("c2-")
        assert _in_cell(farm.c2, keys.job(job["job_id"]))
        assert not _in_cell(farm.c1, keys.job(job["job_id"]))

        _inspected(farm.c1, await _upload(client, url, farm.alice, "A"))
        other = await _submit(client, url, farm.alice, "A", sha)
        assert other["job_id"].startswith("c1-")

        # each job by its id, from its cell; bob sees B's job, not A's
        for token, job_id, status in [
            (farm.alice, job["job_id"], 200),
            (farm.alice, other["job_id"], 200),
            (farm.bob, job["job_id"], 200),
            (farm.bob, other["job_id"], 404),
        ]:
            resp = await client.get(f"{url}/api/jobs/{job_id}", headers=bearer(token))
            assert resp.status == status, (job_id, await resp.text())

        # the lists of all the user's projects come from both cells, newest first
        listed = await (await client.get(f"{url}/api/jobs", headers=bearer(farm.alice))).json()
        assert [j["job_id"] for j in listed["jobs"]] == [other["job_id"], job["job_id"]]
        me = await (await client.get(f"{url}/api/me", headers=bearer(farm.alice))).json()
        assert sorted((p["id"], p["cell"]) for p in me["projects"]) == [
            ("A", "c1"), ("B", "c2"), ("C", "c1"),
        ]  # fmt: skip
        ups = await (await client.get(f"{url}/api/uploads", headers=bearer(farm.alice))).json()
        assert sorted(u["project"] for u in ups["uploads"]) == ["A", "B"]
        # what is not put together says so, rather than answer with one cell's part
        feed = await client.get(f"{url}/api/events", headers=bearer(farm.alice))
        assert feed.status == 400 and "?project=" in (await feed.json())["error"]["message"]
        only_b = await client.get(f"{url}/api/jobs?project=B", headers=bearer(farm.alice))
        assert [j["job_id"] for j in (await only_b.json())["jobs"]] == [job["job_id"]]

        # one batch action on jobs of both cells: each cell acts on its own
        resp = await client.post(
            f"{url}/api/jobs/batch", headers=bearer(farm.alice),
            json={"action": "suspend", "ids": [job["job_id"], other["job_id"], job["job_id"]]},
        )  # fmt: skip
        assert resp.status == 200, await resp.text()
        results = (await resp.json())["results"]
        assert [(r["job_id"], r["ok"]) for r in results] == [
            (job["job_id"], True), (other["job_id"], True),
        ]  # fmt: skip
        for job_id in (job["job_id"], other["job_id"]):
            got = await client.get(f"{url}/api/jobs/{job_id}", headers=bearer(farm.alice))
            assert (await got.json())["state"] == "suspended"

        # a job's event stream passes through as it comes
        async with client.get(
            f"{url}/api/jobs/{job['job_id']}/events", headers=bearer(farm.alice)
        ) as events:
            assert events.status == 200
            assert events.headers["Content-Type"].startswith("text/event-stream")
            first = await events.content.readuntil(b"\n\n")
            event = json.loads(first.split(b"data: ", 1)[1])
            assert (event["job_id"], event["state"]) == (job["job_id"], "queued")

        # an upload session's id names its cell; its chunks reach that cell
        made = await client.post(
            f"{url}/api/uploads/sessions", headers=bearer(farm.alice),
            json={"project": "B", "name": "s.blend", "size": PLAIN.stat().st_size},
        )  # fmt: skip
        assert made.status == 201, await made.text()
        session = (await made.json())["session_id"]
        assert session.startswith("c2-")
        found = await client.get(
            f"{url}/api/uploads/sessions/{session}", headers=bearer(farm.alice)
        )
        assert found.status == 200, await found.text()
        assert (await found.json())["project"] == "B"


async def test_a_cell_serves_only_its_projects(farm: Farm) -> None:
    async with TestServer(create_app(farm.c2)) as two, aiohttp.ClientSession() as client:
        direct = str(two.make_url("")).rstrip("/")
        resp = await client.get(f"{direct}/api/jobs?project=A", headers=bearer(farm.alice))
        assert resp.status == 421, await resp.text()
        error = (await resp.json())["error"]
        assert (error["code"], error["cell"]) == ("wrong_cell", "c1")
        resp = await client.put(f"{direct}/api/uploads/x.blend?project=A",
                                data=PLAIN.read_bytes(), headers=bearer(farm.alice))  # fmt: skip
        assert resp.status == 421
        assert not _in_cell(farm.c2, keys.project_uploads("A"))
        # the lists of all the user's projects leave the other cell's out
        listed = await client.get(f"{direct}/api/jobs", headers=bearer(farm.alice))
        assert listed.status == 200 and (await listed.json())["jobs"] == []


async def test_new_projects_spread_over_the_cells_or_go_where_asked(farm: Farm) -> None:
    conn = jobstore.connect(farm.control)
    try:
        async with front_door(farm) as (client, url):

            async def make(project: str, **extra: str) -> aiohttp.ClientResponse:
                body = {"user": f"u-{project}", "project": project, **extra}
                return await client.post(f"{url}/api/tokens", json=body, headers=bearer(farm.root))

            for i in range(8):
                assert (await make(f"p{i}")).status == 201
            pins = [Accounts(conn).project_cell(f"p{i}") for i in range(8)]
            assert set(pins) == {"c1", "c2"}, pins  # spread by a hash of the name
            assert (await make("there", cell="c2")).status == 201
            assert Accounts(conn).project_cell("there") == "c2"
            refused = await make("nowhere", cell="c9")
            assert refused.status == 400 and "c9" in await refused.text()
            assert not Accounts(conn).project_exists("nowhere")
            # a project keeps its cell whatever a later token's request says
            assert (await make("A", cell="c2")).status == 201
            assert Accounts(conn).project_cell("A") == "c1"
            # the new member's token works at once, in the project's cell
            made = await make("p-new", cell="c2")
            token = (await made.json())["token"]
            listed = await client.get(f"{url}/api/jobs?project=p-new", headers=bearer(token))
            assert listed.status == 200, await listed.text()
    finally:
        conn.close()


async def test_a_project_made_before_cells_is_pinned_to_the_first_cell_it_meets(
    farm: Farm,
) -> None:
    conn = jobstore.connect(farm.control)
    try:
        Accounts(conn).set_role("alice", "old", "member")  # no cell recorded
        assert Accounts(conn).project_cell("old") is None
        async with front_door(farm) as (client, url):
            resp = await client.get(f"{url}/api/jobs?project=old", headers=bearer(farm.alice))
            assert resp.status == 200, await resp.text()
        assert Accounts(conn).project_cell("old") == "c1"  # the front door's default cell
    finally:
        conn.close()


async def test_deleting_an_upload_keeps_bytes_another_project_of_the_cell_holds(
    farm: Farm,
) -> None:
    async with front_door(farm) as (client, url):
        sha = await _upload(client, url, farm.alice, "A")
        assert await _upload(client, url, farm.alice, "C") == sha
        resp = await client.delete(f"{url}/api/uploads/{sha}?project=A", headers=bearer(farm.alice))
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["kept"] == "another project has the same file"
        assert _in_cell(farm.c1, keys.upload("C", sha))


async def test_farm_frontdoor_serves_like_farm_web(farm: Farm) -> None:
    """`farm frontdoor` binds and says where as `farm web` does; without cells it refuses."""
    out = io.StringIO()
    seen: list[Any] = []

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        scrape_port = free.getsockname()[1]

    async def check(url: str) -> None:
        async with aiohttp.ClientSession() as client:
            seen.append(await (await client.get(url + "/frontdoor/healthz")).json())
            # nothing listens on the cells: the door's own metrics count that
            await client.get(url + "/api/jobs/c2-20261207-101500-0123abcd")
            seen.append((await client.get(url + "/api/me")).status)  # no cell: no list
            scraped = await client.get(f"http://127.0.0.1:{scrape_port}/metrics")
            seen.append(await scraped.text())

    cells = "c1=http://127.0.0.1:9/,c2=http://127.0.0.1:10"
    settings = Settings().with_(
        cells=cells, control_redis_url=farm.control, web_port=0, web_metrics_port=scrape_port
    )
    await run(settings, out, until=check, app=create_frontdoor, name="farm frontdoor")
    assert seen[0] == {"ok": True, "cells": ["c1", "c2"]}
    assert seen[1] == 502
    assert 'tessera_frontdoor_requests_total{cell="c2",status="unreachable"}' in seen[2]
    assert "farm frontdoor: serving http://127.0.0.1:" in out.getvalue()
    with pytest.raises(BadParameter, match="FARM_CELLS"):
        create_frontdoor(Settings())
    for bad in ("C1=http://a", "c1=ftp://a", "c1=http://a,c1=http://b", "c1"):
        with pytest.raises(BadParameter):
            Settings().with_(cells=bad)


def _counted(cell: str, status: str) -> float:
    found = REGISTRY.get_sample_value(
        "tessera_frontdoor_requests_total", {"cell": cell, "status": status}
    )
    return found or 0.0


async def test_a_cell_that_does_not_answer_is_named(farm: Farm, tmp_path: Path) -> None:
    before = {k: _counted(*k) for k in (("c1", "2xx"), ("c2", "unreachable"))}
    async with TestServer(create_app(farm.c1)) as one:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            gone = f"http://127.0.0.1:{free.getsockname()[1]}"  # nothing listens there
        cells = f"c1={str(one.make_url('')).rstrip('/')},c2={gone}"
        door = create_frontdoor(Settings().with_(cells=cells, control_redis_url=farm.control))
        async with TestServer(door) as server, aiohttp.ClientSession() as client:
            url = str(server.make_url("")).rstrip("/")
            resp = await client.get(url + "/api/jobs?project=B", headers=bearer(farm.alice))
            assert resp.status == 502, await resp.text()
            error = (await resp.json())["error"]
            assert (error["code"], error["cell"]) == ("cell_unreachable", "c2")
            # a list of every project: the other cell's part, and which cell is missing
            resp = await client.get(url + "/api/me", headers=bearer(farm.alice))
            assert resp.status == 200, await resp.text()
            me = await resp.json()
            assert sorted(p["id"] for p in me["projects"]) == ["A", "C"]
            assert me["cells_unreachable"] == ["c2"]
            # what the other cell holds is served as ever
            resp = await client.get(url + "/api/jobs?project=A", headers=bearer(farm.alice))
            assert resp.status == 200
            # a batch across both: the live cell acts on its job, the other's job says why not
            mine = await asyncio.to_thread(make_job, farm.c1, "A", tmp_path / "out")
            theirs = "c2-20261207-101500-0123abcd"
            resp = await client.post(
                url + "/api/jobs/batch", headers=bearer(farm.alice),
                json={"action": "suspend", "ids": [theirs, mine]},
            )  # fmt: skip
            assert resp.status == 200, await resp.text()
            got = [(r["job_id"], r["ok"], r.get("error")) for r in (await resp.json())["results"]]
            assert got == [(theirs, False, "cell_unreachable"), (mine, True, None)]
    # the door's own metrics count each cell's answers and silences
    after = {k: _counted(*k) - before[k] for k in before}
    assert after == {("c1", "2xx"): 3.0, ("c2", "unreachable"): 3.0}, after
    timed = REGISTRY.get_sample_value(
        "tessera_frontdoor_request_duration_seconds_count", {"cell": "c1"}
    )
    assert timed is not None and timed >= 2


async def test_websockets_reach_the_cell_that_holds_the_session(tmp_path: Path) -> None:
    """A WebSocket goes to the cell its session's id names; a session whose id names no cell
    (a stream service run without FARM_CELL) is found by asking each cell (404: not here).
    Either way the door relays both ways, with the client's credentials."""
    asked: Counter[str] = Counter()

    def cell(name: str, holds: set[str]) -> web.Application:
        async def ws(request: web.Request) -> web.StreamResponse:
            sid = request.match_info["sid"]
            asked[name] += 1
            if sid not in holds:
                raise web.HTTPNotFound()
            if request.headers.get("Authorization") != "Bearer t":
                raise web.HTTPUnauthorized()
            sock = web.WebSocketResponse()
            await sock.prepare(request)
            async for msg in sock:
                await sock.send_str(f"{name}/{sid}:{msg.data}")
            return sock

        app = web.Application()
        app.router.add_get("/api/streams/sessions/{sid}/ws", ws)
        return app

    one_app, two_app = cell("c1", set()), cell("c2", {"c2-0123abcd", "old"})
    async with TestServer(one_app) as one, TestServer(two_app) as two:
        cells = f"c1={str(one.make_url('')).rstrip('/')},c2={str(two.make_url('')).rstrip('/')}"
        # no request names a project: the control Redis is never asked
        settings = Settings().with_(cells=cells, control_redis_url="redis://127.0.0.1:1/0")
        async with TestServer(create_frontdoor(settings)) as door, aiohttp.ClientSession() as c:
            for sid, c1_asked in (("c2-0123abcd", 0), ("old", 1)):
                asked.clear()
                url = door.make_url(f"/api/streams/sessions/{sid}/ws")
                async with c.ws_connect(url, headers=bearer("t")) as sock:
                    await sock.send_str("hello")
                    assert (await sock.receive_str()) == f"c2/{sid}:hello"
                assert asked["c1"] == c1_asked, (sid, asked)
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await c.ws_connect(url, headers=bearer("wrong"))
            assert refused.value.status == 401


async def test_a_large_body_streams_to_its_cell_with_its_length_and_the_clients_headers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(frontdoor, "BUFFERED_BYTES", 4096)
    seen: list[tuple[dict[str, str], bytes]] = []

    async def put(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        return web.json_response({"ok": True}, status=201)

    app = web.Application(client_max_size=1 << 22)
    app.router.add_put("/api/uploads/sessions/{sid}", put)
    body = os.urandom(3 << 20)
    async with TestServer(app) as one:
        settings = Settings().with_(
            cells=f"c1={str(one.make_url('')).rstrip('/')}",
            control_redis_url="redis://127.0.0.1:1/0",
        )
        async with TestServer(create_frontdoor(settings)) as door, aiohttp.ClientSession() as c:
            sent = {**bearer("t"), "X-Forwarded-For": "6.6.6.6", "Cookie": "tessera_session=s"}
            url = door.make_url("/api/uploads/sessions/c1-ab")
            resp = await c.put(url, data=io.BytesIO(body), headers=sent)
            assert resp.status == 201, await resp.text()
            door_host = f"{door.host}:{door.port}"

            # without a length: read until it proves large, then streamed on whole
            async def chunked() -> AsyncIterator[bytes]:
                for i in range(0, len(body), 1 << 16):
                    yield body[i : i + (1 << 16)]

            resp = await c.put(url, data=chunked(), headers=sent)
            assert resp.status == 201, await resp.text()
            assert seen[1][1] == body
            # a small one without a length is still read whole (here: to split it by cell)
            monkeypatch.setattr(frontdoor, "BUFFERED_BYTES", 1 << 20)

            async def small() -> AsyncIterator[bytes]:
                yield b'{"action": "cancel", '
                yield b'"ids": ["c1-20261207-101500-0123abcd"]}'

            resp = await c.post(door.make_url("/api/jobs/batch"), data=small(), headers=sent)
            assert resp.status == 404  # the cell's answer (it has no such route), not a 413
            assert len(seen) == 2
    headers, got = seen[0]
    assert got == body
    assert headers["Content-Length"] == str(len(body))
    assert "Transfer-Encoding" not in headers
    assert headers["Authorization"] == "Bearer t" and headers["Cookie"] == "tessera_session=s"
    assert headers["Host"] == door_host  # the origin check sees the address the client used
    assert headers["X-Forwarded-For"] == "127.0.0.1"  # the door's, not the client's claim


async def test_behind_a_tls_front_door_a_cell_answers_as_over_tls(farm: Farm) -> None:
    """The door says the client came over TLS (X-Forwarded-Proto: https, set by the door itself);
    the cell's web, reached over plain HTTP, then marks its login cookie Secure, sends HSTS and
    takes its pages' https Origin as its own."""
    async with TestServer(create_app(farm.c1)) as one, aiohttp.ClientSession() as client:
        direct = str(one.make_url("")).rstrip("/")
        host = f"{one.host}:{one.port}"
        tls = {"X-Forwarded-Proto": "https", "Origin": f"https://{host}"}
        resp = await client.post(f"{direct}/api/login", json={"token": farm.alice}, headers=tls)
        assert resp.status == 200, await resp.text()
        cookie = resp.headers["Set-Cookie"]
        assert "Secure" in cookie and "HttpOnly" in cookie
        assert "Strict-Transport-Security" in resp.headers
        session = cookie.split(";", 1)[0]
        # a write with the session cookie from the page the door served over https
        resp = await client.post(f"{direct}/api/logout", headers={**tls, "Cookie": session})
        assert resp.status == 200, await resp.text()
        # without the door's word, plain HTTP: no Secure cookie, and https is another origin
        plain = await client.post(f"{direct}/api/login", json={"token": farm.alice})
        assert "Secure" not in plain.headers["Set-Cookie"]
        session = plain.headers["Set-Cookie"].split(";", 1)[0]
        refused = await client.post(
            f"{direct}/api/logout", headers={"Origin": f"https://{host}", "Cookie": session}
        )
        assert refused.status == 403


def test_a_cells_web_reads_each_projects_pin_once(farm: Farm, round_trips: Counter[str]) -> None:
    """Every request loads its user; in a farm of cells that means the cells of their projects.
    Pins never change, so after the first request the user costs the one round trip it did
    before cells."""
    conn = jobstore.connect(farm.control)
    try:
        accounts = Accounts(conn, cell="c1")
        me = threading.current_thread().name
        first = accounts.user("alice")
        before = round_trips[me]
        again = accounts.user("alice")
        assert round_trips[me] - before == 1
        assert first is not None and again is not None
        assert again.cells == first.cells == {"A": "c1", "B": "c2", "C": "c1"}
        assert again.projects_in("c1") == ["A", "C"]
    finally:
        conn.close()


# Last in the module: Playwright's sync API keeps an event loop running in this thread once
# the browser starts, and the async tests above run their own.
def test_the_pages_through_the_front_door_list_every_cells_projects_and_say_when_one_is_down(
    farm: Farm, browser: Browser
) -> None:
    """Signing in, the project list and a page in Chromium through the front door; then with
    cell c2 stopped, the pages still work and say which cell is missing."""
    one, two = LiveWeb(farm.c1), LiveWeb(farm.c2)
    try:
        cells = f"c1={one.url},c2={two.url}"
        settings = Settings().with_(cells=cells, control_redis_url=farm.control)
        door = LiveWeb(settings, app=create_frontdoor)
        try:
            page = browser.new_page()
            page.goto(door.url + "/")
            page.fill("#token", farm.alice)
            page.click("#signin")
            expect(page).to_have_url(door.url + "/")
            expect(page.locator("body[data-ready]")).to_have_count(1)
            expect(page.locator("#project option")).to_have_count(3)  # A, C in c1; B in c2
            expect(page.locator("#cells-unreachable")).to_have_count(0)
            two.close()
            page.reload()
            expect(page.locator("body[data-ready]")).to_have_count(1)
            expect(page.locator("#cells-unreachable")).to_contain_text("cell c2")
            options = page.locator("#project option")
            expect(options).to_have_count(2)
            assert sorted(options.all_inner_texts()) == ["A", "C"]
            page.close()
        finally:
            door.close()
    finally:
        one.close()
        two.close()
