"""Fixtures every test shares: a private redis-server per session, flushed around each test."""

from __future__ import annotations

import gc
import threading
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.connection

from farm.redisserver import RedisServer

REPO = Path(__file__).resolve().parent.parent
#: real .blend files saved by other people's Blender (tests/data/blend/README.md: source, licence)
TESTDATA = REPO / "tests" / "data" / "blend"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """What only the session's last garbage collection finds (an object left in a reference
    cycle holding an open socket) is reported here, not raised.

    An unclosed socket found while a test runs is still that test's error (filterwarnings).
    Left to pytest's own last collection, one found after a whole run crashed pytest at its
    exit with no test to name (once, in a run of the suite beside a second load; not traced),
    so a green run's exit status went by the collector's timing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if caught and reporter is not None:
        reporter.write_line("")  # after the progress line
        reporter.write_sep("-", "left for the last garbage collection", yellow=True)
        for found in caught:
            reporter.write_line(f"{found.category.__name__}: {found.message}", yellow=True)


@pytest.fixture(scope="session", autouse=True)
def test_doubles() -> Iterator[None]:
    """The fake NVML and NVENC (tests/doubles.py), which production settings refuse, allowed in
    the test process; a farm subprocess gets them through ``python -m tests.doubles``."""
    from tests import doubles

    doubles.install()
    yield
    doubles.uninstall()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server of this test session's own on a free port (never the machine's 6379)."""
    with RedisServer(tmp_path_factory.mktemp("redis"), unix_socket=False) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    yield redis_server.url
    conn.flushall()
    conn.close()


@pytest.fixture
def rconn(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    yield conn
    conn.close()


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Commands (or pipelines) sent to Redis, by the name of the thread that sent them."""
    sent: Counter[str] = Counter()
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(
        self: redis.connection.AbstractConnection, command: object, check_health: bool = True
    ) -> None:
        sent[threading.current_thread().name] += 1
        send(self, command, check_health)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    yield sent


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (a real HTTP endpoint, own process) for the session; the
    AWS credential variables boto3 reads are set to moto's test keys meanwhile."""
    from tests.s3server import CREDENTIALS, MotoServer

    with pytest.MonkeyPatch.context() as mp, MotoServer() as server:
        for name, value in CREDENTIALS.items():
            mp.setenv(name, value)
        yield server.endpoint


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on the session's moto server."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=name)
    client.close()
    return name
