"""A job's delivery record and manifest: written when the last frame arrives, whatever the order,
listing every file with its size, sha256 and link; an S3 prefix holding frames is refused."""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import boto3
import pytest
import redis

from farm import delivery
from farm.errors import OutputExists
from farm.models import BlendSource, JobSpec
from farm.settings import Settings


def job_spec(output: str, frames: tuple[int, ...] = (1, 2, 3)) -> JobSpec:
    return JobSpec(
        source=BlendSource("path", "/x.blend", "0" * 64, "x.blend"),
        frames=frames,
        tiles="1x1",
        width=4,
        height=4,
        output=output,
        name="shot",
        formats=("exr", "png"),
    )


def frame_files(tmp: Path, frame: int) -> list[Path]:
    out = []
    for ext in ("exr", "png"):
        path = tmp / f"frame_{frame:04d}.{ext}"
        path.write_bytes(f"frame {frame} {ext}".encode() * 10)
        out.append(path)
    return out


def test_the_manifest_appears_with_the_last_frame_and_lists_every_file(
    rconn: redis.Redis, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    spec = job_spec(str(out))
    settings = Settings()
    sent: dict[str, str] = {}
    for frame in (3, 1, 2):  # assemblers finish in any order
        assert not (out / "manifest.json").exists()
        work = tmp_path / f"work{frame}"
        work.mkdir()
        files = frame_files(work, frame)
        sent.update({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
        delivery.deliver_frame(rconn, settings, spec, "job-1", frame, files)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["job_id"], manifest["name"], manifest["files"]) == ("job-1", "shot", 6)
    assert [entry["frame"] for entry in manifest["frames"]] == [1, 2, 3]
    for entry in manifest["frames"]:
        for item in entry["files"]:
            path = out / item["name"]
            assert (
                item["sha256"]
                == sent[item["name"]]
                == hashlib.sha256(path.read_bytes()).hexdigest()
            )
            assert item["size"] == path.stat().st_size
            assert item["url"] == path.resolve().as_uri()
    assert manifest["bytes"] == sum(p.stat().st_size for p in out.glob("frame_*"))


def test_an_s3_prefix_already_holding_the_frames_is_refused_before_queueing(
    s3_endpoint: str, tmp_path: Path
) -> None:
    bucket = f"m-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="shot/frame_0002.png", Body=b"old")
    client.put_object(Bucket=bucket, Key="other/frame_0001.png", Body=b"elsewhere")
    client.close()
    settings = Settings().with_(s3_endpoint_url=s3_endpoint, s3_addressing_style="path")
    with pytest.raises(OutputExists, match=r"already holds frame_0002\.png"):
        delivery.check_output(job_spec(f"s3://{bucket}/shot"), settings)
    delivery.check_output(job_spec(f"s3://{bucket}/shot", frames=(1,)), settings)
    delivery.check_output(job_spec(f"s3://{bucket}/new"), settings)
    delivery.check_output(job_spec(str(tmp_path)), settings)  # a folder is the user's
