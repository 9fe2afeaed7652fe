"""A session's home folder as the stream service sees it: files listed, read and written by
the session's controlling viewer, size-limited, never through a link the app left there.

The folder belongs to the sandbox's uid and the app may put anything in it (links to host
files included), so every file is opened without following links and must be a regular file;
an upload is written beside its name and renamed over it (a rename replaces a link, never
what it points to), then given to the sandbox's uid.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from farm.errors import BadParameter, NotFound, TooLarge

#: the longest file name a folder takes, in bytes (NAME_MAX)
MAX_NAME_BYTES = 255


def check_name(name: str) -> str:
    """``name`` as one plain file name (no folders, no ``..``, no control characters)."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or any(ord(ch) < 32 for ch in name)
        or len(name.encode()) > MAX_NAME_BYTES
    ):
        raise BadParameter(f"{name!r} is not a file name (one name, no folders)")
    return name


class Home:
    """The files at the top of a session's home folder."""

    def __init__(self, path: Path, uid: int, gid: int, max_bytes: int) -> None:
        self.path, self.uid, self.gid, self.max_bytes = path, uid, gid, max_bytes

    def list(self) -> list[dict[str, Any]]:
        """Every regular file (name, size in bytes), by name; links and folders are left out."""
        found = []
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    found.append({"name": entry.name, "size": entry.stat(follow_symlinks=False)
                                  .st_size})  # fmt: skip
        return sorted(found, key=lambda f: str(f["name"]))

    def open(self, name: str) -> tuple[int, int]:
        """A read descriptor of the regular file ``name`` and its size."""
        check_name(name)
        try:
            fd = os.open(
                self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except OSError:
            raise NotFound(f"no file {name!r} in the session's home folder", file=name) from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise NotFound(f"no file {name!r} in the session's home folder", file=name)
        return fd, info.st_size

    async def write(self, name: str, chunks: AsyncIterator[bytes]) -> int:
        """Write ``name`` from ``chunks``; its size. TooLarge past ``max_bytes`` (nothing is
        left behind then)."""
        check_name(name)
        fd, tmp = tempfile.mkstemp(prefix=".upload-", dir=self.path)
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise TooLarge(
                            f"the file is over the session's upload limit of {self.max_bytes} "
                            "bytes (FARM_STREAM_FILE_MAX_MIB)",
                            limit=self.max_bytes,
                        )
                    out.write(chunk)
                # by descriptor: the app may have swapped the name for a link by now
                if os.geteuid() == 0:
                    os.fchown(out.fileno(), self.uid, self.gid)
                os.fchmod(out.fileno(), 0o644)
            os.rename(tmp, self.path / name)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return size
