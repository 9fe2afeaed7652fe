"""Fixtures of the stream tests: settings on the test Redis, a running stream service."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, sync_playwright

from encoder.app import running
from encoder.service import StreamService
from encoder.source import APP_MARK
from farm.settings import Settings
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS
from tests.encoder.tokens import STREAM_SECRET


@pytest.fixture
def stream_settings(redis_url: str) -> Settings:
    """A CPU stream service's settings: the test Redis, a free port, room for 3 sessions."""
    return Settings().with_(
        redis_url=redis_url,
        device="cpu",
        stream_port=0,
        cpu_encode_sessions=3,
        stream_grace_s=30.0,
        lease_ttl_s=3.0,
        agent_timeout_s=3.0,
        stream_min_kbps=300,
        stream_max_kbps=8000,
        stream_secret=STREAM_SECRET,
    )


@pytest.fixture
def stream_service(stream_settings: Settings) -> Iterator[StreamService]:
    """A stream service serving on loopback from its own thread (``.url``)."""
    with running(stream_settings) as service:
        yield service


def session_processes() -> list[str]:
    """Processes a stream service of this test process started that still run: its Xvfb
    displays, and every app process (marked in its environment, wherever it was reparented)."""
    found = []
    me = os.getpid()
    mark = f"{APP_MARK}={me}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z":
            continue
        if (comm == "Xvfb" and int(ppid) == me) or mark in environ:
            found.append(f"{entry.name} {cmdline.strip()}")
    return found


@pytest.fixture
def no_orphans() -> Iterator[None]:
    """The test leaves no display, app or window manager running (modules opt in with
    ``pytestmark = pytest.mark.usefixtures("no_orphans")``)."""
    before = set(session_processes())
    yield
    left = [p for p in session_processes() if p not in before]
    assert left == [], f"stream session processes outlived the test: {left}"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium per test module (tests/encoder/chromium.py)."""
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
