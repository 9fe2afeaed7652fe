"""Deleting uploads (API and CLI): only by the upload's project, refused while a job that has
not finished renders it, its stored file gone once no other project holds the same bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from farm import cli, jobstore, keys, queue, submission, uploadrecords
from farm.accept import accept
from farm.models import BlendSource
from farm.settings import Settings
from farm.states import JobState
from farm.storage.local import LocalStorage
from tests.conftest import TESTDATA
from tests.farmprocs import WorkerProcess
from tests.web.conftest import Tokens, api, bearer, scene_report, wait_for_worker
from web import intake

PLAIN = TESTDATA / "01_principled_material.blend"
#: the example scene: no external files, so `farm submit` takes it as it is
EXAMPLE = Path(__file__).resolve().parents[2] / "farm" / "examples" / "example.blend"


async def _upload(client: TestClient[Any, Any], token: str, project: str) -> str:
    resp = await client.put(f"/api/uploads/scene.blend?project={project}",
                            data=PLAIN.read_bytes(), headers=bearer(token))  # fmt: skip
    assert resp.status == 201, await resp.text()
    return str((await resp.json())["upload_id"])


async def _delete(client: TestClient[Any, Any], token: str, sha: str, query: str = "") -> Any:
    return await client.delete(f"/api/uploads/{sha}{query}", headers=bearer(token))


def _job_using(settings: Settings, project: str, sha: str, out: Path) -> str:
    """A queued job of ``project`` that renders the upload ``sha`` (no worker needed)."""
    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    rq_conn = queue.connect(settings.redis_url)
    try:
        source = BlendSource("upload", f"uploads/{sha}/upload.blend", sha, "scene.blend")
        req = submission.RenderRequest(output=str(out), frames="1", tiles="1x1", project=project)
        queue_ = queue.RenderQueue(rq_conn, req.device)
        return accept(settings, store, queue_, req, source, report=scene_report()).job_id
    finally:
        store.conn.close()
        rq_conn.close()


def _stored(settings: Settings, sha: str) -> list[Path]:
    return [p for p in (settings.storage_dir / "uploads" / sha).rglob("*") if p.is_file()]


async def test_an_upload_is_deleted_by_its_project_only_and_not_while_a_job_renders_it(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    sha = hashlib.sha256(PLAIN.read_bytes()).hexdigest()
    conn = jobstore.connect(web_settings.redis_url)
    async with api(web_settings) as client:
        assert await _upload(client, tokens.alice, "A") == sha
        # another project's member, and a viewer: not theirs to delete
        for query in ("", "?project=A"):
            assert (await _delete(client, tokens.bob, sha, query)).status == 404
        assert (await _delete(client, tokens.vera, sha)).status == 403
        job_id = _job_using(web_settings, "A", sha, tmp_path / "out")
        busy = await _delete(client, tokens.alice, sha)
        assert busy.status == 409
        error = (await busy.json())["error"]
        assert job_id in error["message"] and error["jobs"] == [job_id]
        assert _stored(web_settings, sha), "refused: the file stays"
        store = jobstore.JobStore(conn)
        assert store.end_job(job_id, JobState.CANCELED, "test") == "ok"
        # project B has the same bytes: A's record goes, the file stays for B
        assert await _upload(client, tokens.bob, "B") == sha
        gone = await _delete(client, tokens.alice, sha, "?project=A")
        assert gone.status == 200, await gone.text()
        body = await gone.json()
        assert (body["objects"], body["kept"]) == (0, "another project has the same file")
        listed = await (await client.get("/api/uploads?project=A",
                                         headers=bearer(tokens.alice))).json()  # fmt: skip
        assert listed["uploads"] == []
        assert int(conn.get(keys.project_stored_bytes("A")) or 0) == 0
        assert (await _delete(client, tokens.alice, sha)).status == 404
        assert _stored(web_settings, sha)
        # the last holder deletes it: the file goes, and its stored record
        last = await (await _delete(client, tokens.bob, sha)).json()
        assert (last["objects"], last["kept"]) == (1, "")
        # the canceled job that rendered it cannot run again: its file is gone
        again = await client.post(f"/api/jobs/{job_id}/requeue", json={},
                                  headers=bearer(tokens.alice))  # fmt: skip
        assert again.status == 409
        assert "was deleted from the farm" in (await again.json())["error"]["message"]
    assert not _stored(web_settings, sha)
    assert conn.get(keys.stored_upload(sha)) is None
    conn.close()


async def test_the_cli_lists_and_deletes_a_projects_uploads_only_with_yes(
    web_settings: Settings, tokens: Tokens, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("FARM_REDIS_URL", web_settings.redis_url)
    monkeypatch.setenv("FARM_STORAGE_DIR", str(web_settings.storage_dir))
    async with api(web_settings) as client:
        sha = await _upload(client, tokens.alice, "A")
    assert cli.main(["uploads", "--project", "A", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(u["upload_id"], u["name"]) for u in listed] == [(sha, "scene.blend")]
    assert cli.main(["uploads", "--project", "A", "delete", sha]) == 2, "not without --yes"
    assert "--yes" in capsys.readouterr().err
    assert cli.main(["uploads", "--project", "B", "delete", sha, "--yes"]) == 3, "not B's"
    assert _stored(web_settings, sha)
    assert cli.main(["uploads", "delete", sha, "--yes"]) == 2, "no project said"
    assert cli.main(["uploads", "delete", sha, "--project", "A", "--yes"]) == 0
    assert not _stored(web_settings, sha)
    assert cli.main(["uploads", "--project", "A"]) == 0
    assert "no uploads" in capsys.readouterr().out


class _PausedDeletion(LocalStorage):
    """The farm's folder storage, whose deletion of stored objects waits at its start until
    the test lets it go: a deletion caught between its checks and its removal."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.entered, self.go = threading.Event(), threading.Event()

    def delete_prefix(self, prefix: str) -> int:
        self.entered.set()
        assert self.go.wait(30), "the test never let the deletion go"
        return super().delete_prefix(prefix)


def _received(tmp: Path, name: str) -> Path:
    """A copy of the test scene as the web receives it (intake consumes it)."""
    path = tmp / name
    shutil.copy(PLAIN, path)
    return path


def test_an_upload_of_the_same_bytes_during_a_deletion_keeps_its_file(
    redis_url: str, tmp_path: Path
) -> None:
    """Project A deletes its upload while project B uploads the same bytes: B's record never
    names bytes the deletion then removes. B's intake waits for the deletion and stores the
    bytes afresh (or, started first, makes the deletion keep them)."""
    conn = jobstore.connect(redis_url)
    storage = _PausedDeletion(tmp_path / "storage")
    sha = hashlib.sha256(PLAIN.read_bytes()).hexdigest()
    conn.sadd(keys.PROJECTS, "A", "B")
    limit = Settings().unpack_max_bytes
    size = PLAIN.stat().st_size
    a_file = intake.Received(_received(tmp_path, "a.blend"), sha, size, "scene.blend")
    intake.receive(conn, storage, a_file, limit, "A", "alice")
    with ThreadPoolExecutor(2) as pool:
        deleting = pool.submit(uploadrecords.delete, conn, storage, "A", sha)
        assert storage.entered.wait(30), "the deletion never reached the stored objects"
        b_file = intake.Received(_received(tmp_path, "b.blend"), sha, size, "scene.blend")
        receiving = pool.submit(intake.receive, conn, storage, b_file, limit, "B", "bob")
        time.sleep(0.5)
        assert not receiving.done(), "B's upload went on beside A's deletion of the same bytes"
        storage.go.set()
        assert deleting.result(30).kept == ""
        rec = receiving.result(30)
    assert rec["project"] == "B" and storage.exists(rec["location"]), "B's file is gone"
    assert json.loads(conn.get(keys.stored_upload(sha)) or "{}")["location"] == rec["location"]
    conn.close()


def test_a_farm_submit_of_the_same_bytes_during_a_deletion_keeps_its_file(
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Project A deletes its upload while an operator's `farm submit` sends the same bytes:
    the submission waits for the deletion and stores them afresh, so its job renders a file
    that is there. Without the bytes' lock it found A's copy, stored nothing, and the
    deletion removed the file its job (or its inspection) then lacked."""
    worker = WorkerProcess(redis_url, tmp_path)  # it inspects the submitted file
    conn = jobstore.connect(redis_url)
    try:
        for name in ("FARM_REDIS_URL", "FARM_STORAGE_DIR", "FARM_WORK_DIR"):
            monkeypatch.setenv(name, worker.env[name])
        storage = _PausedDeletion(worker.settings.storage_dir)
        sha = hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
        conn.sadd(keys.PROJECTS, "A")
        limit = Settings().unpack_max_bytes
        received = tmp_path / "a.blend"
        shutil.copy(EXAMPLE, received)
        upload = intake.Received(received, sha, EXAMPLE.stat().st_size, "scene.blend")
        intake.receive(conn, storage, upload, limit, "A", "alice")
        scene = tmp_path / "scene.blend"
        shutil.copy(EXAMPLE, scene)
        wait_for_worker(redis_url)
        submit = ["submit", str(scene), "--frames", "1", "--tiles", "1x1", "--output",
                  str(tmp_path / "out"), "--json"]  # fmt: skip
        with ThreadPoolExecutor(2) as pool:
            deleting = pool.submit(uploadrecords.delete, conn, storage, "A", sha)
            assert storage.entered.wait(30), "the deletion never reached the stored objects"
            submitting = pool.submit(cli.main, submit)
            time.sleep(0.5)
            assert not submitting.done(), "the submission went on beside the deletion"
            storage.go.set()
            assert deleting.result(30).kept == ""
            assert submitting.result(180) == 0, capsys.readouterr().err
        job = json.loads(capsys.readouterr().out)
        assert job["state"] in ("queued", "running", "done"), job
        assert _stored(worker.settings, sha), "the submitted job's file is gone"
    finally:
        conn.close()
        worker.stop()
