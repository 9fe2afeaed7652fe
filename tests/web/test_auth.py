"""Who may call what: 401 without a token on every route, projects hidden from outsiders."""

from __future__ import annotations

import json
import re
from pathlib import Path

from aiohttp import web

from farm import jobstore, keys, submission
from farm.settings import Settings
from tests.web.conftest import SHA, Tokens, api, bearer, make_job, page_origin
from web.app import create_app
from web.appkeys import ROUTES

#: public to the user check, but asking for a token of their own (FARM_METRICS_TOKEN)
OWN_TOKEN = {"/metrics"}


def _concrete(path: str) -> str:
    return re.sub(r"{(\w+)}", lambda m: "js" if m.group(1) == "ext" else "x1", path)


async def test_every_route_without_a_token_answers_401(web_settings: Settings) -> None:
    """Walks the router itself, so a route added later is covered without touching this test."""
    app = create_app(web_settings)
    walked = 0
    async with api(web_settings) as client:
        for resource in app.router.resources():
            for route in resource:
                entry = app[ROUTES][(route.method, resource.canonical)]
                path = _concrete(resource.canonical)
                resp = await client.request(route.method, path)
                if entry.public and path not in OWN_TOKEN:
                    assert resp.status != 401, f"{route.method} {path} is public"
                    continue
                walked += 1
                assert resp.status == 401, f"{route.method} {path} answered {resp.status}"
                body = await resp.json()
                assert body["error"]["code"] == "unauthorized"
                assert "token" in body["error"]["message"]
                bad = await client.request(route.method, path, headers=bearer("tsr_nope"))
                assert bad.status == 401, f"{route.method} {path} took a made-up token"
    assert walked >= 30


async def test_openapi_describes_exactly_the_routes_of_the_router(web_settings: Settings) -> None:
    app = create_app(web_settings)
    routed = {
        (route.method.lower(), resource.canonical)
        for resource in app.router.resources()
        for route in resource
    }
    async with api(web_settings) as client:
        resp = await client.get("/api/openapi.json")
        assert resp.status == 200
        spec = await resp.json()
    described = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    assert described == routed
    assert spec["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]["properties"]["frames"]
    # every field of RenderRequest a client may set is documented (fields others add, too)
    props = spec["paths"]["/api/jobs"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]["properties"]
    fields = {f for f in submission.RenderRequest.__dataclass_fields__ if f != "output"}
    assert fields <= set(props)


def _job_in_b(settings: Settings, tmp: Path) -> str:
    """A job of project B with a delivered frame, an upload record and a stream session."""
    job_id = make_job(settings, "B", tmp / "out-b")
    conn = jobstore.connect(settings.redis_url)
    try:
        conn.set(
            keys.upload("B", SHA),
            json.dumps({"upload_id": SHA, "project": "B", "name": "b.blend", "location": "x"}),
        )
        conn.set(keys.stream_owner("s-b"), json.dumps({"project": "B", "user": "bob", "url": "x"}))
    finally:
        conn.close()
    (tmp / "out-b").mkdir()
    (tmp / "out-b" / "frame_0001.png").write_bytes(b"\x89PNG\r\n\x1a\nsecret")
    return job_id


async def test_a_member_of_a_gets_404_for_project_b(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = _job_in_b(web_settings, tmp_path)
    async with api(web_settings) as client:
        bob = bearer(tokens.bob)
        assert (await client.get(f"/api/jobs/{job_id}", headers=bob)).status == 200
        assert (await client.get(f"/api/jobs/{job_id}/frames/1/frame_0001.png",
                                 headers=bob)).status == 200  # fmt: skip
        alice = bearer(tokens.alice)
        for method, path in [
            ("GET", f"/api/uploads/{SHA}"),
            ("POST", f"/api/uploads/{SHA}/inspect"),
            ("GET", "/api/uploads?project=B"),
            ("GET", f"/api/jobs/{job_id}"),
            ("GET", f"/api/jobs/{job_id}/events"),
            ("GET", f"/api/jobs/{job_id}/logs"),
            ("POST", f"/api/jobs/{job_id}/cancel"),
            ("POST", f"/api/jobs/{job_id}/retry"),
            ("GET", f"/api/jobs/{job_id}/frames"),
            ("GET", f"/api/jobs/{job_id}/frames/1/frame_0001.png"),
            ("GET", f"/api/jobs/{job_id}/frames/1/thumbnail"),
            ("GET", f"/api/jobs/{job_id}/download.zip"),
            ("GET", "/api/jobs?project=B"),
            ("GET", "/api/streams/sessions/s-b"),
            ("DELETE", "/api/streams/sessions/s-b"),
            ("POST", "/api/streams/sessions/s-b/viewers"),
        ]:
            resp = await client.request(method, path, headers=alice)
            assert resp.status == 404, f"{method} {path} answered {resp.status}"
            assert "secret" not in await resp.text()
        # project A's own lists do not show B's things
        jobs = await (await client.get("/api/jobs", headers=alice)).json()
        assert jobs == {"jobs": []}
        bob_jobs = await (await client.get("/api/jobs", headers=bob)).json()
        assert [j["job_id"] for j in bob_jobs["jobs"]] == [job_id]
        assert (await client.get(f"/api/jobs/{job_id}", headers=bob)).status == 200


async def test_browser_login_turns_a_token_into_a_session_cookie(
    web_settings: Settings, tokens: Tokens
) -> None:
    async with api(web_settings) as client:
        bad = await client.post("/api/login", json={"token": "tsr_wrong"})
        assert bad.status == 401
        resp = await client.post("/api/login", json={"token": tokens.alice})
        assert resp.status == 200
        cookie = resp.cookies["tessera_session"]
        assert cookie["httponly"] and cookie["samesite"] == "Strict"
        me = await (await client.get("/api/me")).json()
        assert me["user"] == "alice"
        assert me["projects"] == [
            {"id": "A", "name": "A", "role": "member", "devices": ["cpu", "gpu"]}
        ]
        # a write with the cookie comes from the pages: their Origin (see tests/security)
        assert (await client.post("/api/logout", headers=page_origin(client))).status == 200
        assert (await client.get("/api/me")).status == 401


async def test_admin_creates_and_revokes_tokens_others_cannot(
    web_settings: Settings, tokens: Tokens
) -> None:
    async with api(web_settings) as client:
        refused = await client.post(
            "/api/tokens", json={"user": "eve", "project": "A"}, headers=bearer(tokens.alice)
        )
        assert refused.status == 403
        made = await client.post(
            "/api/tokens",
            json={"user": "carol", "project": "A", "role": "viewer"},
            headers=bearer(tokens.admin),
        )
        assert made.status == 201
        issued = await made.json()
        carol = bearer(issued["token"])
        me = await (await client.get("/api/me", headers=carol)).json()
        assert me["projects"][0]["role"] == "viewer"
        assert me["projects"][0]["devices"] == []
        conn = jobstore.connect(web_settings.redis_url)
        try:  # only the token's hash is stored
            assert not any(issued["token"] in k for k in conn.keys("*"))
        finally:
            conn.close()
        gone = await client.delete(
            f"/api/tokens/{issued['token_id']}", headers=bearer(tokens.admin)
        )
        assert gone.status == 204
        assert (await client.get("/api/me", headers=carol)).status == 401


async def test_device_policy_is_enforced_at_submit(web_settings: Settings, tokens: Tokens) -> None:
    async with api(web_settings) as client:
        body = {"project": "A", "upload_id": SHA, "device": "gpu"}
        viewer = await client.post("/api/jobs", json=body, headers=bearer(tokens.vera))
        assert viewer.status == 403
        assert "viewer" in (await viewer.json())["error"]["message"]
        # a project admin narrows members to the CPU
        conn = jobstore.connect(web_settings.redis_url)
        try:
            from farm.accounts import Accounts

            Accounts(conn).set_role("alice", "A", "admin")
            Accounts(conn).set_role("dan", "A", "member")
            dan = bearer(Accounts(conn).create_token("dan").token)
        finally:
            conn.close()
        put = await client.put(
            "/api/projects/A/policy",
            json={"role": "member", "devices": ["cpu"]},
            headers=bearer(tokens.alice),
        )
        assert put.status == 200
        denied = await client.post("/api/jobs", json=body, headers=dan)
        assert denied.status == 403
        assert "gpu" in (await denied.json())["error"]["message"]


def test_routes_table_has_one_entry_per_router_route(web_settings: Settings) -> None:
    app = create_app(web_settings)
    count = sum(len(list(r)) for r in app.router.resources())
    assert count == len(app[ROUTES])
    assert isinstance(app, web.Application)
