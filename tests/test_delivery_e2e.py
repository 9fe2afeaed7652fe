"""Real render jobs delivering to S3 (moto on loopback): a `farm worker` whose uploads and tiles
live in S3 behind a faulty proxy, and `farm render --output s3://...` from the command line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import pytest

from farm import delivery, jobstore, queue, submission
from farm.models import Event
from farm.settings import Settings
from farm.storage.factory import farm_storage, open_storage
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, wait_for
from tests.faultproxy import FaultProxy
from workers import exr


@pytest.fixture(scope="module")
def anim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("s3scene") / "anim.blend", frame_end=2)


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as reply:
        data: bytes = reply.read()
        return data


def target_bytes(manifest: dict[str, Any], name: str) -> bytes:
    urls = [f["url"] for e in manifest["frames"] for f in e["files"] if f["name"] == name]
    return fetch(urls[0])


def ended(event: Event) -> bool:
    return event.type == "job_state" and event.state in ("done", "failed", "canceled")


def test_a_job_with_uploads_and_tiles_in_s3_delivers_every_frame_intact(
    anim: Path, bucket: str, s3_endpoint: str, redis_url: str, tmp_path: Path
) -> None:
    with FaultProxy(s3_endpoint) as proxy:
        worker = WorkerProcess(
            redis_url,
            tmp_path,
            FARM_STORAGE_URL=f"s3://{bucket}/farm",
            FARM_S3_ENDPOINT_URL=proxy.url,
            FARM_S3_ADDRESSING_STYLE="path",
            FARM_S3_STORAGE_CLASS="STANDARD_IA",
        )
        try:
            settings = worker.settings
            store = farm_storage(settings)
            source = store.put_upload(anim)
            # the network misbehaves while tiles and frames go up
            proxy.inject("503", count=3, match=lambda r: r.method == "PUT")
            proxy.inject("reset_mid_body", count=1, match=lambda r: r.body_len > 10_000)
            conn = jobstore.connect(redis_url)
            store_ = jobstore.JobStore(conn)
            rq_conn = queue.connect(redis_url)
            q = queue.RenderQueue(rq_conn, "cpu")
            req = submission.RenderRequest(
                output=f"s3://{bucket}/renders/shot1", tiles="2x1", formats="exr,png"
            )
            report = submission.inspect(conn, q, source, 120, project="default")
            spec, warnings = submission.plan_job(req, report, source)
            delivery.check_output(spec, settings)
            job_id = submission.submit(rq_conn, store_, q, spec, warnings, False)
            end = wait_for(store_, job_id, ended, timeout_s=120)
            assert end.state == "done", (end.message, worker.log_text()[-3000:])
        finally:
            worker.stop()
        injected = [kind for kind, _ in proxy.log.injected]
        assert injected.count("503") == 3 and injected.count("reset_mid_body") == 1
        manifest = delivery.read_manifest(spec.output, settings)
        assert [f["frame"] for f in manifest["frames"]] == [1, 2]
        names = [f["name"] for entry in manifest["frames"] for f in entry["files"]]
        # the animation's MP4 preview goes with whichever frame arrived last
        assert sorted(names) == [
            "frame_0001.exr", "frame_0001.png", "frame_0002.exr", "frame_0002.png", "preview.mp4"
        ]  # fmt: skip
        for entry in manifest["frames"]:
            for item in entry["files"]:
                data = fetch(item["url"])  # a presigned URL, any HTTP client
                assert len(data) == item["size"]
                assert hashlib.sha256(data).hexdigest() == item["sha256"], item["name"]
        exr_path = tmp_path / "frame_0002.exr"
        exr_path.write_bytes(target_bytes(manifest, "frame_0002.exr"))
        assert exr.read_rgba(exr_path).shape == (41, 67, 4)
        assert store.list(f"jobs/{job_id}/tiles/") == [], "tiles are removed after assembly"
        # the MP4's stills stay with the job: a requeue of some frames rebuilds the MP4
        stills = [o.key.rsplit("/", 1)[1] for o in store.list(f"jobs/{job_id}/preview/")]
        assert stills == ["frame_0001.png", "frame_0002.png"]
        assert store.exists(source.location), "the upload stays"
        head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
            Bucket=bucket, Key="renders/shot1/frame_0001.png"
        )
        assert head["StorageClass"] == "STANDARD_IA"
        store.close()


def test_farm_render_delivers_to_s3_and_never_overwrites_a_prefix(
    anim: Path, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "FARM_S3_ENDPOINT_URL": s3_endpoint,
        "FARM_S3_ADDRESSING_STYLE": "path",
    }
    cmd = [sys.executable, "-m", "farm", "render", str(anim), "--frames", "1", "--tiles", "2x1"]
    out = f"s3://{bucket}/demo"
    proc = subprocess.run(
        [*cmd, "--output", out, "--json"], env=env, cwd=tmp_path, capture_output=True,
        text=True, timeout=180, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"written to {out}" in proc.stderr
    assert json.loads(proc.stdout)["job"]["spec"]["output"] == out
    settings = Settings.from_env(env)
    target = open_storage(out, settings)
    assert sorted(o.key for o in target.list("")) == [
        "frame_0001.exr",
        "frame_0001.png",
        "manifest.json",
    ]
    manifest = json.loads(target.read_bytes("manifest.json"))
    png = manifest["frames"][0]["files"][1]
    assert hashlib.sha256(fetch(png["url"])).hexdigest() == png["sha256"]
    target.close()
    again = subprocess.run(
        [*cmd, "--output", out], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=180, check=False,
    )  # fmt: skip
    assert again.returncode == 2, again.stderr
    assert "already holds frame_0001.exr, frame_0001.png" in again.stderr
