"""A session's home folder through the web: its project's members move files in and out; its
viewers and other projects' users get nothing."""

from __future__ import annotations

from farm.settings import Settings
from tests.encoder.tokens import STREAM_SECRET
from tests.web.conftest import Tokens, api, bearer


async def test_files_of_a_session_through_the_web_are_for_its_project_members(
    web_settings: Settings, tokens: Tokens
) -> None:
    from encoder.app import serving

    web_settings = web_settings.with_(stream_secret=STREAM_SECRET)
    stream_settings = web_settings.with_(
        device="cpu", stream_port=0, cpu_encode_sessions=2, lease_ttl_s=3.0, agent_timeout_s=3.0
    )
    alice, bob, vera = bearer(tokens.alice), bearer(tokens.bob), bearer(tokens.vera)
    async with api(web_settings) as client, serving(stream_settings):
        made = await client.post(
            "/api/streams/sessions",
            json={"app": "game", "project": "A", "width": 320, "height": 240, "fps": 10},
            headers=alice,
        )
        assert made.status == 201, await made.text()
        sid = (await made.json())["session_id"]
        files = f"/api/streams/sessions/{sid}/files"
        try:
            put = await client.put(f"{files}/hello%20there.txt", data=b"hello", headers=alice)
            assert put.status == 201, await put.text()
            assert await put.json() == {"name": "hello there.txt", "size": 5}
            listed = await (await client.get(files, headers=alice)).json()
            assert listed == {"files": [{"name": "hello there.txt", "size": 5}]}
            got = await client.get(f"{files}/hello%20there.txt", headers=alice)
            assert got.status == 200 and await got.read() == b"hello"
            assert "attachment" in got.headers["Content-Disposition"]
            # the project's viewers watch only; other projects do not see the session at all
            assert (await client.get(files, headers=vera)).status == 403
            assert (await client.put(f"{files}/x", data=b"x", headers=vera)).status == 403
            assert (await client.get(f"{files}/hello%20there.txt", headers=bob)).status == 404
            missing = await client.get(f"{files}/nothing", headers=alice)
            assert missing.status == 404
        finally:
            assert (
                await client.delete(f"/api/streams/sessions/{sid}", headers=alice)
            ).status == 204
