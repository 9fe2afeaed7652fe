"""S3 and S3-compatible stores through boto3 (the one module importing it); errors become ours."""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)

from farm.errors import (
    AlreadyCommitted,
    BadParameter,
    StorageCorrupt,
    StorageDenied,
    StorageError,
    StorageNotFound,
    StorageUnavailable,
)
from farm.settings import Settings
from farm.storage.base import (
    CHUNK,
    FILE_MODE,
    ByteSink,
    Storage,
    StoredObject,
    check_key,
    content_type,
    sha256_file,
)

log = logging.getLogger("tessera.storage")

MIB = 1 << 20
#: S3 allows at most this many parts in one multipart upload
MAX_PARTS = 10_000

_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "AllAccessDisabled",
    "KMS.AccessDeniedException",
}
_CORRUPT = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "IncompleteBody"}
_MISSING = {"NoSuchKey", "NoSuchUpload", "NotFound", "404"}
#: reading a response body failed part way (botocore retries the request, not the body)
_STREAM_ERRORS = (ResponseStreamingError, IncompleteReadError, ConnectionError, HTTPClientError)


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix``; every upload is verified, commits can be once."""

    def __init__(self, bucket: str, prefix: str, settings: Settings) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.settings = settings
        self.endpoint = settings.s3_endpoint_url or "AWS S3"
        config = Config(
            region_name=settings.s3_region or None,
            signature_version="s3v4",
            retries={"mode": "standard", "total_max_attempts": settings.s3_max_attempts},
            s3={"addressing_style": settings.s3_addressing_style},
            request_checksum_calculation=settings.s3_checksum,
            response_checksum_validation=settings.s3_checksum,
            connect_timeout=settings.s3_timeout_s,
            read_timeout=settings.s3_timeout_s,
            max_pool_connections=max(10, 2 * settings.s3_max_concurrency),
        )
        try:
            self.client: Any = boto3.session.Session().client(
                "s3", endpoint_url=settings.s3_endpoint_url or None, config=config
            )
        except BotoCoreError as exc:
            raise StorageError(f"cannot configure S3 for {self.url}: {exc}") from exc
        # KMS-encrypted objects' ETags are not the MD5 of their bytes
        self._etag_is_md5 = settings.s3_sse != "aws:kms"
        # whether the store answered the last upload with the CRC32 of what it stored. One that
        # does not (MinIO in some modes, moto) is checked by ETag = MD5 instead, and that MD5
        # is then hashed on another core while the bytes go up, not after
        self._echoes_crc = True
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="s3-md5")
        self._config = config
        #: signs download links for browsers (FARM_S3_PUBLIC_URL); made on the first link
        self._public: Any = None

    # --- naming --------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def url_for(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"

    # --- writing -------------------------------------------------------------------------------

    def _object_args(self, key: str, sha256: str, deliverable: bool, owner: str) -> dict[str, Any]:
        s = self.settings
        meta = {"sha256": sha256, **({"owner": owner} if owner else {})}
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._key(key),
            "ContentType": content_type(key),
            "Metadata": meta,
        }
        if s.s3_sse:
            args["ServerSideEncryption"] = s.s3_sse
            if s.s3_sse == "aws:kms" and s.s3_kms_key_id:
                args["SSEKMSKeyId"] = s.s3_kms_key_id
        if deliverable and s.s3_storage_class:
            args["StorageClass"] = s.s3_storage_class
        return args

    def put(
        self,
        key: str,
        src: Path,
        *,
        once: bool = False,
        deliverable: bool = False,
        owner: str = "",
    ) -> StoredObject:
        check_key(key)
        size = src.stat().st_size
        if size >= self.settings.s3_multipart_threshold_mib * MIB:
            return self._put_multipart(key, src, size, once, deliverable, owner)
        data = src.read_bytes()
        if len(data) != size:
            raise StorageError(f"{src} changed while it was being stored", key=key)
        checksum = self.settings.s3_checksum == "when_supported"
        crc32 = self._hasher.submit(zlib.crc32, data) if checksum else None  # beside the sha256
        sha = hashlib.sha256(data).hexdigest()
        args = self._object_args(key, sha, deliverable, owner)
        args.update(Body=data, ContentLength=size)
        if once:
            args["IfNoneMatch"] = "*"
        if crc32 is not None:
            # the store checks the CRC32 we send and answers with the CRC32 of what it stored
            crc = _b64(crc32.result().to_bytes(4, "big"))
            args["ChecksumCRC32"] = crc
            early = None if self._echoes_crc else self._hasher.submit(_md5_hex, data)
            reply = self._put_object(key, size, sha, owner, args)
            if isinstance(reply, StoredObject):
                return reply
            stored_crc = reply.get("ChecksumCRC32")
            self._echoes_crc = bool(stored_crc)
            if stored_crc:
                if stored_crc != crc:
                    raise StorageCorrupt(
                        f"{self.url_for(key)}: the store's CRC32 {stored_crc} is not the {crc} "
                        "sent",
                        key=key,
                    )
                return StoredObject(key, size, sha, owner)
            # a store ignoring CRC32: its ETag must be the MD5 of the bytes sent
            md5 = early.result() if early is not None else _md5_hex(data)
        else:
            # no CRC32 goes with the request: Content-MD5 lets the store check the bytes, and
            # its ETag is the MD5 of what it stored
            md5 = hashlib.md5(data, usedforsecurity=False).hexdigest()
            args["ContentMD5"] = _b64(bytes.fromhex(md5))
            reply = self._put_object(key, size, sha, owner, args)
            if isinstance(reply, StoredObject):
                return reply
        return self._verify(key, size, sha, md5, reply.get("ETag", ""), owner)

    def _put_object(
        self, key: str, size: int, sha: str, owner: str, args: dict[str, Any]
    ) -> dict[str, Any] | StoredObject:
        """PutObject's reply, or the object already committed under the key (see put)."""
        try:
            reply: dict[str, Any] = self._call("upload", key, self.client.put_object, **args)
        except AlreadyCommitted:
            return self._settle_conflict(key, size, sha, owner)
        return reply

    def _put_multipart(
        self, key: str, src: Path, size: int, once: bool, deliverable: bool, owner: str
    ) -> StoredObject:
        sha = sha256_file(src)
        part = self.settings.s3_multipart_chunk_mib * MIB
        if math.ceil(size / part) > MAX_PARTS:
            part = math.ceil(size / MAX_PARTS / MIB) * MIB
        count = math.ceil(size / part)
        crc = self.settings.s3_checksum == "when_supported"
        create = self._object_args(key, sha, deliverable, owner)
        if crc:
            create["ChecksumAlgorithm"] = "CRC32"
        upload_id = self._call("upload", key, self.client.create_multipart_upload, **create)[
            "UploadId"
        ]
        try:
            with (
                src.open("rb") as fh,
                ThreadPoolExecutor(
                    self.settings.s3_max_concurrency, thread_name_prefix="s3-part"
                ) as pool,
            ):
                futures = [
                    pool.submit(self._upload_part, key, fh.fileno(), upload_id, n, part, size, crc)
                    for n in range(count)
                ]
                parts = [f.result() for f in futures]
            digests = b"".join(d for d, _ in parts)
            done: dict[str, Any] = {
                "Bucket": self.bucket,
                "Key": self._key(key),
                "UploadId": upload_id,
                "MultipartUpload": {"Parts": [p for _, p in parts]},
            }
            if once:
                done["IfNoneMatch"] = "*"
            reply = self._call("upload", key, self.client.complete_multipart_upload, **done)
        except (AlreadyCommitted, StorageNotFound) as exc:
            # a commit retried after its reply was lost meets its own object (or an upload
            # that no longer exists): the stored object decides
            self._abort(key, upload_id)
            if isinstance(exc, StorageNotFound) and self.stat(key) is None:
                raise
            return self._settle_conflict(key, size, sha, owner)
        except BaseException:
            self._abort(key, upload_id)
            raise
        etag = hashlib.md5(digests, usedforsecurity=False).hexdigest() + f"-{count}"
        return self._verify(key, size, sha, etag, reply.get("ETag", ""), owner)

    def _upload_part(
        self, key: str, fd: int, upload_id: str, n: int, part: int, size: int, crc: bool
    ) -> tuple[bytes, dict[str, Any]]:
        offset = n * part
        data = os.pread(fd, min(part, size - offset), offset)
        md5 = hashlib.md5(data, usedforsecurity=False)
        args: dict[str, Any] = {
            "Bucket": self.bucket,
            "Key": self._key(key),
            "UploadId": upload_id,
            "PartNumber": n + 1,
            "Body": data,
            "ContentLength": len(data),
            "ContentMD5": _b64(md5.digest()),
        }
        if crc:
            args["ChecksumAlgorithm"] = "CRC32"
        reply = self._call("upload", key, self.client.upload_part, **args)
        self._check_etag(key, reply.get("ETag", ""), md5.hexdigest())
        done = {"PartNumber": n + 1, "ETag": reply["ETag"]}
        if crc and reply.get("ChecksumCRC32"):
            done["ChecksumCRC32"] = reply["ChecksumCRC32"]
        return md5.digest(), done

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=self._key(key), UploadId=upload_id
            )
        except (BotoCoreError, ClientError) as exc:
            # a lifecycle rule should sweep incomplete uploads; nothing was committed
            log.warning("event=multipart_abort_failed key=%s error=%r", self.url_for(key), exc)

    def _check_etag(self, key: str, etag: str, expected: str) -> None:
        etag = etag.strip('"')
        if self._etag_is_md5 and etag and etag != expected:
            raise StorageCorrupt(
                f"{self.url_for(key)}: the store's checksum {etag} is not the {expected} sent",
                key=key,
            )

    def _verify(
        self, key: str, size: int, sha: str, etag: str, replied: str, owner: str
    ) -> StoredObject:
        """Check what the store holds. Its ETag is the MD5 of the bytes it stored (of each
        part's MD5 for a multipart upload): equal to ours, the object is what was sent, size
        included. Where ETags are no MD5 (SSE-KMS) or the reply had none, a HEAD compares the
        stored size and recorded sha256."""
        self._check_etag(key, replied, etag)
        if self._etag_is_md5 and replied.strip('"') == etag:
            return StoredObject(key, size, sha, owner)
        head = self._call("verify", key, self.client.head_object, **self._where(key))
        meta = head.get("Metadata", {})
        stored = StoredObject(
            key, int(head["ContentLength"]), meta.get("sha256", ""), meta.get("owner", "")
        )
        problems = []
        if stored.size != size:
            problems.append(f"{stored.size} bytes stored, {size} sent")
        if stored.sha256 != sha:
            problems.append(f"sha256 {stored.sha256 or 'missing'}, {sha} sent")
        if self._etag_is_md5 and head.get("ETag", "").strip('"') != etag:
            problems.append(f"ETag {head.get('ETag')}, {etag} expected")
        if problems:
            raise StorageCorrupt(
                f"{self.url_for(key)} is not what was uploaded: {'; '.join(problems)}", key=key
            )
        return stored

    def _settle_conflict(self, key: str, size: int, sha: str, owner: str) -> StoredObject:
        """A commit-once key is taken: by these very bytes (a retried commit), by an earlier
        commit of the same owner (this one is a late duplicate), or by someone else."""
        existing = self.stat(key)
        if existing is not None and existing.size == size and existing.sha256 == sha:
            log.info("event=commit_repeated key=%s", self.url_for(key))
            return existing
        if existing is not None and owner and existing.owner == owner:
            log.warning("event=duplicate_discarded key=%s owner=%s", self.url_for(key), owner)
            return existing
        raise AlreadyCommitted(
            f"{self.url_for(key)} was already committed with other bytes; it is kept",
            key=key,
            url=self.url_for(key),
        )

    # --- reading -------------------------------------------------------------------------------

    def _where(self, key: str) -> dict[str, str]:
        return {"Bucket": self.bucket, "Key": self._key(check_key(key))}

    def stat(self, key: str) -> StoredObject | None:
        try:
            head = self._call("stat", key, self.client.head_object, **self._where(key))
        except StorageNotFound:
            return None
        meta = head.get("Metadata", {})
        return StoredObject(
            key, int(head["ContentLength"]), meta.get("sha256", ""), meta.get("owner", "")
        )

    def get(self, key: str, dest: Path) -> Path:
        """Download into ``dest``, checked against the stored size and sha256; a broken body
        is fetched again (botocore retries requests, not the reading of a body)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        last: Exception | None = None
        for _ in range(self.settings.s3_max_attempts):
            fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
            tmp = Path(tmp_name)
            try:
                with os.fdopen(fd, "wb") as out:
                    self._download(key, out)
                os.chmod(tmp, FILE_MODE)
                os.replace(tmp, dest)
                return dest
            except (StorageUnavailable, StorageCorrupt) as exc:
                last = exc
                log.warning("event=download_retry key=%s error=%r", self.url_for(key), exc)
            finally:
                tmp.unlink(missing_ok=True)
        assert last is not None
        raise last

    def _download(self, key: str, out: Any) -> None:
        reply = self._call("download", key, self.client.get_object, **self._where(key))
        size = int(reply["ContentLength"])
        want = reply.get("Metadata", {}).get("sha256", "")
        digest, got = hashlib.sha256(), 0
        body = reply["Body"]
        try:
            while chunk := body.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
                got += len(chunk)
        except _STREAM_ERRORS as exc:
            raise StorageUnavailable(
                f"download of {self.url_for(key)} broke off after {got} bytes: {exc}", key=key
            ) from exc
        except BotoCoreError as exc:  # FlexibleChecksumError: not the bytes the store recorded
            raise StorageCorrupt(f"download of {self.url_for(key)}: {exc}", key=key) from exc
        finally:
            body.close()
        if got != size or (want and digest.hexdigest() != want):
            raise StorageCorrupt(
                f"{self.url_for(key)}: downloaded {got} of {size} bytes, sha256 "
                f"{digest.hexdigest()} (stored {want or 'unknown'})",
                key=key,
            )

    def list(self, prefix: str) -> list[StoredObject]:
        out = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix)
        )
        start = len(self._key(""))
        try:
            for page in pages:
                for obj in page.get("Contents", []):
                    out.append(StoredObject(obj["Key"][start:], int(obj["Size"])))
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, "list", prefix) from exc
        return sorted(out, key=lambda o: o.key)

    # --- removing ------------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, **self._where(key))

    def delete_prefix(self, prefix: str) -> int:
        folder = prefix.rstrip("/") + "/"
        objects = self.list(folder)
        for obj in objects:
            self.delete(obj.key)
        return len(objects)

    # --- links ---------------------------------------------------------------------------------

    def presign(self, key: str, expires_s: int) -> str:
        """Signed for the public endpoint where there is one: SigV4 signs the host, so a link
        made for the internal endpoint and rewritten would be refused."""
        try:
            url: str = self._link_client().generate_presigned_url(
                "get_object", Params=self._where(key), ExpiresIn=expires_s
            )
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, "presign", key) from exc
        return url

    def _link_client(self) -> Any:
        public = self.settings.s3_public_url
        if not public:
            return self.client
        if self._public is None:
            parts = urlsplit(public)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise BadParameter(
                    f"FARM_S3_PUBLIC_URL={public!r} is not an http(s)://HOST[:PORT] address"
                )
            try:
                # signing only: this client never connects
                self._public = boto3.session.Session().client(
                    "s3", endpoint_url=public, config=self._config
                )
            except BotoCoreError as exc:
                raise StorageError(f"cannot configure S3 links for {public}: {exc}") from exc
        return self._public

    def browser_links(self) -> bool:
        # AWS S3's own endpoint is public; a custom one (MinIO at http://minio:9000) needs
        # FARM_S3_PUBLIC_URL
        return bool(self.settings.s3_public_url or not self.settings.s3_endpoint_url)

    def copy_to(self, key: str, out: ByteSink) -> None:
        """Streams the object; its size and sha256 are checked at the end (a mismatch raises
        after the bytes went out: the reader's copy is cut short, never passed as whole)."""
        self._download(key, out)

    def close(self) -> None:
        self._hasher.shutdown(wait=True)
        self.client.close()
        if self._public is not None:
            self._public.close()

    # --- errors --------------------------------------------------------------------------------

    def _call(self, action: str, key: str, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(exc, action, key) from exc

    def _error(self, exc: Exception, action: str, key: str) -> StorageError:
        """botocore's exception as the farm's, with a message naming the object and endpoint."""
        where = self.url_for(key) if key else self.url
        attempts = self.settings.s3_max_attempts
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            text = f"{code or status}: {err.get('Message') or 'no message'}"
            fields: dict[str, Any] = {"url": where, "s3_code": code, "http_status": status}
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return AlreadyCommitted(f"{where} already exists; it is never replaced", **fields)
            if code == "NoSuchBucket":
                return StorageNotFound(
                    f"bucket {self.bucket} does not exist at {self.endpoint}", **fields
                )
            if code in _MISSING or (status == 404 and action != "list"):
                return StorageNotFound(f"{where} does not exist", **fields)
            if status == 403 or code in _DENIED:
                return StorageDenied(f"S3 refused to {action} {where}: {text}", **fields)
            if code in _CORRUPT:
                return StorageCorrupt(f"S3 refused the bytes of {where}: {text}", **fields)
            if status >= 500 or code in ("SlowDown", "RequestTimeout", "Throttling"):
                return StorageUnavailable(
                    f"S3 could not {action} {where} in {attempts} attempts: {text}", **fields
                )
            return StorageError(f"S3 could not {action} {where}: {text}", **fields)
        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return StorageDenied(
                f"no usable AWS credentials to {action} {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the host a role",
                url=where,
            )
        if isinstance(exc, ConnectionError | HTTPClientError):
            return StorageUnavailable(
                f"cannot {action} {where}: {self.endpoint} did not answer in {attempts} "
                f"attempts ({exc})",
                url=where,
            )
        return StorageError(f"S3 could not {action} {where}: {exc}", url=where)


def _md5_hex(data: bytes) -> str:
    # hashlib releases the GIL on large buffers: this runs beside the upload
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")
