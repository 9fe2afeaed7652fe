"""Web API fixtures: async tests without a plugin, the app on aiohttp's test server, accounts."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from playwright.sync_api import Browser, sync_playwright

from farm import jobstore
from farm.accounts import Accounts
from farm.models import InspectionReport
from farm.settings import Settings
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS
from web.app import create_app


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run ``async def`` tests in a fresh event loop (no pytest-asyncio needed)."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(pyfuncitem.obj(**args))
    return True


@pytest.fixture
def web_settings(redis_url: str, tmp_path: Path) -> Settings:
    return make_web_settings(redis_url, tmp_path)


def make_web_settings(redis_url: str, tmp_path: Path) -> Settings:
    return Settings().with_(
        redis_url=redis_url,
        storage_dir=tmp_path / "storage",
        work_dir=tmp_path / "work",
        upload_max_bytes=8 << 20,
        unpack_max_bytes=16 << 20,
        inspect_timeout_s=60.0,
    )


@dataclass
class Tokens:
    """API tokens of test users: admin (farm admin), alice (member of A), bob (member of B),
    vera (viewer of A)."""

    admin: str
    alice: str
    bob: str
    vera: str


@pytest.fixture
def tokens(redis_url: str) -> Tokens:
    return make_tokens(redis_url)


def make_tokens(redis_url: str) -> Tokens:
    conn = jobstore.connect(redis_url)
    try:
        accounts = Accounts(conn)
        admin = accounts.bootstrap_admin("root", "ops").token
        accounts.set_role("alice", "A", "member")
        accounts.set_role("bob", "B", "member")
        accounts.set_role("vera", "A", "viewer")
        return Tokens(
            admin,
            accounts.create_token("alice").token,
            accounts.create_token("bob").token,
            accounts.create_token("vera").token,
        )
    finally:
        conn.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@asynccontextmanager
async def api(settings: Settings) -> AsyncIterator[TestClient[Any, Any]]:
    """The web app on a loopback port, and a client for it."""
    async with TestClient(TestServer(create_app(settings))) as client:
        yield client


SHA = "ab" * 32


def make_job(
    settings: Settings, project: str, out: Path | str, tiles: str = "1x1", frames: str = "1-2"
) -> str:
    """A queued job of ``project`` (frames 1 and 2 of a 64x32 scene) accepted as the submit
    route accepts one, with a report in place of the inspection (no worker needed): the job's
    records, its tiles on the queue, the project's index."""
    from farm import queue, submission
    from farm.accept import accept
    from farm.models import BlendSource

    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    rq_conn = queue.connect(settings.redis_url)
    try:
        source = BlendSource("upload", f"uploads/{SHA}/upload.blend", SHA, "b.blend")
        req = submission.RenderRequest(output=str(out), frames=frames, tiles=tiles, project=project)
        queue_ = queue.RenderQueue(rq_conn, req.device)
        return accept(settings, store, queue_, req, source, report=scene_report()).job_id
    finally:
        store.conn.close()
        rq_conn.close()


def scene_report(width: int = 64, height: int = 32) -> InspectionReport:
    """What inspecting a plain Cycles scene of frames 1 to 2 with a camera reports."""
    return InspectionReport(
        path="/uploads/b.blend", version="5.0.1", scene="Scene", engine="CYCLES",
        frame_start=1, frame_end=2, frame_step=1, fps=24.0, width=width, height=height,
        samples=16, adaptive_sampling=False, denoising=False, cameras=["Camera"],
        camera="Camera", missing_files=[], libraries=[], autoexec_fail=False,
        autoexec_fail_message="", wants_scripts=False, scripts=[],
    )  # fmt: skip


def wait_for_worker(redis_url: str, device: str = "cpu", timeout_s: float = 120.0) -> None:
    """Until a render worker serves ``device``'s queue (the web refuses inspections before)."""
    import time

    from farm import queue

    conn = queue.connect(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while not queue.live_workers(conn, device):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {device} worker registered within {timeout_s} s")
            time.sleep(0.05)
    finally:
        conn.close()


def page_origin(client: TestClient[Any, Any]) -> dict[str, str]:
    """The Origin header the web's own pages send (a cookie session's writes need it)."""
    url = client.make_url("/")
    return {"Origin": f"{url.scheme}://{url.host}:{url.port}"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium per test module: the system's, never one a tool downloads."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (make setup does)")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()
