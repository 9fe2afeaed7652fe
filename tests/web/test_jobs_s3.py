"""A job submitted through the web API with S3 storage: the frames land in the bucket and the
links the API gives download them, streamed by the web or presigned for FARM_S3_PUBLIC_URL."""

from __future__ import annotations

import asyncio
import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
from aiohttp import ClientResponse
from PIL import Image

from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, until
from tests.web.conftest import Tokens, api, bearer

#: two tiles of one 67x41 frame at 8 samples take seconds; this is for a loaded machine
RENDER_TIMEOUT_S = 180


@pytest.fixture
def s3_settings(web_settings: Settings, s3_endpoint: str, bucket: str) -> Settings:
    """The farm's storage in the bucket, reached at moto's endpoint (as MinIO in compose)."""
    return web_settings.with_(
        storage_url=f"s3://{bucket}/farm",
        s3_endpoint_url=s3_endpoint,
        s3_addressing_style="path",
    )


@pytest.fixture
def s3_worker(
    s3_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WorkerProcess]:
    # a relative path taken for a folder lands here, not in the checkout
    monkeypatch.chdir(tmp_path)
    proc = WorkerProcess(
        s3_settings.redis_url,
        tmp_path,
        name="s3-e2e",
        FARM_STORAGE_URL=s3_settings.storage_url,
        FARM_S3_ENDPOINT_URL=s3_settings.s3_endpoint_url,
        FARM_S3_ADDRESSING_STYLE="path",
    )
    try:

        def started() -> bool:
            return "Listening on" in proc.log_text() or proc.proc.poll() is not None

        until(started, 60, "the worker listening")
        assert proc.proc.poll() is None, f"the worker died:\n{proc.log_text()}"
        yield proc
    finally:
        proc.stop()


async def _job_end(resp: ClientResponse) -> dict[str, Any]:
    """The last event of the job's event stream (the server ends it when the job ends)."""
    last: dict[str, Any] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            last = json.loads(line[6:])
    return last


def _bucket_objects(endpoint: str, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix``, read with boto3 straight from the store: name -> bytes."""
    client = boto3.client("s3", endpoint_url=endpoint)
    try:
        listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return {
            obj["Key"].rsplit("/", 1)[-1]: client.get_object(Bucket=bucket, Key=obj["Key"])[
                "Body"
            ].read()
            for obj in listed
        }
    finally:
        client.close()


async def test_web_job_delivers_to_s3_and_its_links_download_the_frames(
    s3_settings: Settings,
    tokens: Tokens,
    s3_worker: WorkerProcess,
    bucket: str,
    tmp_path: Path,
) -> None:
    alice = bearer(tokens.alice)
    blend = make_scene(tmp_path / "scene.blend").read_bytes()
    async with api(s3_settings) as client:
        uploaded = await client.put("/api/uploads/scene.blend?project=A", data=blend, headers=alice)
        assert uploaded.status == 201, await uploaded.text()
        made = await client.post(
            "/api/jobs",
            json={
                "project": "A",
                "upload_id": (await uploaded.json())["upload_id"],
                "tiles": "2x1",
                "formats": ["exr", "png"],
            },
            headers=alice,
        )
        assert made.status == 201, await made.text()
        job_id = (await made.json())["job_id"]
        async with client.get(f"/api/jobs/{job_id}/events", headers=alice) as resp:
            try:
                last = await asyncio.wait_for(_job_end(resp), RENDER_TIMEOUT_S)
            except TimeoutError:
                pytest.fail(f"job {job_id} did not end:\n{s3_worker.log_text()}")
        assert last.get("state") == "done", s3_worker.log_text()

        # the frames are in the bucket, under the farm's storage prefix; nothing went to a
        # local folder named after the URL (s3:/bucket/...)
        stored = _bucket_objects(s3_settings.s3_endpoint_url, bucket, "farm/outputs/A/")
        assert {"frame_0001.exr", "frame_0001.png", "manifest.json"} <= set(stored)
        assert not [p for p in tmp_path.rglob("s3:*")], "frames went to a local s3: folder"

        listed = await (await client.get(f"/api/jobs/{job_id}/frames", headers=alice)).json()
        (frame,) = listed["frames"]
        files = {f["name"]: f["url"] for f in frame["files"]}
        assert set(files) == {"frame_0001.exr", "frame_0001.png"}
        # no public endpoint: the store's address is the farm's own, so the web streams
        for name, url in files.items():
            got = await client.get(url, headers=alice, allow_redirects=False)
            assert got.status == 200, await got.text()
            assert got.content_length == len(stored[name])
            assert await got.read() == stored[name], name
        # the thumbnail is made from the PNG the store holds (a JPEG, the frame's 67x41 size)
        thumb = await client.get(frame["thumbnail"], headers=alice, allow_redirects=False)
        assert thumb.status == 200 and thumb.content_type == "image/jpeg"
        assert Image.open(io.BytesIO(await thumb.read())).size == (67, 41)
        archive = await client.get(f"/api/jobs/{job_id}/download.zip", headers=alice)
        with zipfile.ZipFile(io.BytesIO(await archive.read())) as zf:
            assert zf.read("frame_0001.exr") == stored["frame_0001.exr"]

    # with FARM_S3_PUBLIC_URL the links are presigned for that address, and open without the
    # farm's token (moto answers on "localhost" as well: the stand-in for a public name)
    public = s3_settings.s3_endpoint_url.replace("127.0.0.1", "localhost")
    async with api(s3_settings.with_(s3_public_url=public)) as client:
        listed = await (await client.get(f"/api/jobs/{job_id}/frames", headers=alice)).json()
        for entry in listed["frames"][0]["files"]:
            link = await client.get(entry["url"], headers=alice, allow_redirects=False)
            assert link.status == 302
            location = link.headers["Location"]
            assert location.startswith(f"{public}/{bucket}/farm/outputs/A/"), location
            async with aiohttp.ClientSession() as browser, browser.get(location) as got:
                assert got.status == 200
                assert await got.read() == stored[entry["name"]]
