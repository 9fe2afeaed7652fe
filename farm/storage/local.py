"""The local-folder store: every write renamed into place, whole or absent."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from farm.errors import (
    AlreadyCommitted,
    StorageCorrupt,
    StorageError,
    StorageNotFound,
    StorageUnavailable,
)
from farm.storage.base import FILE_MODE, Storage, StoredObject, check_key, sha256_file

#: errors of the disk, not of the file: a full or failing disk, a mount that stopped answering
_TRANSIENT = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ETIMEDOUT, errno.ESTALE})


def write_error(exc: OSError, dest: Path, **fields: object) -> StorageError:
    """An OSError writing ``dest`` as the farm's: StorageUnavailable (retried, never counted
    as an attempt) when the disk rather than the file is at fault."""
    cls = StorageUnavailable if exc.errno in _TRANSIENT else StorageError
    return cls(f"cannot write {dest}: {exc.strerror or exc}", path=str(dest), errno=exc.errno,
               **fields)  # fmt: skip


def place_file(
    src: Path, dest: Path, *, move: bool = False, fence: Callable[[], None] | None = None
) -> None:
    """Put ``src`` at ``dest`` atomically: readers see the old file, or the whole new one.

    ``fence`` runs right before the rename; when it raises, ``dest`` is left as it was and no
    temporary file stays behind (a stale writer writes nothing)."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise write_error(exc, dest) from exc
    if move and fence is None:
        try:
            os.replace(src, dest)
            return
        except OSError:
            pass  # another filesystem: copy below, then remove the source
    tmp = _copy_beside(src, dest)
    try:
        if fence is not None:
            fence()
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(exc, dest) from exc
    except BaseException:  # the fence refused: the temporary file goes, dest is untouched
        tmp.unlink(missing_ok=True)
        raise
    if move:
        src.unlink(missing_ok=True)


def _temp_beside(dest: Path) -> tuple[int, Path]:
    """A new empty file (its open descriptor, its path) in ``dest``'s folder under a hidden
    temporary name: renamed onto ``dest`` once whole."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    except OSError as exc:
        raise write_error(exc, dest) from exc
    return fd, Path(tmp)


def _copy_beside(src: Path, dest: Path) -> Path:
    """A copy of ``src`` in ``dest``'s folder under a hidden temporary name."""
    fd, tmp = _temp_beside(dest)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, FILE_MODE)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(exc, dest) from exc
    return tmp


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
        fence: Callable[[], None] | None = None,
    ) -> StoredObject:
        """``fence`` (not with ``once``) runs right before the rename; see place_file."""
        dest = self.path(check_key(key))
        size = src.stat().st_size
        if not once:
            place_file(src, dest, fence=fence)
        else:
            self._put_once(key, src, dest)
        stored = dest.stat().st_size
        if stored != size:
            raise StorageCorrupt(
                f"{dest} holds {stored} bytes after writing {size}", key=key, size=size
            )
        return StoredObject(key, size)

    def put_bytes(
        self, key: str, data: bytes, *, once: bool = False, deliverable: bool = False
    ) -> StoredObject:
        """``data`` written beside its place and renamed into it: no scratch copy first (a
        tile's log on every tile)."""
        if once:
            return super().put_bytes(key, data, once=True, deliverable=deliverable)
        dest = self.path(check_key(key))
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, dest) from exc
        fd, tmp = _temp_beside(dest)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                stored = os.fstat(out.fileno()).st_size
            if stored != len(data):
                raise StorageCorrupt(
                    f"{dest} holds {stored} bytes after writing {len(data)}", key=key,
                    size=len(data),
                )  # fmt: skip
            os.chmod(tmp, FILE_MODE)
            os.replace(tmp, dest)
        except OSError as exc:
            raise write_error(exc, dest) from exc
        finally:
            tmp.unlink(missing_ok=True)
        return StoredObject(key, len(data))

    def move_in(self, key: str, src: Path) -> StoredObject:
        """Put ``src`` under ``key`` by renaming it where it can (the scratch file goes)."""
        size = src.stat().st_size
        place_file(src, self.path(check_key(key)), move=True)
        return StoredObject(key, size)

    def _put_once(self, key: str, src: Path, dest: Path) -> None:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise write_error(exc, dest, key=key) from exc
        tmp = _copy_beside(src, dest)
        try:
            try:
                os.link(tmp, dest)  # fails when dest exists: the first writer wins
            except FileExistsError:
                raise
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV):
                    raise write_error(exc, dest, key=key) from exc
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
