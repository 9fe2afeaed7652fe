"""A request body landing in a scratch file: constant memory, hashed on the way, size-limited."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

from aiohttp import web

from farm.errors import TooLarge
from web.appkeys import EXECUTOR, blocking

#: bytes gathered before one write (with its hashing) goes to a thread; two buffers at most
#: are alive per upload, so an upload costs about 2 x FLUSH_BYTES of memory
FLUSH_BYTES = 4 << 20
#: bytes read from the socket at a time
READ_BYTES = 1 << 20


def too_large(limit: int) -> TooLarge:
    return TooLarge(
        f"the upload is over the limit of {limit} bytes (FARM_UPLOAD_MAX_BYTES); "
        "split the scene or ask an admin to raise the limit",
        limit=limit,
    )


class Incoming:
    """Bytes written to ``path`` from ``offset`` on, through a thread, while the next arrive."""

    def __init__(
        self, app: web.Application, path: Path, limit: int, *, offset: int = 0, hashing: bool = True
    ) -> None:
        self.app = app
        self.path = path
        self.limit = limit
        self.size = offset
        self.head = b""
        self._sha = hashlib.sha256() if hashing else None
        self._fh: BinaryIO | None = None
        #: chunks received and not yet handed to the writer thread (no copy into one buffer)
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._pending: asyncio.Future[None] | None = None

    @property
    def sha256(self) -> str:
        assert self._sha is not None
        return self._sha.hexdigest()

    async def open(self) -> None:
        self._fh = await blocking(self.app, _open, self.path, self.size)

    async def feed(self, chunk: bytes) -> None:
        if self.size + len(chunk) > self.limit:
            raise too_large(self.limit)
        self.size += len(chunk)
        if len(self.head) < 64:
            self.head += chunk[: 64 - len(self.head)]
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= FLUSH_BYTES:
            await self._flush()

    async def feed_all(self, chunks: AsyncIterator[bytes]) -> None:
        async for chunk in chunks:
            await self.feed(chunk)

    async def _flush(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending
        if self._chunks:
            chunks, self._chunks, self._buffered = self._chunks, [], 0
            loop = asyncio.get_running_loop()
            self._pending = loop.run_in_executor(self.app[EXECUTOR], self._write, chunks)

    def _write(self, chunks: list[bytes]) -> None:
        assert self._fh is not None
        for chunk in chunks:
            if self._sha is not None:
                self._sha.update(chunk)
            view = memoryview(chunk)
            while view:
                written = self._fh.write(view)
                view = view[written or 0 :]

    async def finish(self) -> None:
        """Everything received is on disk (fsync'd) and the file is closed."""
        await self._flush()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending
        fh, self._fh = self._fh, None
        if fh is not None:
            await blocking(self.app, _close, fh, True)

    async def close_quietly(self) -> None:
        """Stop after an error: wait for the write in flight, close, keep the file."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            with contextlib.suppress(OSError):
                await pending
        fh, self._fh = self._fh, None
        if fh is not None:
            await blocking(self.app, _close, fh, False)

    async def discard(self) -> None:
        await self.close_quietly()
        await blocking(self.app, self.path.unlink, missing_ok=True)


def _open(path: Path, offset: int) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    if offset == 0:
        return path.open("wb", buffering=0)
    fh = path.open("r+b", buffering=0)
    fh.seek(offset)
    fh.truncate()
    return fh


def _close(fh: Any, sync: bool) -> None:
    try:
        if sync:
            fh.flush()
            os.fsync(fh.fileno())
    finally:
        fh.close()
