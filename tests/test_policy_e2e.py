"""A project's device policy holds where leases are taken: on a stream service asked for a
session, and on a render worker taking a tile, both against the real allocator in Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from encoder.app import running
from farm import cli, jobstore, queue, streamauth, submission
from farm.accept import accept
from farm.alloc.allocator import SlotAllocator
from farm.errors import Forbidden
from farm.settings import Settings
from farm.storage.local import LocalStorage
from tests.blendscenes import make_scene
from tests.encoder.tokens import STREAM_SECRET
from tests.farmprocs import WorkerProcess, wait_for
from tests.web.conftest import scene_report

#: what the allocator says when film's members ask for the CPU device
REFUSED = "in project 'film' the member role may use device classes: gpu; not 'cpu'"
ENDED = ("done", "failed", "canceled")


@pytest.fixture
def film_members_on_gpus_only(redis_url: str) -> Iterator[SlotAllocator]:
    """Project film's policy: its members may lease GPUs only (its admins keep the default)."""
    allocator = SlotAllocator(redis.Redis.from_url(redis_url))
    allocator.set_policy("film", "member", ["gpu"])
    yield allocator
    allocator.conn.close()


def _start_session(url: str, project: str, role: str) -> tuple[int, Any]:
    """POST a session as the web does for a user of ``role`` in ``project`` (its signed token)."""
    token = streamauth.viewer_token(
        STREAM_SECRET, project, "", "controller", 300, project_role=role
    )
    body = {"app": "testpattern", "width": 512, "height": 64, "fps": 10}

    async def go() -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
            http.post(f"{url}/api/streams/sessions", json=body) as resp,
        ):
            return resp.status, await resp.json()

    return asyncio.run(go())


def test_a_stream_session_gets_a_lease_only_where_the_projects_policy_allows(
    redis_url: str, tmp_path: Path, film_members_on_gpus_only: SlotAllocator
) -> None:
    settings = Settings().with_(
        redis_url=redis_url, work_dir=tmp_path, device="cpu", stream_port=0,
        cpu_encode_sessions=2, lease_ttl_s=3.0, agent_timeout_s=3.0, stream_secret=STREAM_SECRET,
    )  # fmt: skip
    allocator = film_members_on_gpus_only
    with running(settings) as service:
        status, refused = _start_session(service.url, "film", "member")
        assert (status, refused["error"]["code"]) == (403, "forbidden"), refused
        assert REFUSED in refused["error"]["message"]
        assert refused["error"]["allowed"] == ["gpu"]
        (device,) = allocator.devices()
        assert (device.used_encoder_sessions, service.sessions) == (0, {})
        # the same request for another project's member, and for film's admin, gets a session
        for project, role in (("docs", "member"), ("film", "admin")):
            status, session = _start_session(service.url, project, role)
            assert status == 201, session
            assert session["project"] == project
        (device,) = allocator.devices()
        assert device.used_encoder_sessions == 2


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("policy") / "small.blend", width=32, height=18)


def _queue_job(settings: Settings, blend: Path, out: Path, role: str) -> tuple[Any, str]:
    """A job of project film submitted by a user of ``role`` there, accepted as the web accepts
    one (its inspection report given, the submitter's role passed), one try per tile."""
    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    rq_conn = queue.connect(settings.redis_url)
    source = LocalStorage(settings.storage_dir).put_upload(blend)
    req = submission.RenderRequest(output=str(out), frames="1", tiles="1x1", formats="exr",
                                   project="film", max_attempts=1)  # fmt: skip
    report = dataclasses.replace(scene_report(32, 18), frame_end=1)
    accepted = accept(settings, store, queue.RenderQueue(rq_conn, "cpu"), req, source, report,
                      role=role)  # fmt: skip
    assert accepted.spec.role == role
    rq_conn.close()
    return store, accepted.job_id


def test_a_render_tile_gets_a_lease_only_where_the_projects_policy_allows(
    redis_url: str, tmp_path: Path, scene: Path, film_members_on_gpus_only: SlotAllocator
) -> None:
    worker = WorkerProcess(redis_url, tmp_path)
    try:
        store, refused = _queue_job(worker.settings, scene, tmp_path / "member", "member")
        ended = wait_for(store, refused, lambda e: e.type == "job_state" and e.state in ENDED)
        assert ended.state == "failed" and REFUSED in ended.message, ended
        assert not (tmp_path / "member").exists() or not any((tmp_path / "member").iterdir())
        store, allowed = _queue_job(worker.settings, scene, tmp_path / "admin", "admin")
        ended = wait_for(store, allowed, lambda e: e.type == "job_state" and e.state in ENDED)
        assert ended.state == "done", ended
        assert list((tmp_path / "admin").rglob("*.exr"))
    finally:
        worker.stop()


def test_farm_policy_sets_what_the_allocator_then_enforces(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    assert cli.main(["policy", "set", "film", "member", "gpu"]) == 0
    assert "member   gpu" in capsys.readouterr().out
    assert cli.main(["policy", "show", "film", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["policy"] == {"admin": ["cpu", "gpu"], "member": ["gpu"], "viewer": []}
    # a name no device class can have is refused, naming the rule (exit 2: bad input)
    assert cli.main(["policy", "set", "film", "member", "t4,a100"]) == 2
    assert "device class 't4,a100'" in capsys.readouterr().err
    allocator = SlotAllocator(redis.Redis.from_url(redis_url))
    with pytest.raises(Forbidden):
        allocator.check_policy("film", "member", "cpu")
    allocator.check_policy("film", "member", "t4")
    allocator.conn.close()
