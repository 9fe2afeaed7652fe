"""Job routes without rendering: bad requests, cancel, retry failed tiles, priority, filters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from farm import jobstore, queue
from farm.models import JOB_OPTIONS, TileTask
from farm.settings import Settings
from tests.web.conftest import SHA, Tokens, api, bearer, make_job


def _job_count(settings: Settings) -> int:
    conn = jobstore.connect(settings.redis_url)
    try:
        return len(conn.keys("tessera:job:*"))
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ("{not json", "bad_parameter", "not valid JSON"),
        ({"colour": "red"}, "bad_parameter", "unknown field(s): colour"),
        ({"frames": "1-x"}, "bad_frame_list", "1-x"),
        ({"resolution": "100000x10"}, "bad_parameter", "65536"),
        ({"samples": 10**9}, "bad_parameter", "samples"),
        ({"resolution": "4x4", "tiles": "8x8"}, "bad_tile_grid", "8"),
        ({"device": "tpu"}, "bad_parameter", "tpu"),
        ({"samples": "many"}, "bad_parameter", "samples"),
        ({"tiles": "2x2", "priority": 10**6}, "bad_parameter", "priority"),
    ],
)
async def test_bad_job_requests_get_a_400_and_no_job(
    web_settings: Settings, tokens: Tokens, body: Any, code: str, words: str
) -> None:
    base = {"project": "A", "upload_id": SHA}
    async with api(web_settings) as client:
        if isinstance(body, str):
            resp = await client.post(
                "/api/jobs",
                data=body,
                headers={**bearer(tokens.alice), "Content-Type": "application/json"},
            )
        else:
            resp = await client.post(
                "/api/jobs", json={**base, **body}, headers=bearer(tokens.alice)
            )
        assert resp.status == 400, await resp.text()
        err = (await resp.json())["error"]
        assert err["code"] == code
        assert words in err["message"]
        assert (await client.get("/api/me", headers=bearer(tokens.alice))).status == 200
    assert _job_count(web_settings) == 0


@pytest.mark.parametrize(
    "field",
    # the server's choice, and fields of the spec or the settings that are not job options
    ["output", "vram_mib", "compositor", "fps", "tile_lease_s", "tiles_per_frame"],
)
async def test_a_field_outside_the_public_job_options_is_refused_by_name(
    web_settings: Settings, tokens: Tokens, field: str
) -> None:
    body = {"project": "A", "upload_id": SHA, field: 1}
    async with api(web_settings) as client:
        resp = await client.post("/api/jobs", json=body, headers=bearer(tokens.alice))
        assert resp.status == 400, await resp.text()
        err = (await resp.json())["error"]
        assert (err["code"], err["fields"]) == ("bad_parameter", [field])
        assert err["message"].startswith(f"unknown field(s): {field}; known: ")
        # and the API's description lists exactly the job options and where the file is
        described = await (await client.get("/api/openapi.json")).json()
    schema = described["paths"]["/api/jobs"]["post"]["requestBody"]["content"]
    props = schema["application/json"]["schema"]["properties"]
    assert set(props) == {*JOB_OPTIONS, "upload_id", "accept_missing"}
    assert _job_count(web_settings) == 0


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("max_attempts", 0, "max attempts must be 1 to 10, not 0"),
        ("max_attempts", 11, "max attempts must be 1 to 10, not 11"),
        ("tile_timeout_s", 0.01, "tile timeout must be 0.1 to 604800 s, not 0.01 s"),
        ("tile_timeout_s", 10**9, "tile timeout must be 0.1 to 604800 s, not 1000000000 s"),
        ("priority", -1001, "priority must be -1000 to 1000, not -1001"),
        ("priority", 1001, "priority must be -1000 to 1000, not 1001"),
    ],
)
async def test_attempts_tile_timeout_and_priority_out_of_bounds_are_refused(
    web_settings: Settings, tokens: Tokens, tmp_path: Path, field: str, value: float, bound: str
) -> None:
    body = {"project": "A", "upload_id": SHA, field: value}
    async with api(web_settings) as client:
        resp = await client.post("/api/jobs", json=body, headers=bearer(tokens.alice))
        assert resp.status == 400, await resp.text()
        err = (await resp.json())["error"]
        assert (err["code"], err["field"], err["message"]) == ("bad_parameter", field, bound)
        if field == "priority":
            # a job's priority changes within the same bounds
            job_id = make_job(web_settings, "A", tmp_path / "o")
            patch = await client.patch(
                f"/api/jobs/{job_id}", json={"priority": value}, headers=bearer(tokens.alice)
            )
            assert patch.status == 400
            assert (await patch.json())["error"]["message"] == bound


async def test_a_job_of_another_project_is_404_and_unknown_upload_too(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = make_job(web_settings, "B", tmp_path / "o")
    async with api(web_settings) as client:
        alice = bearer(tokens.alice)
        for path in (f"/api/jobs/{job_id}", f"/api/jobs/{job_id}/cancel"):
            method = "GET" if path.endswith(job_id) else "POST"
            resp = await client.request(method, path, headers=alice)
            assert resp.status == 404
            assert job_id in (await resp.json())["error"]["message"]
        missing = await client.post(
            "/api/jobs", json={"project": "A", "upload_id": SHA}, headers=alice
        )
        assert missing.status == 404
        assert "upload" in (await missing.json())["error"]["message"]


async def test_cancel_then_cancel_again_is_a_conflict(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = make_job(web_settings, "A", tmp_path / "o")
    async with api(web_settings) as client:
        viewer = await client.post(f"/api/jobs/{job_id}/cancel", headers=bearer(tokens.vera))
        assert viewer.status == 403
        resp = await client.post(f"/api/jobs/{job_id}/cancel", headers=bearer(tokens.alice))
        assert resp.status == 200
        assert (await resp.json())["state"] == "canceled"
        again = await client.post(f"/api/jobs/{job_id}/cancel", headers=bearer(tokens.alice))
        assert again.status == 409
        detail = await (await client.get(f"/api/jobs/{job_id}", headers=bearer(tokens.vera))).json()
        assert detail["frames"]["1"] == {"state": "canceled", "tiles": ["canceled"]}
        logs = await (
            await client.get(f"/api/jobs/{job_id}/logs", headers=bearer(tokens.alice))
        ).json()
        assert any("canceled by alice" in line for line in logs["lines"])


async def test_retry_requeues_the_failed_tiles_of_a_failed_job(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = make_job(web_settings, "A", tmp_path / "o", tiles="2x1")
    store = jobstore.JobStore(jobstore.connect(web_settings.redis_url))
    rq_conn = queue.connect(web_settings.redis_url)
    try:
        # a worker renders frame 1 tile 0, and frame 1 tile 1 fails for good
        done, bad = TileTask(job_id, 1, 0, 1), TileTask(job_id, 1, 1, 1)
        assert store.start_tile(done) == "ok"
        assert store.finish_tile(done, 2) == "ok"
        assert store.start_tile(bad) == "ok"
        assert store.fail_tile(bad, "Blender crashed", max_attempts=1)[0] == "failed"
        async with api(web_settings) as client:
            alice = bearer(tokens.alice)
            job = await (await client.get(f"/api/jobs/{job_id}", headers=alice)).json()
            assert job["state"] == "failed"
            assert "Blender crashed" in job["reason"]
            assert job["frames"]["1"] == {"state": "failed", "tiles": ["done", "failed"]}
            depth = queue.RenderQueue(rq_conn, "cpu").depth()
            resp = await client.post(f"/api/jobs/{job_id}/retry", headers=alice)
            assert resp.status == 200, await resp.text()
            body = await resp.json()
            # the failed tile and frame 2's two tiles go again; the done tile stays done
            assert (body["state"], body["retried_tiles"], body["reason"]) == ("running", 3, "")
            assert queue.RenderQueue(rq_conn, "cpu").depth() == depth + 3
            job = await (await client.get(f"/api/jobs/{job_id}", headers=alice)).json()
            assert job["frames"]["1"]["tiles"] == ["done", "queued"]
            assert store.tile_attempt(job_id, 1, 1) == 2
            again = await client.post(f"/api/jobs/{job_id}/retry", headers=alice)
            assert again.status == 409
            assert "only a failed job" in (await again.json())["error"]["message"]
    finally:
        store.conn.close()
        rq_conn.close()


async def test_priority_change_and_list_filters(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    first = make_job(web_settings, "A", tmp_path / "1")
    second = make_job(web_settings, "A", tmp_path / "2")
    async with api(web_settings) as client:
        alice = bearer(tokens.alice)
        resp = await client.patch(f"/api/jobs/{first}", json={"priority": 7}, headers=alice)
        assert resp.status == 200
        assert (await resp.json())["priority"] == 7
        bad = await client.patch(f"/api/jobs/{first}", json={"priority": "high"}, headers=alice)
        assert bad.status == 400
        await client.post(f"/api/jobs/{second}/cancel", headers=alice)
        listed = await (await client.get("/api/jobs?project=A", headers=alice)).json()
        assert [j["job_id"] for j in listed["jobs"]] == [second, first]
        canceled = await (await client.get("/api/jobs?state=canceled", headers=alice)).json()
        assert [j["job_id"] for j in canceled["jobs"]] == [second]
        wrong = await client.get("/api/jobs?state=sleeping", headers=alice)
        assert wrong.status == 400


async def test_frames_delivered_to_s3_download_by_presigned_link_and_zip(
    web_settings: Settings, tokens: Tokens, s3_endpoint: str, bucket: str
) -> None:
    import io
    import zipfile

    import aiohttp

    from farm.storage.factory import open_storage

    # links presigned for the endpoint browsers reach (tests/web/test_jobs_s3.py: streamed)
    settings = web_settings.with_(
        s3_endpoint_url=s3_endpoint, s3_addressing_style="path", s3_public_url=s3_endpoint
    )
    output = f"s3://{bucket}/renders/shot"
    job_id = make_job(settings, "A", output)
    store = open_storage(output, settings)
    try:
        store.put_bytes("frame_0001.png", b"\x89PNG\r\n\x1a\nframe one")
        store.put_bytes("frame_0001.jpg", b"\xff\xd8\xff frame one")
    finally:
        store.close()
    async with api(settings) as client:
        alice = bearer(tokens.alice)
        listed = await (await client.get(f"/api/jobs/{job_id}/frames", headers=alice)).json()
        files = listed["frames"][0]["files"]
        assert [f["name"] for f in files] == ["frame_0001.jpg", "frame_0001.png"]
        link = await client.get(files[1]["url"], headers=alice, allow_redirects=False)
        assert link.status == 302
        async with aiohttp.ClientSession() as plain, plain.get(link.headers["Location"]) as got:
            assert await got.read() == b"\x89PNG\r\n\x1a\nframe one"
        archive = await client.get(f"/api/jobs/{job_id}/download.zip", headers=alice)
        with zipfile.ZipFile(io.BytesIO(await archive.read())) as zf:
            assert zf.read("frame_0001.jpg") == b"\xff\xd8\xff frame one"


def test_web_jobs_deliver_under_the_farm_storage_s3_included(tmp_path: Path) -> None:
    from farm.settings import Settings
    from web.jobs import job_output

    local = job_output(Settings().with_(storage_dir=tmp_path), "A")
    assert local.startswith(str(tmp_path / "outputs" / "A") + "/")
    # with S3 storage every worker and web instance reaches the frames: never a local folder
    s3 = job_output(Settings().with_(storage_url="s3://farm/prod/"), "A")
    assert s3.startswith("s3://farm/prod/outputs/A/") and s3 != job_output(
        Settings().with_(storage_url="s3://farm/prod/"), "A"
    )
