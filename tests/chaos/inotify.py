"""Counts, through Linux inotify (libc by ctypes), how many times each file of watched folders
was written: a close after writing (IN_CLOSE_WRITE) or a rename onto its name (IN_MOVED_TO)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import struct
import threading
from collections import Counter
from pathlib import Path

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_NONBLOCK = 0o4000
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len


class WriteCounter:
    """``with WriteCounter() as w: w.watch(folder); ...; w.counts[(folder, name)]``."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self._folders: dict[int, Path] = {}
        self.counts: Counter[tuple[Path, str]] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_loop, name="inotify", daemon=True)

    def watch(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        wd = self._libc.inotify_add_watch(
            self._fd, os.fsencode(folder), IN_CLOSE_WRITE | IN_MOVED_TO
        )
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder} failed")
        with self._lock:
            self._folders[wd] = folder

    def written(self, folder: Path) -> dict[str, int]:
        """Writes per file name of one folder, hidden (temporary) names left out."""
        self.drain()
        with self._lock:
            return {
                name: n
                for (f, name), n in self.counts.items()
                if f == folder and not name.startswith(".")
            }

    def drain(self) -> None:
        """Read every event queued so far."""
        while self._read_once(0):
            pass

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            self._read_once(0.2)

    def _read_once(self, timeout_s: float) -> bool:
        with self._lock:
            ready, _, _ = select.select([self._fd], [], [], timeout_s)
            if not ready:
                return False
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return False
            at = 0
            while at < len(data):
                wd, _mask, _cookie, size = _HEADER.unpack_from(data, at)
                raw = data[at + _HEADER.size : at + _HEADER.size + size]
                name = raw.split(b"\0", 1)[0].decode(errors="replace")
                if wd in self._folders and name:
                    self.counts[(self._folders[wd], name)] += 1
                at += _HEADER.size + size
            return True

    def __enter__(self) -> WriteCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)
