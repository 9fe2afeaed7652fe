"""S3Storage against moto's server mode on 127.0.0.1: multipart, verification, presigned URLs,
commit-once, storage class, encryption and checksum headers, and clear errors."""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from farm.errors import AlreadyCommitted, StorageNotFound, StorageUnavailable
from farm.models import BlendSource
from farm.settings import Settings
from farm.storage.base import Storage
from farm.storage.factory import open_storage
from tests.faultproxy import FaultProxy
from workers.uploadcache import cached_upload

MIB = 1 << 20


def s3_settings(endpoint: str, **changes: object) -> Settings:
    base = Settings().with_(
        s3_endpoint_url=endpoint,
        s3_addressing_style="path",
        s3_multipart_threshold_mib=5,
        s3_multipart_chunk_mib=5,
        s3_max_attempts=3,
    )
    return base.with_(**changes)


@pytest.fixture
def store(s3_endpoint: str, bucket: str) -> Iterator[Storage]:
    storage = open_storage(f"s3://{bucket}/farm", s3_settings(s3_endpoint))
    yield storage
    storage.close()


def random_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as reply:
        data: bytes = reply.read()
        return data


def test_a_large_object_goes_up_in_parts_and_reads_back_byte_for_byte(
    store: Storage, tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    src = random_file(tmp_path / "frame.exr", 12 * MIB + 3)
    stored = store.put("jobs/j1/frames/frame.exr", src)
    assert stored.size == 12 * MIB + 3 and stored.sha256 == sha256(src.read_bytes())
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=bucket, Key="farm/jobs/j1/frames/frame.exr"
    )
    assert head["ETag"].strip('"').endswith("-3"), "12 MiB in 5 MiB parts is 3 parts"
    back = store.get("jobs/j1/frames/frame.exr", tmp_path / "back.exr")
    assert sha256(back.read_bytes()) == stored.sha256
    assert sha256(http_get(store.presign("jobs/j1/frames/frame.exr", 600))) == stored.sha256


def test_presigned_url_is_fetched_by_a_plain_http_client_with_the_configured_expiry(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    store = open_storage(f"s3://{bucket}", s3_settings(s3_endpoint))
    src = random_file(tmp_path / "frame_0001.png", 1000)
    store.put("out/frame_0001.png", src, deliverable=True)
    url = store.presign("out/frame_0001.png", 900)
    assert "X-Amz-Expires=900" in url and url.startswith(s3_endpoint)
    assert http_get(url) == src.read_bytes()
    store.close()


def test_commit_once_refuses_a_second_writer_and_keeps_the_first(
    store: Storage, tmp_path: Path
) -> None:
    first = random_file(tmp_path / "a", 2000)
    second = random_file(tmp_path / "b", 2000)
    store.put("out/frame_0001.exr", first, once=True)
    with pytest.raises(AlreadyCommitted, match="already committed"):
        store.put("out/frame_0001.exr", second, once=True)
    # the same bytes again: a retried commit, accepted
    assert store.put("out/frame_0001.exr", first, once=True).sha256 == sha256(first.read_bytes())
    assert store.read_bytes("out/frame_0001.exr") == first.read_bytes()


def test_a_late_duplicate_of_the_same_job_leaves_the_first_commit(
    store: Storage, tmp_path: Path
) -> None:
    first = random_file(tmp_path / "a", 6 * MIB)
    late = random_file(tmp_path / "b", 6 * MIB)  # multipart: the commit is the completion
    store.put("out/frame_0002.exr", first, once=True, owner="job-1")
    kept = store.put("out/frame_0002.exr", late, once=True, owner="job-1")
    assert kept.sha256 == sha256(first.read_bytes())
    with pytest.raises(AlreadyCommitted):
        store.put("out/frame_0002.exr", late, once=True, owner="job-2")
    assert sha256(store.read_bytes("out/frame_0002.exr")) == kept.sha256


def test_storage_class_and_encryption_headers_are_sent(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    settings = s3_settings(
        s3_endpoint, s3_storage_class="STANDARD_IA", s3_sse="aws:kms", s3_kms_key_id="key-1"
    )
    with FaultProxy(s3_endpoint) as proxy:
        store = open_storage(f"s3://{bucket}", settings.with_(s3_endpoint_url=proxy.url))
        store.put("frame_0001.png", random_file(tmp_path / "f", 100), deliverable=True)
        store.put("jobs/j/tiles/1/0-a0.exr", random_file(tmp_path / "t", 100))
        store.put("frame_0002.exr", random_file(tmp_path / "big", 6 * MIB), deliverable=True)
        store.close()
    sent = [r for r in proxy.log.requests if r.method in ("PUT", "POST")]
    puts = {r.path.split("?")[0]: r.headers for r in sent}
    frame = puts[f"/{bucket}/frame_0001.png"]
    assert frame["x-amz-storage-class"] == "STANDARD_IA"
    assert frame["x-amz-server-side-encryption"] == "aws:kms"
    assert frame["x-amz-server-side-encryption-aws-kms-key-id"] == "key-1"
    tile = puts[f"/{bucket}/jobs/j/tiles/1/0-a0.exr"]
    assert "x-amz-storage-class" not in tile, "temporary tiles stay STANDARD"
    assert tile["x-amz-server-side-encryption"] == "aws:kms"
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=bucket, Key="frame_0002.exr"
    )
    assert head["StorageClass"] == "STANDARD_IA"
    assert head["ServerSideEncryption"] == "aws:kms"


@pytest.mark.parametrize("mode", ["when_supported", "when_required"])
def test_checksum_mode_decides_whether_crc32_is_sent(
    mode: str, s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    with FaultProxy(s3_endpoint) as proxy:
        store = open_storage(
            f"s3://{bucket}", s3_settings(s3_endpoint, s3_endpoint_url=proxy.url, s3_checksum=mode)
        )
        src = random_file(tmp_path / "f", 7 * MIB)
        store.put("small.bin", random_file(tmp_path / "s", 1000))
        store.put("multi.bin", src)
        store.close()
    uploads = [r for r in proxy.log.requests if r.method == "PUT"]
    assert len(uploads) == 3  # one PUT, two parts
    for r in uploads:
        # CRC32 for stores that check it; Content-MD5 (and the ETag) where they do not
        assert ("x-amz-checksum-crc32" in r.headers) == (mode == "when_supported"), r.headers
        if mode == "when_required" or "partNumber=" in r.path:
            assert "content-md5" in r.headers, r.headers


def test_a_missing_bucket_is_named_in_the_error(s3_endpoint: str, tmp_path: Path) -> None:
    store = open_storage("s3://no-such-bucket-here/x", s3_settings(s3_endpoint))
    with pytest.raises(StorageNotFound, match="bucket no-such-bucket-here does not exist"):
        store.put("a", random_file(tmp_path / "a", 10))
    store.close()


def test_an_endpoint_that_does_not_answer_fails_after_its_attempts(tmp_path: Path) -> None:
    store = open_storage(
        "s3://bucket/x", s3_settings("http://127.0.0.1:9", s3_max_attempts=2, s3_timeout_s=2.0)
    )
    with pytest.raises(StorageUnavailable, match="did not answer in 2 attempts"):
        store.put("a", random_file(tmp_path / "a", 10))
    store.close()


def test_list_stat_and_removing_a_folder_of_tiles(store: Storage, tmp_path: Path) -> None:
    for i in range(3):
        store.put(f"jobs/j/tiles/1/{i}-a0.exr", random_file(tmp_path / f"t{i}", 10 + i))
    store.put("jobs/j/tiles/10/0-a0.exr", random_file(tmp_path / "other", 5))
    assert [o.key for o in store.list("jobs/j/tiles/1/")] == [
        f"jobs/j/tiles/1/{i}-a0.exr" for i in range(3)
    ]
    stat = store.stat("jobs/j/tiles/1/2-a0.exr")
    assert stat is not None and stat.size == 12
    assert store.delete_prefix("jobs/j/tiles/1") == 3
    assert store.list("jobs/j/tiles/1/") == []
    assert store.exists("jobs/j/tiles/10/0-a0.exr"), "frame 10's tiles are not frame 1's"
    assert store.stat("jobs/j/tiles/1/0-a0.exr") is None


def test_an_upload_is_stored_once_by_sha256_and_cached_once_on_a_worker(
    store: Storage, tmp_path: Path
) -> None:
    blend = random_file(tmp_path / "scene.blend", 3000)
    source = store.put_upload(blend)
    assert source == BlendSource(
        "upload", f"uploads/{sha256(blend.read_bytes())}/scene.blend", source.sha256, "scene.blend"
    )
    assert store.put_upload(blend) == source
    cache = tmp_path / "cache"
    path = cached_upload(store, source, cache)
    assert path.read_bytes() == blend.read_bytes()
    assert path.parent.name == source.sha256
    store.delete(source.location)
    assert cached_upload(store, source, cache) == path, "the worker's copy is used again"


def test_a_zip_upload_is_cached_with_the_files_beside_its_blend(
    store: Storage, tmp_path: Path
) -> None:
    sha = "ab" * 32
    files = {"shot/scene.blend": b"BLENDER", "shot/textures/wood.png": b"PNG", "lib.blend": b"L"}
    for rel, data in files.items():
        src = tmp_path / "src"
        src.write_bytes(data)
        store.put(f"uploads/{sha}/files/{rel}", src)
    source = BlendSource("upload", f"uploads/{sha}/files/shot/scene.blend", sha, "scene.blend")
    path = cached_upload(store, source, tmp_path / "cache")
    assert path.read_bytes() == b"BLENDER"
    assert (path.parent / "textures" / "wood.png").read_bytes() == b"PNG"
    assert (path.parent.parent / "lib.blend").read_bytes() == b"L"
    assert cached_upload(store, source, tmp_path / "cache") == path
