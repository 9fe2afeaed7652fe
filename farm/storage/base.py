"""The interface every object store implements (Storage), the objects it holds, and key checks.

Keys are relative paths (``uploads/<sha256>/scene.blend``, ``jobs/<id>/tiles/...``). Every write
is whole or absent: readers see the old object or the whole new one, never a part.
"""

from __future__ import annotations

import hashlib
import mimetypes
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from farm.errors import (
    StorageError,
)
from farm.models import BlendSource

CHUNK = 1 << 20


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: mode of files the farm writes: what the process's umask allows (mkstemp would give 0600)
FILE_MODE = 0o666 & ~_umask()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_type(key: str) -> str:
    if key.endswith(".exr"):
        return "image/x-exr"
    return mimetypes.guess_type(key)[0] or "application/octet-stream"


@dataclass(frozen=True)
class StoredObject:
    """One object as the store holds it; ``sha256`` is empty where the store does not know it."""

    key: str
    size: int
    sha256: str = ""
    #: who committed it (a job id), where the store records it
    owner: str = ""


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"storage key {key!r} is not a plain relative path", key=key)
    return key


class ByteSink(Protocol):
    """Where copy_to writes: a file, or a web response fed from a worker thread."""

    def write(self, data: bytes, /) -> object: ...


class Storage(ABC):
    """What the farm needs from an object store; LocalStorage and S3Storage implement it."""

    #: where the store is: ``file:///root`` or ``s3://bucket/prefix``
    url: str

    @abstractmethod
    def put(
        self,
        key: str,
        src: Path,
        *,
        once: bool = False,
        deliverable: bool = False,
        owner: str = "",
    ) -> StoredObject:
        """Store the file ``src`` under ``key`` and verify it (size and checksum).

        ``once``: the key is committed once; a second writer with other bytes gets
        AlreadyCommitted, unless it has the same ``owner`` (a job's late duplicate: the first
        commit stands and is returned). The same bytes again are accepted: a retried commit.
        ``deliverable``: a delivered output (frames, manifest): S3 gives it the configured
        storage class.
        """

    def put_bytes(
        self, key: str, data: bytes, *, once: bool = False, deliverable: bool = False
    ) -> StoredObject:
        with tempfile.TemporaryDirectory(prefix="tessera-put-") as tmp:
            src = Path(tmp) / "object"
            src.write_bytes(data)
            return self.put(key, src, once=once, deliverable=deliverable)

    def move_in(self, key: str, src: Path) -> StoredObject:
        """Put ``src`` under ``key``; the scratch file ``src`` is gone once stored, and kept
        when storing failed (for a retry)."""
        stored = self.put(key, src)
        src.unlink(missing_ok=True)
        return stored

    @abstractmethod
    def get(self, key: str, dest: Path) -> Path:
        """Copy the object into the file ``dest`` (written whole or not at all)."""

    def fetch(self, key: str, scratch: Path) -> Path:
        """A local file with the object's bytes: the stored file itself where the store is a
        folder, else a download to ``scratch``."""
        return self.get(key, scratch)

    def read_bytes(self, key: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="tessera-get-") as tmp:
            return self.get(key, Path(tmp) / "object").read_bytes()

    def copy_to(self, key: str, out: ByteSink) -> None:
        """Write the object's bytes to ``out`` as they arrive (a web response streaming it)."""
        with (
            tempfile.TemporaryDirectory(prefix="tessera-get-") as tmp,
            self.fetch(key, Path(tmp) / "object").open("rb") as src,
        ):
            shutil.copyfileobj(src, out, CHUNK)

    @abstractmethod
    def stat(self, key: str) -> StoredObject | None:
        """The object's size (and sha256 where recorded), or None when there is none."""

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    @abstractmethod
    def list(self, prefix: str) -> list[StoredObject]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; removing one that is not there is not an error."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under the folder ``prefix``; returns how many."""

    @abstractmethod
    def url_for(self, key: str) -> str:
        """The object's address (``file:///...``, ``s3://bucket/key``)."""

    @abstractmethod
    def presign(self, key: str, expires_s: int) -> str:
        """A URL a plain HTTP client can download the object from, for ``expires_s``."""

    def browser_links(self) -> bool:
        """Whether presign()'s URLs open from a user's browser, outside the farm's network:
        not a file:// path, nor an in-cluster S3 endpoint; else the web streams the files."""
        return False

    def put_upload(
        self, src: Path, name: str | None = None, sha256: str | None = None
    ) -> BlendSource:
        """Store a .blend under its content hash (``sha256`` when the caller has it); the
        same bytes twice are stored once."""
        name = name or src.name
        sha = sha256 or sha256_file(src)
        key = f"uploads/{sha}/{name}"
        existing = self.stat(key)
        if existing is None or existing.size != src.stat().st_size:
            self.put(key, src)
        return BlendSource("upload", key, sha, name)

    def close(self) -> None:  # noqa: B027 (a folder holds nothing to release)
        """Release connections (S3); a folder holds none."""
