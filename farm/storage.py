"""The object store behind one interface: a local folder (embedded default) or S3, chosen by URL.

Keys are relative paths (``uploads/<sha256>/scene.blend``, ``jobs/<id>/tiles/...``). Every write
is whole or absent: readers see the old object or the whole new one, never a part.
"""

from __future__ import annotations

import errno
import hashlib
import mimetypes
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from farm.errors import (
    AlreadyCommitted,
    BadParameter,
    StorageCorrupt,
    StorageError,
    StorageNotFound,
)
from farm.models import BlendSource

if TYPE_CHECKING:
    from farm.settings import Settings

CHUNK = 1 << 20
#: an upload that is a set of files (a zip's .blend and its textures) keeps them under here
ZIP_FILES = "/files/"


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


def place_file(src: Path, dest: Path, *, move: bool = False) -> None:
    """Put ``src`` at ``dest`` atomically: readers see the old file, or the whole new one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if move:
        try:
            os.replace(src, dest)
            return
        except OSError:
            pass  # another filesystem: copy below, then remove the source
    tmp = _copy_beside(src, dest)
    try:
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(f"cannot write {dest}: {exc.strerror or exc}", path=str(dest)) from exc
    if move:
        src.unlink(missing_ok=True)


def _copy_beside(src: Path, dest: Path) -> Path:
    """A copy of ``src`` in ``dest``'s folder under a hidden temporary name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, FILE_MODE)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"cannot write {dest}: {exc.strerror or exc}", path=str(dest)) from exc
    return Path(tmp)


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
        """Put ``src`` under ``key``; the scratch file ``src`` is gone afterwards."""
        try:
            return self.put(key, src)
        finally:
            src.unlink(missing_ok=True)

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

    def put_upload(self, src: Path, name: str | None = None) -> BlendSource:
        """Store a .blend under its content hash; the same bytes twice are stored once."""
        name = name or src.name
        sha = sha256_file(src)
        key = f"uploads/{sha}/{name}"
        existing = self.stat(key)
        if existing is None or existing.size != src.stat().st_size:
            self.put(key, src)
        return BlendSource("upload", key, sha, name)

    def close(self) -> None:  # noqa: B027 (a folder holds nothing to release)
        """Release connections (S3); a folder holds none."""


class LocalStorage(Storage):
    """A folder every process of the farm can read: the embedded default, or a shared mount."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = root.resolve().as_uri()

    def path(self, key: str) -> Path:
        if key.startswith("/") or ".." in Path(key).parts:
            raise StorageError(f"storage key {key!r} leaves the storage folder", key=key)
        return self.root / key

    def put(
        self,
        key: str,
        src: Path,
        *,
        once: bool = False,
        deliverable: bool = False,
        owner: str = "",
    ) -> StoredObject:
        dest = self.path(check_key(key))
        size = src.stat().st_size
        if not once:
            place_file(src, dest)
        else:
            self._put_once(key, src, dest)
        stored = dest.stat().st_size
        if stored != size:
            raise StorageCorrupt(
                f"{dest} holds {stored} bytes after writing {size}", key=key, size=size
            )
        return StoredObject(key, size)

    def move_in(self, key: str, src: Path) -> StoredObject:
        """Put ``src`` under ``key`` by renaming it where it can (the scratch file goes)."""
        size = src.stat().st_size
        place_file(src, self.path(check_key(key)), move=True)
        return StoredObject(key, size)

    def _put_once(self, key: str, src: Path, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _copy_beside(src, dest)
        try:
            try:
                os.link(tmp, dest)  # fails when dest exists: the first writer wins
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):
                    raise StorageError(f"cannot write {dest}: {exc.strerror}", key=key) from exc
                # a filesystem without hard links: exclusive create, then the bytes in place
                with dest.open("xb"):
                    pass
                os.replace(tmp, dest)
        except FileExistsError:
            if sha256_file(dest) != sha256_file(src):
                raise AlreadyCommitted(
                    f"{dest} was already committed with other bytes; it is kept", key=key
                ) from None
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str, dest: Path) -> Path:
        src = self.path(key)
        if not src.is_file():
            raise StorageNotFound(f"{src} does not exist", key=key)
        place_file(src, dest)
        return dest

    def fetch(self, key: str, scratch: Path) -> Path:
        path = self.path(key)
        if not path.is_file():
            raise StorageNotFound(f"{path} does not exist", key=key)
        return path

    def stat(self, key: str) -> StoredObject | None:
        try:
            st = self.path(key).stat()
        except FileNotFoundError:
            return None
        return StoredObject(key, st.st_size) if os.path.isfile(self.path(key)) else None

    def list(self, prefix: str) -> list[StoredObject]:
        base = self.path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        # a prefix names a folder, or a partial name inside one ("frames/frame_00"); the
        # root itself never widens to its parent (a job's output folder before its first frame)
        folder = base if base.is_dir() or base == self.root else base.parent
        if not folder.is_dir():
            return []
        out = []
        for path in folder.rglob("*"):
            key = path.relative_to(self.root).as_posix()
            if path.is_file() and key.startswith(prefix) and not path.name.startswith("."):
                out.append(StoredObject(key, path.stat().st_size))
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        folder = self.path(prefix.rstrip("/"))
        if not folder.is_dir():
            return 0
        count = sum(1 for p in folder.rglob("*") if p.is_file())
        shutil.rmtree(folder, ignore_errors=True)
        return count

    def remove_tree(self, key: str) -> None:
        self.delete_prefix(key)

    def url_for(self, key: str) -> str:
        return self.path(key).resolve().as_uri()

    def presign(self, key: str, expires_s: int) -> str:
        # a folder has no signed URLs: the file's address is its download link
        return self.url_for(key)


def parse_url(url: str) -> tuple[str, str, str]:
    """``(scheme, where, prefix)`` of a storage URL: ``("s3", bucket, prefix)`` or
    ``("file", folder, "")``; a plain path is a folder. Refuses anything else."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise BadParameter(f"storage URL {url!r} names no bucket: s3://BUCKET/PREFIX")
        return "s3", parts.netloc, parts.path.strip("/")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise BadParameter(f"storage URL {url!r}: file:// URLs name a local path")
        return "file", parts.path, ""
    if parts.scheme == "":
        return "file", url, ""
    raise BadParameter(f"storage URL {url!r} is not file:///PATH or s3://BUCKET/PREFIX", url=url)


def open_storage(url: str, settings: Settings) -> Storage:
    """The store at ``url``: ``file:///path``, a plain path, or ``s3://bucket[/prefix]``."""
    scheme, where, prefix = parse_url(url)
    if scheme == "s3":
        from farm.s3storage import S3Storage

        return S3Storage(where, prefix, settings)
    return LocalStorage(Path(where))


def farm_storage(settings: Settings) -> Storage:
    """The farm's own store (uploads, tiles): FARM_STORAGE_URL, else the FARM_STORAGE_DIR folder."""
    return open_storage(settings.storage_url or str(settings.storage_dir), settings)


def is_url(output: str) -> bool:
    """Whether an output names a store by URL (``s3://``, ``file://``) rather than a folder."""
    return "://" in output


def cached_upload(storage: Storage, source: BlendSource, cache_dir: Path) -> Path:
    """A local file with an uploaded .blend: the stored file where the store is a folder, else
    a copy in ``cache_dir`` by sha256 (downloaded once per host, checked against its hash)."""
    if isinstance(storage, LocalStorage):
        return storage.fetch(source.location, cache_dir)
    if ZIP_FILES in source.location:
        return _cached_file_set(storage, source, cache_dir)
    path = cache_dir / source.sha256 / Path(source.name).name
    if path.is_file():
        return path
    storage.get(source.location, path)
    if sha256_file(path) != source.sha256:
        path.unlink(missing_ok=True)
        raise StorageCorrupt(
            f"{storage.url_for(source.location)} does not hash to {source.sha256}",
            key=source.location,
        )
    return path


def _cached_file_set(storage: Storage, source: BlendSource, cache_dir: Path) -> Path:
    """A zip upload's .blend with every file beside it (textures, libraries): relative paths
    like ``//textures/wood.png`` resolve. Each file is checked against its stored sha256; the
    set appears in the cache whole (renamed into place) or not at all."""
    prefix = source.location[: source.location.index(ZIP_FILES) + len(ZIP_FILES)]
    blend_rel = source.location[len(prefix) :]
    folder = cache_dir / source.sha256 / "files"
    if not (folder / blend_rel).is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".files-", dir=folder.parent))
        try:
            for obj in storage.list(prefix):
                storage.get(obj.key, partial / check_key(obj.key[len(prefix) :]))
            try:
                os.rename(partial, folder)
            except OSError:
                if not (folder / blend_rel).is_file():  # not another worker's complete copy
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    path = folder / blend_rel
    if not path.is_file():
        raise StorageNotFound(
            f"{storage.url_for(source.location)} does not exist", key=source.location
        )
    return path


def tile_key(job_id: str, frame: int, index: int, attempt: int) -> str:
    # per attempt: a late upload from a holder that lost its lease never overwrites the
    # output of the attempt that was committed
    return f"jobs/{job_id}/tiles/{frame}/{index}-a{attempt}.exr"


def tile_log_key(job_id: str, frame: int, index: int, attempt: int) -> str:
    """A failed attempt's full story (error fields, Blender's log tail): the job's project's."""
    return f"jobs/{job_id}/logs/{frame}/{index}-a{attempt}.log"


def frame_tiles_key(job_id: str, frame: int) -> str:
    return f"jobs/{job_id}/tiles/{frame}"


def frame_file_name(frame: int, ext: str) -> str:
    return f"frame_{frame:04d}{ext}"
