"""`farm web` serving: TLS 1.3 as the least version, loopback without TLS; `farm token`."""

from __future__ import annotations

import io
import json
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from farm import cli
from farm.settings import Settings
from tests.web.conftest import Tokens
from web.serve import run


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=tessera",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_tls_serves_1_3_and_refuses_1_2(web_settings: Settings, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    settings = web_settings.with_(tls_cert=cert, tls_key=key, web_host="127.0.0.1", web_port=0)
    out = io.StringIO()
    seen: dict[str, object] = {}

    async def check(url: str) -> None:
        seen["url"] = url
        modern = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{url}/api/openapi.json", ssl=modern) as resp:
                seen["status"] = resp.status
            old = ssl.create_default_context(cafile=str(cert))
            old.maximum_version = ssl.TLSVersion.TLSv1_2
            with pytest.raises(aiohttp.ClientConnectorError):
                await session.get(f"{url}/api/openapi.json", ssl=old)

    await run(settings, out, until=check)
    assert str(seen["url"]).startswith("https://127.0.0.1:")
    assert seen["status"] == 200
    assert "TLS 1.3" in out.getvalue()


async def test_without_tls_it_binds_loopback_and_says_so(web_settings: Settings) -> None:
    out = io.StringIO()
    urls: list[str] = []

    async def note(url: str) -> None:
        urls.append(url)

    await run(web_settings.with_(web_port=0), out, until=note)
    assert urls[0].startswith("http://127.0.0.1:")
    assert "loopback only" in out.getvalue()
    assert "FARM_TLS_CERT" in out.getvalue()


def test_farm_token_create_and_revoke(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    assert cli.main(["token", "create", "--user", "ann", "--project", "A", "--json"]) == 0
    issued = json.loads(capsys.readouterr().out)
    assert issued["token"].startswith("tsr_")
    from farm import jobstore
    from farm.accounts import Accounts

    conn = jobstore.connect(redis_url)
    try:
        accounts = Accounts(conn)
        assert accounts.user_for_token(issued["token"]) == "ann"
        user = accounts.user("ann")
        assert user is not None and user.roles == {"A": "member"}
        assert cli.main(["token", "revoke", issued["token_id"]]) == 0
        assert accounts.user_for_token(issued["token"]) is None
    finally:
        conn.close()
    assert cli.main(["token", "revoke", "nope"]) == 3
    assert "no token" in capsys.readouterr().err
    assert cli.main(["token", "create", "--user", "ann", "--project", "A", "--role", "boss"]) == 2


def test_farm_up_serves_with_its_admin_token_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    import os
    import signal
    import sys
    import urllib.request

    from tests.farmprocs import descendants

    env = {k: v for k, v in os.environ.items() if not k.startswith("FARM_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm", "up", "--data", str(tmp_path / "data"), "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        url = json.loads(proc.stdout.readline())["url"]  # blocks until it serves
        err_lines: list[str] = []
        while not any("admin API token" in line for line in err_lines):
            err_lines.append(proc.stderr.readline())
            assert err_lines[-1], "farm up ended early:\n" + "".join(err_lines)
        token = next(ln for ln in err_lines if "admin API token" in ln).split()[-1]
        assert url.startswith("http://127.0.0.1:")
        req = urllib.request.Request(f"{url}/api/me", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            me = json.loads(resp.read())
        assert me["admin"] is True and me["projects"][0]["id"] == "default"
        children = descendants(proc.pid)
        assert children, "farm up started no worker, stream service or Redis"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
        assert "farm up: stopped" in proc.stderr.read()
        alive = [p for p in children if Path(f"/proc/{p}").exists()
                 and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2]]  # fmt: skip
        assert alive == [], "processes outlived farm up"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


async def test_metrics_are_prometheus_text_for_the_metrics_token_or_an_admin(
    web_settings: Settings, tokens: Tokens
) -> None:
    from tests.web.conftest import api, bearer

    settings = web_settings.with_(metrics_token="scrape-secret")
    async with api(settings) as client:
        assert (await client.get("/metrics")).status == 401
        assert (await client.get("/metrics", headers=bearer("wrong"))).status == 401
        assert (await client.get("/metrics", headers=bearer(tokens.alice))).status == 403
        assert (await client.get("/metrics", headers=bearer(tokens.admin))).status == 200
        resp = await client.get("/metrics", headers=bearer("scrape-secret"))
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
        # the web answers for the whole farm: state read from Redis at scrape time
        assert "tessera_farm_up 1.0" in text
        assert "tessera_queue_depth" in text
