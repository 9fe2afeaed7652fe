"""No member can exhaust the farm: per-project limits answer 429 naming the limit while other
projects' requests keep answering in normal time; inspections without a worker are refused at
once; every job option is bounded the same way in the API, the CLI and the embedded farm.

Real web app (its own thread and loop), real Redis, a real render worker for inspections.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from farm import jobstore, keys, queue, redisclient
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess
from tests.web.conftest import Tokens, make_job, make_tokens, make_web_settings, wait_for_worker
from tests.web.test_addon_client import LiveWeb

#: what "normal time" means for another project's request while one project floods
OTHERS_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(
        tmp_path_factory.mktemp("scene") / "shot.blend", width=48, height=32, samples=2, frame_end=2
    )


@pytest.fixture
def site(redis_url: str, tmp_path: Path) -> Iterator[tuple[LiveWeb, Tokens]]:
    """The web app on a port of its own, and the test users' tokens (alice: A, bob: B)."""
    live = LiveWeb(make_web_settings(redis_url, tmp_path))
    try:
        yield live, make_tokens(redis_url)
    finally:
        live.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def upload(
    http: aiohttp.ClientSession, url: str, token: str, project: str, blend: Path
) -> str:
    resp = await http.put(
        f"{url}/api/uploads/{blend.name}?project={project}",
        data=blend.read_bytes(),
        headers=bearer(token),
    )
    assert resp.status == 201, await resp.text()
    upload_id: str = (await resp.json())["upload_id"]
    return upload_id


async def set_limits(
    http: aiohttp.ClientSession, url: str, admin: str, project: str, **limits: int
) -> None:
    resp = await http.put(
        f"{url}/api/projects/{project}/limits", json=limits, headers=bearer(admin)
    )
    assert resp.status == 200, await resp.text()


class Latency:
    """Another project's member asking the API in a loop while the flood runs."""

    def __init__(self, http: aiohttp.ClientSession, url: str, token: str, project: str) -> None:
        self.http, self.url, self.token, self.project = http, url, token, project
        self.seconds: list[float] = []
        self.statuses: list[int] = []

    async def run(self, stop: asyncio.Event) -> None:
        paths = [
            "/api/me",
            f"/api/uploads?project={self.project}",
            f"/api/jobs?project={self.project}",
        ]
        i = 0
        while not stop.is_set() or len(self.seconds) < 6:
            t0 = time.perf_counter()
            resp = await self.http.get(self.url + paths[i % 3], headers=bearer(self.token))
            await resp.read()
            self.seconds.append(time.perf_counter() - t0)
            self.statuses.append(resp.status)
            i += 1

    def check(self) -> None:
        assert set(self.statuses) == {200}, self.statuses
        worst = max(self.seconds)
        print(
            f"other project: {len(self.seconds)} requests during the flood, median "
            f"{statistics.median(self.seconds) * 1000:.0f} ms, worst {worst * 1000:.0f} ms"
        )
        assert worst < OTHERS_WITHIN_S, f"another project waited {worst:.2f} s"


async def flood_while_measuring(
    http: aiohttp.ClientSession, other: Latency, requests: list[Any]
) -> list[tuple[int, dict[str, Any]]]:
    """Send every request at once while ``other`` measures; (status, body) of each."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(other.run(stop))

    async def one(req: Any) -> tuple[int, dict[str, Any]]:
        async with req as resp:
            body = await resp.json(content_type=None)
            return resp.status, body or {}

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        stop.set()
        await watcher
        other.check()


def depths(redis_url: str) -> dict[str, int]:
    conn = queue.connect(redis_url)
    try:
        return queue.depths(conn)
    finally:
        conn.close()


def inflight(redis_url: str, project: str, kind: str) -> int:
    conn = redis.Redis.from_url(redis_url)
    try:
        return int(conn.zcard(keys.project_inflight(project, kind)))
    finally:
        conn.close()


# --- inspections --------------------------------------------------------------------------


def test_an_inspection_with_no_worker_online_is_refused_at_once_and_leaves_nothing_queued(
    site: tuple[LiveWeb, Tokens], scene: Path, redis_url: str
) -> None:
    live, tokens = site

    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            upload_id = await upload(http, live.url, tokens.alice, "A", scene)
            t0 = time.perf_counter()
            resp = await http.post(
                f"{live.url}/api/uploads/{upload_id}/inspect", headers=bearer(tokens.alice)
            )
            took = time.perf_counter() - t0
            body = await resp.json()
            assert resp.status == 503, body
            assert body["error"]["code"] == "no_worker"
            assert "no render worker is online" in body["error"]["message"]
            assert took < OTHERS_WITHIN_S
            # the job route says the same, at once, and queues nothing either
            job = await http.post(
                f"{live.url}/api/jobs",
                headers=bearer(tokens.alice),
                json={"project": "A", "upload_id": upload_id},
            )
            assert job.status == 503

    asyncio.run(go())
    assert not any(depths(redis_url).values()), depths(redis_url)
    assert inflight(redis_url, "A", "inspections") == 0


def test_a_flood_of_inspections_gets_429s_while_another_project_answers_in_normal_time(
    site: tuple[LiveWeb, Tokens], scene: Path, redis_url: str, tmp_path: Path
) -> None:
    live, tokens = site
    worker = WorkerProcess(redis_url, tmp_path, name="inspector")
    try:
        wait_for_worker(redis_url)

        async def go() -> list[tuple[int, dict[str, Any]]]:
            async with aiohttp.ClientSession() as http:
                await set_limits(http, live.url, tokens.admin, "A", inspections=2)
                upload_id = await upload(http, live.url, tokens.alice, "A", scene)
                await upload(http, live.url, tokens.bob, "B", scene)
                url = f"{live.url}/api/uploads/{upload_id}/inspect"
                flood = [http.post(url, headers=bearer(tokens.alice)) for _ in range(16)]
                other = Latency(http, live.url, tokens.bob, "B")
                return await flood_while_measuring(http, other, flood)

        answers = asyncio.run(go())
    finally:
        worker.stop()
    statuses = sorted(s for s, _ in answers)
    refused = [b for s, b in answers if s == 429]
    assert statuses.count(200) >= 1 and len(refused) >= 12, statuses
    assert set(statuses) <= {200, 429}, answers
    for body in refused:
        assert body["error"]["limit"] == "inspections" and body["error"]["allowed"] == 2
        assert "inspections" in body["error"]["message"]
    # nothing the flood sent is left behind: no queued inspection, no slot held
    assert not any(depths(redis_url).values()), depths(redis_url)
    assert inflight(redis_url, "A", "inspections") == 0


# --- jobs ---------------------------------------------------------------------------------


def test_a_flood_of_oversize_jobs_gets_429s_and_queues_only_what_fits(
    site: tuple[LiveWeb, Tokens], scene: Path, redis_url: str, tmp_path: Path
) -> None:
    live, tokens = site
    worker = WorkerProcess(redis_url, tmp_path, name="inspector")
    try:
        wait_for_worker(redis_url)

        async def go() -> list[tuple[int, dict[str, Any]]]:
            async with aiohttp.ClientSession() as http:
                upload_id = await upload(http, live.url, tokens.alice, "A", scene)
                # inspected once: the submissions below need no worker
                first = await http.post(
                    f"{live.url}/api/uploads/{upload_id}/inspect", headers=bearer(tokens.alice)
                )
                assert first.status == 200
                await set_limits(http, live.url, tokens.admin, "A", queued_tiles=40)
                # 2 frames x 4x4 tiles = 32 tiles a job, queued for GPUs no worker serves here
                body = {"project": "A", "upload_id": upload_id, "tiles": "4x4", "device": "gpu"}
                flood = [
                    http.post(f"{live.url}/api/jobs", json=body, headers=bearer(tokens.alice))
                    for _ in range(12)
                ]
                # one job larger than any job may be: refused for good (400), naming the limit
                huge = {**body, "tiles": "6x4", "frames": "1-2"}
                await set_limits(http, live.url, tokens.admin, "A", tiles_per_job=40)
                flood.append(
                    http.post(f"{live.url}/api/jobs", json=huge, headers=bearer(tokens.alice))
                )
                other = Latency(http, live.url, tokens.bob, "B")
                return await flood_while_measuring(http, other, flood)

        answers = asyncio.run(go())
    finally:
        worker.stop()
    accepted = [b for s, b in answers if s == 201]
    over = [b for s, b in answers if s == 429]
    too_big = [b for s, b in answers if s == 400]
    assert len(accepted) == 1 and len(over) == 11 and len(too_big) == 1, answers
    for body in over:
        assert body["error"]["limit"] == "queued_tiles" and body["error"]["allowed"] == 40
        assert "queued_tiles" in body["error"]["message"]
    assert too_big[0]["error"]["limit"] == "tiles_per_job"
    assert "at most 40" in too_big[0]["error"]["message"]
    # the queue holds the accepted job's tiles and nothing of the refused ones
    assert depths(redis_url).get(keys.render_queue("gpu"), 0) == 32


# --- uploads ------------------------------------------------------------------------------


def test_uploads_in_flight_and_stored_bytes_are_limited_per_project(
    site: tuple[LiveWeb, Tokens], scene: Path, redis_url: str
) -> None:
    live, tokens = site

    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            await set_limits(http, live.url, tokens.admin, "A", uploads_in_flight=2)
            sessions = []
            for i in range(2):
                made = await http.post(
                    f"{live.url}/api/uploads/sessions",
                    headers=bearer(tokens.alice),
                    json={"project": "A", "name": f"s{i}.blend", "size": 1000},
                )
                assert made.status == 201
                sessions.append((await made.json())["session_id"])
            third = await http.post(
                f"{live.url}/api/uploads/sessions",
                headers=bearer(tokens.alice),
                json={"project": "A", "name": "s3.blend", "size": 10},
            )
            body = await third.json()
            assert third.status == 429 and body["error"]["limit"] == "uploads_in_flight", body
            assert third.headers["Retry-After"]
            raw = await http.put(
                f"{live.url}/api/uploads/x.blend?project=A",
                data=scene.read_bytes(),
                headers=bearer(tokens.alice),
            )
            assert raw.status == 429
            # another project is not held back by A's uploads
            assert await upload(http, live.url, tokens.bob, "B", scene)
            # one ends: there is room again
            gone = await http.delete(
                f"{live.url}/api/uploads/sessions/{sessions[0]}", headers=bearer(tokens.alice)
            )
            assert gone.status == 204
            assert await upload(http, live.url, tokens.alice, "A", scene)
            # stored bytes: the project holds the scene; a budget below two of them refuses
            await set_limits(
                http, live.url, tokens.admin, "A", stored_bytes=scene.stat().st_size + 100
            )
            other = make_scene_copy(scene)
            full = await http.put(
                f"{live.url}/api/uploads/other.blend?project=A",
                data=other,
                headers=bearer(tokens.alice),
            )
            body = await full.json()
            assert full.status == 429 and body["error"]["limit"] == "stored_bytes", body
            listed = await (
                await http.get(f"{live.url}/api/uploads?project=A", headers=bearer(tokens.alice))
            ).json()
            assert len(listed["uploads"]) == 1

    asyncio.run(go())


def make_scene_copy(scene: Path) -> bytes:
    """The same scene as other bytes (another sha256): Blender ignores what follows ENDB."""
    return scene.read_bytes() + b"\0" * 64


# --- the Redis client pool ----------------------------------------------------------------


#: the Redis database of the pool test
POOL_DB = 9


def test_the_redis_pool_is_bounded_and_callers_wait_for_a_connection(
    redis_server: RedisServer,
) -> None:
    # a database no other test uses: the clients counted below are this pool's alone (the
    # session's server also holds other tests' connections, some last seen in BLPOP)
    url = redis_server.url.rsplit("/", 1)[0] + f"/{POOL_DB}"
    conn = redisclient.connect(url, max_connections=2)
    results: list[Any] = []
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            # each call holds its connection for 0.3 s
            results.append(conn.blpop([f"tessera:test:empty:{i}"], timeout=0.3))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    try:
        assert not errors, errors
        assert results == [None] * 6
        # 6 callers, 2 connections: three rounds of 0.3 s, waiting rather than failing
        assert took >= 0.85, took
        clients = [
            c
            for c in redis.Redis.from_url(redis_server.url).client_list()
            if c.get("cmd") in ("blpop", "BLPOP") and str(c.get("db")) == str(POOL_DB)
        ]
        assert len(clients) <= 2
    finally:
        conn.close()


# --- job options ----------------------------------------------------------------------------

BOUNDED = [
    ({"max_attempts": 50}, "1 to 10"),
    ({"max_attempts": 0}, "1 to 10"),
    ({"tile_timeout_s": 1e9}, "604800 s"),
    ({"name": "x" * 200}, "1 to 128"),
    ({"name": "shot\x1b]0;owned\x07\x1b[2J"}, "1 to 128 letters"),
    ({"name": "../../etc"}, "1 to 128 letters"),
    ({"tiles": "64x64", "resolution": "256x256"}, "at least 8 pixels"),
]


@pytest.mark.parametrize(("fields", "bound"), BOUNDED)
def test_every_job_option_is_bounded_in_the_api_with_the_bound_in_the_message(
    site: tuple[LiveWeb, Tokens], fields: dict[str, Any], bound: str, redis_url: str
) -> None:
    live, tokens = site

    async def go() -> None:
        async with aiohttp.ClientSession() as http:
            body = {"project": "A", "upload_id": "ab" * 32, **fields}
            resp = await http.post(f"{live.url}/api/jobs", json=body, headers=bearer(tokens.alice))
            data = await resp.json()
            assert resp.status == 400, data
            assert bound in data["error"]["message"]

    asyncio.run(go())
    assert not any(depths(redis_url).values())


CLI_BOUNDED = [
    (["--max-attempts", "50"], "1 to 10"),
    (["--tiles", "64x64", "--resolution", "256x256"], "at least 8 pixels"),
]


@pytest.mark.parametrize(("args", "bound"), CLI_BOUNDED)
@pytest.mark.parametrize("command", ["render", "submit"])
def test_the_cli_and_the_embedded_farm_refuse_the_same_options(
    command: str, args: list[str], bound: str, scene: Path, tmp_path: Path, redis_url: str
) -> None:
    out = ["--output", str(tmp_path / "out")]
    proc = subprocess.run(
        [sys.executable, "-m", "farm", command, str(scene), *out, *args],
        env={
            **os.environ,
            "FARM_REDIS_URL": redis_url,
            "FARM_WORK_DIR": str(tmp_path / "w"),
            "FARM_STORAGE_DIR": str(tmp_path / "s"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert bound in proc.stderr


def test_names_the_cli_prints_cannot_drive_the_terminal(redis_url: str, tmp_path: Path) -> None:
    settings = Settings().with_(redis_url=redis_url)
    job_id = make_job(settings, "A", tmp_path / "out")
    evil = "shot\x1b]0;owned\x07\x1b[2J\x9b31m\u202etxt.exe"
    store = jobstore.JobStore(jobstore.connect(redis_url))
    try:
        spec = store.spec(job_id)
        import dataclasses

        store.conn.hset(keys.job(job_id), "spec", dataclasses.replace(spec, name=evil).to_json())
    finally:
        store.conn.close()
    env = {**os.environ, "FARM_REDIS_URL": redis_url}
    for args in (["status"], ["status", job_id]):
        proc = subprocess.run(
            [sys.executable, "-m", "farm", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert "shot" in proc.stdout
        for ch in ("\x1b", "\x07", "\x9b", "\u202e"):
            assert ch not in proc.stdout, (args, repr(proc.stdout))
        assert "\\x1b]0;owned\\x07" in proc.stdout
