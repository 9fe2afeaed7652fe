"""Web sessions and requests against the real app and Redis: revocation ends cookie sessions,
writes from other origins are refused, ``next=`` stays on site, every answer carries the
browser's security headers, /metrics asks for a token or lives on its own address."""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from playwright.sync_api import ConsoleMessage, sync_playwright

from farm import jobstore, keys
from farm.accounts import Accounts
from farm.settings import Settings
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS
from tests.web.conftest import (
    Tokens,
    api,
    bearer,
    make_job,
    make_tokens,
    make_web_settings,
    page_origin,
)
from tests.web.test_addon_client import LiveWeb
from web.pages import STATIC
from web.serve import run

Client = TestClient[Any, Any]


@pytest.fixture
def web_settings(redis_url: str, tmp_path: Path) -> Settings:
    return make_web_settings(redis_url, tmp_path)


@pytest.fixture
def tokens(redis_url: str) -> Tokens:
    """admin (farm admin), alice (member of A), bob (member of B), vera (viewer of A)."""
    return make_tokens(redis_url)


def run_async(fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(fn())


async def login(client: Client, token: str) -> None:
    resp = await client.post("/api/login", json={"token": token}, headers=page_origin(client))
    assert resp.status == 200, await resp.text()


def token_id(settings: Settings, token: str) -> str:
    conn = jobstore.connect(settings.redis_url)
    try:
        found = Accounts(conn).token_id_for(token)
        assert found is not None
        return found
    finally:
        conn.close()


# --- sessions and membership ------------------------------------------------------------------


def test_revoking_a_token_ends_every_session_made_with_it_and_only_those(
    web_settings: Settings, tokens: Tokens
) -> None:
    conn = jobstore.connect(web_settings.redis_url)
    try:
        second = Accounts(conn).create_token("alice").token
    finally:
        conn.close()

    async def go() -> None:
        async with api(web_settings) as a1, api(web_settings) as a2, api(web_settings) as b:
            await login(a1, tokens.alice)
            await login(a2, tokens.alice)
            await login(b, second)
            for c in (a1, a2, b):
                assert (await c.get("/api/me")).status == 200
            listed = await (await a1.get("/api/sessions")).json()
            assert len(listed["sessions"]) == 3
            assert sum(s["current"] for s in listed["sessions"]) == 1
            gone = await a1.delete(
                f"/api/tokens/{token_id(web_settings, tokens.alice)}",
                headers=bearer(tokens.admin),
            )
            assert gone.status == 204
            # both cookies made with the revoked token are dead, at once
            assert (await a1.get("/api/me")).status == 401
            assert (await a2.get("/api/me")).status == 401
            # the session made with alice's other token lives on
            assert (await b.get("/api/me")).status == 200
            left = await (await b.get("/api/sessions")).json()
            assert len(left["sessions"]) == 1

    run_async(go)


def test_sessions_are_listed_and_ended_by_their_owner_or_an_admin(
    web_settings: Settings, tokens: Tokens
) -> None:
    async def go() -> None:
        async with api(web_settings) as browser, api(web_settings) as other:
            await login(browser, tokens.alice)
            await login(other, tokens.alice)
            mine = await (await browser.get("/api/sessions", headers=bearer(tokens.alice))).json()
            ids = [s["session_id"] for s in mine["sessions"]]
            assert len(ids) == 2
            # the id is not the cookie: it cannot log anyone in
            cookie = browser.session.cookie_jar.filter_cookies(browser.make_url("/"))
            assert cookie["tessera_session"].value not in ids
            # bob neither sees nor ends alice's sessions
            peek = await browser.get("/api/sessions?user=alice", headers=bearer(tokens.bob))
            assert peek.status == 403
            end = await browser.delete(f"/api/sessions/{ids[0]}", headers=bearer(tokens.bob))
            assert end.status == 404
            # alice ends one; an admin ends the other
            assert (
                await browser.delete(f"/api/sessions/{ids[0]}", headers=bearer(tokens.alice))
            ).status == 204
            admin_view = await browser.get("/api/sessions?user=alice", headers=bearer(tokens.admin))
            assert [s["session_id"] for s in (await admin_view.json())["sessions"]] == ids[1:]
            assert (
                await browser.delete(f"/api/sessions/{ids[1]}", headers=bearer(tokens.admin))
            ).status == 204
            assert (await browser.get("/api/me")).status == 401
            assert (await other.get("/api/me")).status == 401

    run_async(go)


def test_a_removed_member_loses_the_project_at_once(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = make_job(web_settings, "A", tmp_path / "out")

    async def go() -> None:
        async with api(web_settings) as client:
            await login(client, tokens.alice)
            assert (await client.get(f"/api/jobs/{job_id}")).status == 200
            # a member cannot remove others; a farm admin can
            refused = await client.delete(
                "/api/projects/A/members/vera", headers=bearer(tokens.alice)
            )
            assert refused.status == 403
            members = await client.get("/api/projects/A/members", headers=bearer(tokens.admin))
            assert {m["user"] for m in (await members.json())["members"]} == {"alice", "vera"}
            out = await client.delete("/api/projects/A/members/alice", headers=bearer(tokens.admin))
            assert out.status == 204
            # her cookie and her token reach nothing of project A now
            assert (await client.get(f"/api/jobs/{job_id}")).status == 404
            token_view = await client.get(f"/api/jobs/{job_id}", headers=bearer(tokens.alice))
            assert token_view.status == 404
            me = await (await client.get("/api/me")).json()
            assert me["projects"] == []

    run_async(go)


# --- writes from other origins ----------------------------------------------------------------

EVIL = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def same_site(client: Client) -> dict[str, str]:
    """Another origin on the same site: the same host on another port."""
    url = client.make_url("/")
    return {"Origin": f"http://{url.host}:{(url.port or 80) + 1}", "Sec-Fetch-Site": "same-site"}


def test_writes_from_other_origins_are_refused_for_login_cancel_submit_and_tokens(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = make_job(web_settings, "A", tmp_path / "out")

    async def go() -> None:
        async with api(web_settings) as client, api(web_settings) as admin:
            await login(client, tokens.alice)
            await login(admin, tokens.admin)
            own = page_origin(client)
            writes: list[tuple[Client, str, str, dict[str, Any]]] = [
                (client, "POST", f"/api/jobs/{job_id}/cancel", {}),
                (client, "POST", "/api/jobs", {"project": "A", "upload_id": "ab" * 32}),
                (admin, "POST", "/api/tokens", {"user": "mallory", "project": "A"}),
            ]
            for c, method, path, body in writes:
                for origin in (EVIL, same_site(c)):
                    # what an HTML form on that origin posts: the cookie goes with it
                    form = await c.request(method, path, data="x=1", headers={**origin, **FORM})
                    assert form.status == 403, f"{method} {path} from {origin}"
                    # even as JSON (a fetch without CORS: refused by origin)
                    js = await c.request(method, path, json=body, headers=origin)
                    assert js.status == 403, f"{method} {path} as JSON from {origin}"
                # own origin but a form's content type: refused too
                typed = await c.request(method, path, data="x=1", headers={**own, **FORM})
                assert typed.status == 403, f"{method} {path} as a form"
                # no Origin and no Sec-Fetch-Site at all with a cookie: refused
                bare = await c.request(method, path, json=body)
                assert bare.status == 403, f"{method} {path} without an origin"
            # login: a forged cross-site login sets no cookie
            for origin in (EVIL, same_site(client)):
                forged = await client.post(
                    "/api/login", data=f"token={tokens.bob}", headers={**origin, **FORM}
                )
                assert forged.status == 403 and "tessera_session" not in forged.cookies
                as_json = await client.post(
                    "/api/login", json={"token": tokens.bob}, headers=origin
                )
                assert as_json.status == 403 and "tessera_session" not in as_json.cookies
            # nothing happened: the job is still queued, mallory has no token
            status = await (await client.get(f"/api/jobs/{job_id}")).json()
            assert status["state"] == "queued"
            conn = jobstore.connect(web_settings.redis_url)
            try:
                assert not conn.sismember(keys.USERS, "mallory")
            finally:
                conn.close()
            # the pages' own writes go through: their Origin (or Sec-Fetch-Site) and JSON
            ok = await client.post(f"/api/jobs/{job_id}/cancel", headers=own)
            assert ok.status == 200
            made = await admin.post(
                "/api/tokens",
                json={"user": "carol", "project": "A"},
                headers={"Sec-Fetch-Site": "same-origin"},
            )
            assert made.status == 201
            # an API token needs no origin (scripts, the Blender add-on)
            assert (
                await client.post(f"/api/jobs/{make_job(web_settings, 'A', tmp_path / 'o2')}"
                                  "/cancel", headers=bearer(tokens.alice))
            ).status == 200  # fmt: skip

    run_async(go)


def test_farm_web_origins_lets_a_proxys_public_origin_write(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    settings = web_settings.with_(web_origins="https://farm.example.com")
    job_id = make_job(settings, "A", tmp_path / "out")

    async def go() -> None:
        async with api(settings) as client:
            await login(client, tokens.alice)
            resp = await client.post(
                f"/api/jobs/{job_id}/cancel", headers={"Origin": "https://farm.example.com"}
            )
            assert resp.status == 200

    run_async(go)


# --- security headers -------------------------------------------------------------------------


def _check_headers(path: str, headers: Any, tls: bool) -> None:
    csp = headers.get("Content-Security-Policy", "")
    assert "frame-ancestors 'none'" in csp, path
    script_src = re.search(r"script-src ([^;]*)", csp)
    assert script_src and "'unsafe-inline'" not in script_src.group(1), path
    assert "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp, path
    assert headers.get("X-Content-Type-Options") == "nosniff", path
    assert headers.get("Referrer-Policy"), path
    server = headers.get("Server", "")
    assert not re.search(r"aiohttp|python|\d+\.\d+", server, re.I), (path, server)
    assert ("Strict-Transport-Security" in headers) == tls, path


def test_every_answer_has_the_security_headers_and_no_server_version(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"

    async def go(settings: Settings, tls: bool) -> None:
        async with api(settings) as client:
            for path in ("/", "/login", "/upload", "/jobs/x", "/streams", "/player",
                         "/static/app.js", "/static/app.css", "/api/me", "/api/nothing",
                         "/nothing", "/api/openapi.json"):  # fmt: skip
                resp = await client.get(path)
                _check_headers(path, resp.headers, tls)
            resp = await client.get("/api/me", headers=bearer(tokens.alice))
            assert resp.status == 200
            _check_headers("/api/me (user)", resp.headers, tls)

    # HSTS only where the web serves TLS (a certificate is configured)
    asyncio.run(go(web_settings, tls=False))
    asyncio.run(go(web_settings.with_(tls_cert=cert, tls_key=key), tls=True))


def test_pages_carry_no_inline_script_or_style() -> None:
    """The CSP forbids inline script and style attributes: the pages must not need them."""
    pages = sorted(STATIC.glob("*.html"))
    assert len(pages) >= 5
    for page in pages:
        html = page.read_text()
        for tag in re.findall(r"<script\b[^>]*>(.*?)</script>", html, re.S):
            assert not tag.strip(), f"{page.name}: inline script"
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), f"{page.name}: script"
        assert not re.search(r"\son[a-z]+\s*=", html), f"{page.name}: inline handler"
        assert not re.search(r"\sstyle\s*=", html), f"{page.name}: style attribute"


# --- next= after login, in a real browser ----------------------------------------------------


@pytest.fixture
def live(web_settings: Settings) -> Iterator[LiveWeb]:
    site = LiveWeb(web_settings)
    try:
        yield site
    finally:
        site.close()


@pytest.mark.parametrize(
    "next_param",
    ["/\\evil.example/x", "/%09/evil.example/x", "//evil.example/x", "/.//evil.example/x",
     "https://evil.example/x"],
)  # fmt: skip
def test_next_after_login_stays_on_site(live: LiveWeb, tokens: Tokens, next_param: str) -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (make setup does)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            violations: list[str] = []

            def on_console(message: ConsoleMessage) -> None:
                if "Content Security Policy" in message.text:
                    violations.append(message.text)

            page.on("console", on_console)
            # the raw query as a link would carry it (the page decodes it itself)
            query = urllib.parse.quote(next_param, safe="/%")
            page.goto(f"{live.url}/login?next={query}")
            page.fill("#token", tokens.alice)
            with page.expect_navigation():
                page.click("#signin")
            page.wait_for_load_state("load")
            assert page.url.startswith(live.url + "/"), f"next={next_param!r} left for {page.url}"
            assert not violations, violations
        finally:
            browser.close()


def test_next_after_login_keeps_a_path_on_site(live: LiveWeb, tokens: Tokens) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{live.url}/login?next=%2Fupload%3Fproject%3DA")
            page.fill("#token", tokens.alice)
            with page.expect_navigation():
                page.click("#signin")
            assert page.url == f"{live.url}/upload?project=A"
        finally:
            browser.close()


# --- /metrics -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_metrics_on_their_own_address_and_not_on_the_webs(web_settings: Settings) -> None:
    port = _free_port()
    settings = web_settings.with_(web_port=0, web_metrics_port=port, metrics_host="127.0.0.1")
    seen: dict[str, Any] = {}

    async def probe(url: str) -> None:
        def fetch(u: str) -> tuple[int, bytes]:
            try:
                with urllib.request.urlopen(u, timeout=10) as resp:
                    return resp.status, resp.read()
            except urllib.error.HTTPError as e:
                return e.code, e.read()

        loop = asyncio.get_running_loop()
        seen["scrape"] = await loop.run_in_executor(None, fetch, f"http://127.0.0.1:{port}/metrics")
        seen["web"] = await loop.run_in_executor(None, fetch, f"{url}/metrics")
        seen["other"] = await loop.run_in_executor(None, fetch, f"http://127.0.0.1:{port}/api/me")

    asyncio.run(run(settings, io.StringIO(), until=probe))
    status, body = seen["scrape"]
    assert status == 200 and b"tessera_farm_up" in body
    assert seen["web"][0] == 404
    assert "FARM_WEB_METRICS_PORT" in json.loads(seen["web"][1])["error"]["message"]
    assert seen["other"][0] == 404
