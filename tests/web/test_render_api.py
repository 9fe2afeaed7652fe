"""The API end to end with a real worker: upload, inspect, submit, watch events, download."""

from __future__ import annotations

import asyncio
import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse

from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.conftest import TESTDATA
from tests.farmprocs import WorkerProcess
from tests.web.conftest import Tokens, api, bearer, wait_for_worker

#: the whole render (4 tiles of 67x41, 8 samples) takes seconds; this is for a loaded machine
RENDER_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def textured_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two frames; the floor's texture is ``//textures/missing_texture.png`` (not beside it)."""
    return make_scene(
        tmp_path_factory.mktemp("scene") / "scene.blend", frame_end=2, missing_texture=True
    )


@pytest.fixture
def worker(web_settings: Settings, tmp_path: Path) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(web_settings.redis_url, tmp_path, name="web-e2e")
    try:
        wait_for_worker(web_settings.redis_url)
        yield proc
    finally:
        proc.stop()


async def read_events(resp: ClientResponse) -> list[tuple[str, dict[str, Any]]]:
    """(id, event) of every SSE message until the server ends the stream."""
    out: list[tuple[str, dict[str, Any]]] = []
    entry_id = ""
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            entry_id = line[4:]
        elif line.startswith("data: "):
            out.append((entry_id, json.loads(line[6:])))
    return out


async def test_upload_inspect_submit_watch_and_download(
    web_settings: Settings,
    tokens: Tokens,
    textured_scene: Path,
    worker: WorkerProcess,
) -> None:
    alice = bearer(tokens.alice)
    blend = textured_scene.read_bytes()
    async with api(web_settings) as client:
        # the .blend alone: inspection names the missing texture and submit refuses it
        plain = await (
            await client.put("/api/uploads/scene.blend?project=A", data=blend, headers=alice)
        ).json()
        report = await (
            await client.post(f"/api/uploads/{plain['upload_id']}/inspect", headers=alice)
        ).json()
        assert report["frames"] == "1-2"
        assert report["resolution"] == "67x41"
        assert report["engine"] == "CYCLES"
        assert report["cameras"] and report["scripts_wanted"] is False
        # as the user wrote it in Blender, never the farm's storage path
        assert report["missing_files"] == ["//textures/missing_texture.png"]
        refused = await client.post(
            "/api/jobs", json={"project": "A", "upload_id": plain["upload_id"]}, headers=alice
        )
        assert refused.status == 400
        err = (await refused.json())["error"]
        assert err["code"] == "missing_files"
        assert "//textures/missing_texture.png" in err["message"]
        assert "uploads/" not in err["message"], "the farm's storage layout leaked"

        # a zip with the texture beside the .blend: nothing missing, it renders
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("shot/scene.blend", blend)
            zf.write(TESTDATA / "01_principled_baseColor.png", "shot/textures/missing_texture.png")
        form_resp = await client.post(
            "/api/uploads?project=A",
            data=buf.getvalue(),
            headers={**alice, "X-Filename": "shot.zip"},
        )
        assert form_resp.status == 201, await form_resp.text()
        upload = await form_resp.json()
        report = await (
            await client.post(f"/api/uploads/{upload['upload_id']}/inspect", headers=alice)
        ).json()
        assert report["missing_files"] == []
        made = await client.post(
            "/api/jobs",
            json={
                "project": "A",
                "upload_id": upload["upload_id"],
                "tiles": "2x1",
                "formats": ["exr", "png", "jpeg"],
                "name": "shot",
            },
            headers=alice,
        )
        assert made.status == 201, await made.text()
        job = await made.json()
        job_id = job["job_id"]
        assert job["spec"]["frames"] == [1, 2]

        # live events until the job ends (the stream closes by itself)
        async with client.get(f"/api/jobs/{job_id}/events", headers=alice) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            try:
                events = await asyncio.wait_for(read_events(resp), RENDER_TIMEOUT_S)
            except TimeoutError:
                pytest.fail(
                    f"job {job_id} did not end in {RENDER_TIMEOUT_S} s:\n{worker.log_text()}"
                )
        kinds = [e for _i, e in events]
        assert sum(1 for e in kinds if e["type"] == "tile_state" and e["state"] == "done") == 4
        assert sorted(e["frame"] for e in kinds if e["type"] == "frame_done") == [1, 2]
        assert kinds[-1] == {**kinds[-1], "type": "job_state", "state": "done"}, worker.log_text()
        # resuming after the last event gives nothing more and ends
        async with client.get(
            f"/api/jobs/{job_id}/events", headers={**alice, "Last-Event-ID": events[-1][0]}
        ) as resp:
            assert await read_events(resp) == []

        detail = await (await client.get(f"/api/jobs/{job_id}", headers=alice)).json()
        assert detail["state"] == "done"
        assert detail["frames"] == {
            "1": {"state": "done", "tiles": ["done", "done"]},
            "2": {"state": "done", "tiles": ["done", "done"]},
        }
        frames = await (await client.get(f"/api/jobs/{job_id}/frames", headers=alice)).json()
        assert [f["frame"] for f in frames["frames"]] == [1, 2]
        names = [x["name"] for x in frames["frames"][0]["files"]]
        assert names == ["frame_0001.exr", "frame_0001.jpg", "frame_0001.png"]
        png = await client.get(frames["frames"][0]["files"][2]["url"], headers=alice)
        assert (await png.read()).startswith(b"\x89PNG")
        thumb = await client.get(frames["frames"][1]["thumbnail"], headers=alice)
        assert (await thumb.read()).startswith(b"\xff\xd8\xff")
        # the animation's MP4 preview and the manifest come with the job, not with a frame
        assert [f["name"] for f in frames["files"]] == ["manifest.json", "preview.mp4"]
        mp4 = await client.get(frames["files"][1]["url"], headers=alice)
        mp4_bytes = await mp4.read()
        assert mp4.status == 200 and mp4_bytes[4:8] == b"ftyp"
        missing = await client.get(f"/api/jobs/{job_id}/files/frame_0001.png", headers=alice)
        assert missing.status == 404
        archive = await client.get(f"/api/jobs/{job_id}/download.zip", headers=alice)
        assert archive.status == 200
        with zipfile.ZipFile(io.BytesIO(await archive.read())) as zf:
            assert zf.namelist()[-2:] == ["manifest.json", "preview.mp4"]
            assert sorted(zf.namelist()[:-2]) == sorted(
                f"frame_000{f}.{ext}" for f in (1, 2) for ext in ("exr", "jpg", "png")
            )
            assert zf.read("frame_0001.png") == await png.read()
            assert zf.read("preview.mp4") == mp4_bytes
        logs = await (await client.get(f"/api/jobs/{job_id}/logs", headers=alice)).json()
        assert any("frame_done frame 2" in line for line in logs["lines"])
