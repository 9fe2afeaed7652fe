"""Webhooks for operators: a receiver's 429/503 Retry-After is waited (bounded), a 410 Gone
disables the hook until enabled, a rotated secret keeps signing beside the new one for its
grace period; the project settings page adds, lists and removes hooks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from farm import jobstore, keys
from farm.accounts import Accounts
from farm.settings import Settings
from farm.states import JobState
from farm.webhooks import hooks, signing
from farm.webhooks.dispatcher import Delivery, Dispatcher, retry_after_s
from tests.conftest import REPO
from tests.farmprocs import eventually
from tests.web.conftest import api, bearer, make_job
from tests.web.test_webhooks import fast


@dataclass
class Scripted:
    """A receiver on 127.0.0.1 that answers each request with the next of ``answers``
    (status, headers), then 204; it keeps when each came and its signature header."""

    answers: list[tuple[int, dict[str, str]]]
    got: list[tuple[float, str, str, bytes, str]] = field(default_factory=list)
    port: int = 0
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> Scripted:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def _handle(self, request: web.Request) -> web.Response:
        h = request.headers
        self.got.append((time.monotonic(), h["X-Tessera-Event"], h["X-Tessera-Timestamp"],
                         await request.read(), h["X-Tessera-Signature"]))  # fmt: skip
        status, headers = self.answers.pop(0) if self.answers else (204, {})
        return web.Response(status=status, headers=headers)


@pytest.fixture
def store(redis_url: str) -> Iterator[jobstore.JobStore]:
    s = jobstore.JobStore(jobstore.connect(redis_url))
    yield s
    s.conn.close()


def test_retry_after_is_read_as_seconds_or_a_date_and_its_wait_is_bounded(
    web_settings: Settings, store: jobstore.JobStore
) -> None:
    now = 1_800_000_000.0
    assert retry_after_s("30", now) == 30.0
    assert retry_after_s(time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now + 90)),
                         now) == 90.0  # fmt: skip
    assert retry_after_s("soon", now) is None and retry_after_s(None, now) is None
    settings = fast(web_settings, webhook_retry_after_max_s=5.0)
    dispatcher = Dispatcher(settings, store.conn, clock=lambda: now)
    gone = Delivery("wh_x.1-0", "wh_x", "A", "job.done", b"{}", 0)
    # no sooner than asked, but never longer than FARM_WEBHOOK_RETRY_AFTER_MAX_S
    assert dispatcher.record(gone, "retry", "HTTP 503", 1, asked_s=3.0) - now >= 3.0
    assert dispatcher.record(gone, "retry", "HTTP 429", 1, asked_s=10_000.0) - now <= 5.0


def test_the_readmes_snippet_accepts_either_secret_while_a_rotation_is_in_grace() -> None:
    text = (REPO / "README.md").read_text()
    snippet = text.split("```python\nimport hashlib, hmac, time\n", 1)[1].split("```", 1)[0]
    scope: dict[str, Any] = {}
    exec("import hashlib, hmac, time\n" + snippet, scope)
    old, new, body, now = signing.new_secret(), signing.new_secret(), b"{}", int(time.time())
    headers = {"X-Tessera-Timestamp": str(now),
               "X-Tessera-Signature": signing.sign_all([new, old], now, body)}  # fmt: skip
    assert scope["verified"](new, headers, body) and scope["verified"](old, headers, body)
    assert not scope["verified"](signing.new_secret(), headers, body)


async def test_retry_after_is_waited_a_410_disables_the_hook_and_a_rotated_secret_still_signs(
    web_settings: Settings, store: jobstore.JobStore, tmp_path: Path
) -> None:
    settings = fast(web_settings)  # back-off 0.1 to 0.4 s: Retry-After 1 s is the longer
    receiver = await Scripted([(503, {"Retry-After": "1"}), (204, {}), (410, {})]).start()
    book = hooks.Hooks(store.conn)
    hook = book.create("A", receiver.url, ("job.submitted", "job.canceled"), "pat", 10)
    rotated = book.rotate("A", hook.id, grace_s=600)
    job_id = make_job(settings, "A", tmp_path / "a")
    stop = asyncio.Event()
    run = asyncio.create_task(Dispatcher(settings, store.conn, name="web-0").run(stop))
    try:
        await eventually(lambda: len(receiver.got) >= 2, 10, "the submitted event, twice")
        (t0, _, _, _, _), (t1, event, ts, body, sig) = receiver.got[:2]
        assert event == "job.submitted" and t1 - t0 >= 1.0, "no sooner than Retry-After"
        assert len(sig.split(",")) == 2
        for secret in (hook.secret, rotated.secret):  # the old secret still verifies
            assert signing.verify(secret, ts, sig, body, time.time())
        listed = book.deliveries("A", hook.id)
        assert [(d["state"], d["attempts"]) for d in listed] == [("delivered", 2)]
        store.end_job(job_id, JobState.CANCELED, "canceled by request")
        await eventually(lambda: book.get("A", hook.id).disabled_s is not None, 10, "disabled")
        listed = book.deliveries("A", hook.id)
        assert listed[0]["state"] == "failed" and "410 Gone" in listed[0]["last_result"]
        # a disabled hook gets no deliveries: the next event is taken in and makes none
        make_job(settings, "A", tmp_path / "b")
        await eventually(lambda: store.conn.xlen(keys.WEBHOOK_OUTBOX) == 0, 10, "intake")
        assert len(book.deliveries("A", hook.id)) == 2 and len(receiver.got) == 3
    finally:
        stop.set()
        await run
        assert receiver.runner is not None
        await receiver.runner.cleanup()


async def test_admins_rotate_a_secret_and_enable_a_disabled_hook_through_the_api(
    web_settings: Settings, store: jobstore.JobStore, tokens: Any
) -> None:
    accounts = Accounts(store.conn)
    accounts.set_role("pat", "A", "admin")
    pat = bearer(accounts.create_token("pat").token)
    book = hooks.Hooks(store.conn)
    hook = book.create("A", "https://hooks.example.com/t", hooks.EVENTS, "pat", 10)
    book.disable("A", hook.id, "the receiver answered 410 Gone")
    base = f"/api/projects/A/webhooks/{hook.id}"
    async with api(web_settings.with_(webhook_secret_grace_s=3600)) as client:
        listed = await (await client.get("/api/projects/A/webhooks", headers=pat)).json()
        (shown,) = listed["webhooks"]
        assert (shown["disabled"], shown["disabled_reason"]) == (
            True, "the receiver answered 410 Gone")  # fmt: skip
        for who, status in ((tokens.alice, 403), (tokens.bob, 404)):
            assert (await client.post(f"{base}/rotate", headers=bearer(who))).status == status
            assert (await client.post(f"{base}/enable", headers=bearer(who))).status == status
        rotated = await (await client.post(f"{base}/rotate", headers=pat)).json()
        assert rotated["secret"] != hook.secret and rotated["secret"].startswith("whsec_")
        assert rotated["previous_until_s"] - time.time() == pytest.approx(3600, abs=60)
        enabled = await (await client.post(f"{base}/enable", headers=pat)).json()
        assert enabled["disabled"] is False
        listed = await (await client.get("/api/projects/A/webhooks", headers=pat)).text()
        assert hook.secret not in listed and rotated["secret"] not in listed
    now = time.time()
    current = book.get("A", hook.id)
    assert current.signing_secrets(now) == [rotated["secret"], hook.secret]
    assert current.signing_secrets(now + 3700) == [rotated["secret"]], "the grace ends"
