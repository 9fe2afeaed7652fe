"""Delivery through a faulty network: a proxy on loopback between the farm's storage and moto
injects 500/503 bursts, resets mid-upload, lost replies and a slow endpoint. Uploads complete
intact after retries, or fail with the reason; a truncated object is never reported stored."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from farm.errors import StorageDenied, StorageUnavailable
from farm.settings import Settings
from farm.storage.base import Storage
from farm.storage.factory import open_storage
from tests.faultproxy import FaultProxy, Request

MIB = 1 << 20


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    with FaultProxy(s3_endpoint) as p:
        yield p


def storage(proxy: FaultProxy, bucket: str, **changes: object) -> Storage:
    settings = Settings().with_(
        s3_endpoint_url=proxy.url,
        s3_addressing_style="path",
        s3_multipart_threshold_mib=5,
        s3_multipart_chunk_mib=5,
        s3_max_attempts=4,
        s3_timeout_s=5.0,
    )
    return open_storage(f"s3://{bucket}/out", settings.with_(**changes))


def frame(tmp: Path, size: int, name: str = "frame_0001.exr") -> Path:
    path = tmp / name
    path.write_bytes(os.urandom(size))
    return path


def stored_sha(s3_endpoint: str, bucket: str, key: str) -> str | None:
    """The sha256 of what moto holds, read straight from it (not through the proxy)."""
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None
    finally:
        client.close()
    return hashlib.sha256(body).hexdigest()


def is_put(r: Request) -> bool:
    return r.method == "PUT"


def is_part(r: Request) -> bool:
    return r.method == "PUT" and "partNumber=" in r.path


def is_complete(r: Request) -> bool:
    return r.method == "POST" and "uploadId=" in r.path


@pytest.mark.parametrize("status", ["500", "503"])
def test_a_burst_of_server_errors_is_retried_and_the_object_is_intact(
    status: str, proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 300_000)
    proxy.inject(status, count=2, match=is_put)
    store = storage(proxy, bucket)
    stored = store.put("frame_0001.exr", src, once=True, deliverable=True)
    store.close()
    assert [k for k, _ in proxy.log.injected] == [status] * 2
    assert stored.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()
    assert stored_sha(s3_endpoint, bucket, "out/frame_0001.exr") == stored.sha256


def test_a_connection_reset_mid_part_is_retried_and_the_object_is_intact(
    proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 11 * MIB)
    proxy.inject("reset_mid_body", count=2, match=is_part)
    store = storage(proxy, bucket)
    stored = store.put("frame_0001.exr", src, once=True)
    store.close()
    assert len(proxy.log.injected) == 2
    assert stored_sha(s3_endpoint, bucket, "out/frame_0001.exr") == stored.sha256
    assert stored.sha256 == hashlib.sha256(src.read_bytes()).hexdigest()


@pytest.mark.parametrize("size", [200_000, 6 * MIB], ids=["put", "multipart"])
def test_a_commit_whose_reply_is_lost_is_recognised_on_retry(
    size: int, proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    # the store committed the object, the reply never came back: the retry meets the object
    # (412 on If-None-Match) and finds its own bytes there
    src = frame(tmp_path, size)
    proxy.inject("drop_reply", match=is_complete if size > 5 * MIB else is_put)
    store = storage(proxy, bucket)
    stored = store.put("frame_0001.exr", src, once=True)
    store.close()
    assert len(proxy.log.injected) == 1
    assert stored_sha(s3_endpoint, bucket, "out/frame_0001.exr") == stored.sha256


def test_errors_past_the_retries_fail_with_the_reason_and_store_nothing(
    proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 300_000)
    proxy.inject("503", count=100, match=is_put)
    store = storage(proxy, bucket, s3_max_attempts=3)
    with pytest.raises(StorageUnavailable) as err:
        store.put("frame_0001.exr", src, once=True)
    store.close()
    assert "in 3 attempts" in err.value.message and "SlowDown" in err.value.message
    assert len(proxy.log.injected) == 3
    assert stored_sha(s3_endpoint, bucket, "out/frame_0001.exr") is None


def test_resets_on_every_try_never_leave_a_truncated_object(
    proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 2 * MIB)
    proxy.inject("reset_mid_body", count=100, match=is_put)
    store = storage(proxy, bucket, s3_max_attempts=2)
    with pytest.raises(StorageUnavailable, match="did not answer in 2 attempts"):
        store.put("frame_0001.exr", src, once=True)
    store.close()
    assert stored_sha(s3_endpoint, bucket, "out/frame_0001.exr") is None


def test_a_slow_endpoint_still_delivers(
    proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 7 * MIB)
    proxy.slow_s = 0.2
    store = storage(proxy, bucket)
    stored = store.put("frame_0001.exr", src, once=True)
    store.close()
    assert stored_sha(s3_endpoint, bucket, "out/frame_0001.exr") == stored.sha256


def test_an_endpoint_slower_than_the_timeout_fails_after_its_attempts(
    proxy: FaultProxy, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 1000)
    proxy.inject("delay", count=2, match=is_put, delay_s=2.0)
    store = storage(proxy, bucket, s3_timeout_s=0.5, s3_max_attempts=2)
    with pytest.raises(StorageUnavailable, match="did not answer in 2 attempts"):
        store.put("frame_0001.exr", src, once=True)
    store.close()


def test_a_download_cut_off_mid_body_is_fetched_again_and_checked(
    proxy: FaultProxy, bucket: str, tmp_path: Path
) -> None:
    src = frame(tmp_path, 3 * MIB)
    store = storage(proxy, bucket)
    stored = store.put("frame_0001.exr", src)
    proxy.inject("cut_reply", match=lambda r: r.method == "GET")
    back = store.get("frame_0001.exr", tmp_path / "back.exr")
    store.close()
    assert [k for k, _ in proxy.log.injected] == ["cut_reply"]
    assert hashlib.sha256(back.read_bytes()).hexdigest() == stored.sha256
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".back")] == []


def test_a_refusal_is_not_retried_and_names_the_object(
    proxy: FaultProxy, bucket: str, tmp_path: Path
) -> None:
    proxy.inject("403", count=10, match=is_put)
    store = storage(proxy, bucket)
    with pytest.raises(StorageDenied) as err:
        store.put("frame_0001.exr", frame(tmp_path, 1000))
    store.close()
    assert f"s3://{bucket}/out/frame_0001.exr" in err.value.message
    assert "AccessDenied" in err.value.message
    assert len(proxy.log.injected) == 1, "a refusal is final: no retries"
