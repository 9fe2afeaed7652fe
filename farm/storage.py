"""Local-folder storage: uploads by sha256, tiles and frames under their job, atomic writes."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from farm.errors import StorageError
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


def place_file(src: Path, dest: Path, *, move: bool = False) -> None:
    """Put ``src`` at ``dest`` atomically: readers see the old file, or the whole new one."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if move:
        try:
            os.replace(src, dest)
            return
        except OSError:
            pass  # another filesystem: copy below, then remove the source
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, dest)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise StorageError(f"cannot write {dest}: {exc.strerror or exc}", path=str(dest)) from exc
    if move:
        src.unlink(missing_ok=True)


class LocalStorage:
    """A folder every process of the farm can read: the embedded default, or a shared mount."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, key: str) -> Path:
        if key.startswith("/") or ".." in Path(key).parts:
            raise StorageError(f"storage key {key!r} leaves the storage folder", key=key)
        return self.root / key

    def put_upload(self, src: Path) -> BlendSource:
        """Store a .blend under its content hash; the same bytes twice are stored once."""
        sha = sha256_file(src)
        key = f"uploads/{sha}/{src.name}"
        dest = self.path(key)
        if not dest.exists():
            place_file(src, dest)
        return BlendSource("upload", key, sha, src.name)

    def put(self, key: str, src: Path, *, move: bool = False) -> None:
        place_file(src, self.path(key), move=move)

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def remove_tree(self, key: str) -> None:
        shutil.rmtree(self.path(key), ignore_errors=True)


def tile_key(job_id: str, frame: int, index: int, attempt: int) -> str:
    # per attempt: a late upload from a holder that lost its lease never overwrites the
    # output of the attempt that was committed
    return f"jobs/{job_id}/tiles/{frame}/{index}-a{attempt}.exr"


def frame_tiles_key(job_id: str, frame: int) -> str:
    return f"jobs/{job_id}/tiles/{frame}"


def frame_file_name(frame: int, ext: str) -> str:
    return f"frame_{frame:04d}{ext}"
