"""One HTTP form of every farm error: the web and the stream service answer the same error with
the same status, body and headers, and the web passes a stream service's error on unchanged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from encoder import routes as stream_routes
from farm import errors
from farm.errors import FarmError
from farm.settings import Settings
from tests.encoder import tokens as stream_tokens
from tests.web.conftest import Tokens, api, bearer
from web.jsonio import error_middleware

Middleware = Callable[..., Awaitable[web.StreamResponse]]


def _tree(cls: type[FarmError]) -> list[type[FarmError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _tree(sub))]


async def _answer(middleware: Middleware, exc: FarmError) -> tuple[int, Any, dict[str, str]]:
    async def fail(request: web.Request) -> web.Response:
        raise exc

    app = web.Application(middlewares=[middleware])
    app.router.add_get("/api/fail", fail)
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/api/fail")
        headers = {
            h: resp.headers[h] for h in ("Retry-After", "WWW-Authenticate") if h in resp.headers
        }
        return resp.status, await resp.json(), headers


@pytest.mark.parametrize("cls", _tree(FarmError), ids=lambda c: c.__name__)
async def test_every_error_answers_alike_from_the_web_and_the_stream_service(
    cls: type[FarmError],
) -> None:
    exc = cls("what went wrong, and what to do", device="gpu-0", sizes=[1, 2], path=object())
    web_answer = await _answer(error_middleware, exc)
    stream_answer = await _answer(stream_routes.errors, exc)
    assert web_answer == stream_answer
    status, body, _ = web_answer
    assert body["error"]["code"] == cls.code and body["error"]["sizes"] == [1, 2]
    assert status >= 400


async def test_never_fits_and_no_capacity_say_whether_to_ask_again() -> None:
    never = await _answer(error_middleware, errors.NeverFits("no device holds 200 GB"))
    assert (never[0], never[1]["error"]["code"], never[2]) == (422, "never_fits", {})
    full = await _answer(error_middleware, errors.NoCapacity("every encoder is busy"))
    assert (full[0], full[1]["error"]["code"], full[2]) == (503, "no_capacity",
                                                             {"Retry-After": "5"})  # fmt: skip


async def test_a_stream_that_never_fits_is_the_same_answer_direct_and_through_the_web(
    web_settings: Settings, tokens: Tokens
) -> None:
    from encoder.app import serving

    web_settings = web_settings.with_(stream_secret=stream_tokens.STREAM_SECRET)
    # an H200 has no NVENC: its stream service can never hold a session
    stream_settings = web_settings.with_(
        device="gpu", gpu_index=0, nvml="fake:h200", stream_port=0, lease_ttl_s=3.0,
        agent_timeout_s=3.0,
    )  # fmt: skip
    body = {"app": "testpattern", "width": 512, "height": 64, "fps": 10}
    async with api(web_settings) as client, serving(stream_settings) as service:
        direct = await client.session.post(
            f"{service.url}/api/streams/sessions", json=body,
            headers={"Authorization": f"Bearer {stream_tokens.operator()}"},
        )  # fmt: skip
        through = await client.post(
            "/api/streams/sessions", json={**body, "project": "A"}, headers=bearer(tokens.alice)
        )
        direct_body, through_body = await direct.json(), await through.json()
        assert (direct.status, direct_body["error"]["code"]) == (422, "never_fits")
        assert "can never hold a stream session" in direct_body["error"]["message"]
        assert (through.status, through_body) == (direct.status, direct_body)
        assert "Retry-After" not in through.headers
