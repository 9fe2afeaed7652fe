"""The CLI's render progress display: a bar redrawn in place on a terminal, plain lines in logs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TextIO

from farm.terminal import safe

#: a pipe or CI log gets a line at most this often, unless a frame completes
PLAIN_INTERVAL_S = 5.0
#: the bar is left out when fewer columns than this are left for it
MIN_BAR_COLUMNS = 10
DEFAULT_COLUMNS = 80
CLEAR_TO_EOL = "\x1b[K"


def format_duration(seconds: float) -> str:
    """``0:41``, ``12:05``, ``1:02:03``: whole seconds, never negative."""
    total_s = max(0, round(seconds))
    hours, rest_s = divmod(total_s, 3600)
    minutes, secs = divmod(rest_s, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


def eta_text(tiles_done: int, tiles_total: int, elapsed_s: float) -> str:
    """Time left at the rate so far; ``--:--`` until the first tile is done."""
    if tiles_total > 0 and tiles_done >= tiles_total:
        return "0:00"
    if tiles_done <= 0 or elapsed_s <= 0:
        return "--:--"
    return format_duration(elapsed_s * (tiles_total - tiles_done) / tiles_done)


def status_text(
    tiles_done: int,
    tiles_total: int,
    frames_done: int,
    frames_total: int,
    elapsed_s: float,
    failed_tiles: int = 0,
) -> str:
    """``tiles 12/36  frames 2/9  ETA 0:41`` (with ``  failed 1`` when tiles failed)."""
    text = (
        f"tiles {tiles_done}/{tiles_total}  frames {frames_done}/{frames_total}  "
        f"ETA {eta_text(tiles_done, tiles_total, elapsed_s)}"
    )
    return f"{text}  failed {failed_tiles}" if failed_tiles else text


def format_progress(
    tiles_done: int,
    tiles_total: int,
    frames_done: int,
    frames_total: int,
    elapsed_s: float,
    failed_tiles: int = 0,
    width: int = 80,
) -> str:
    """A bar and the status text, at most ``width`` columns (a wrapped line breaks ``\\r``)."""
    text = status_text(tiles_done, tiles_total, frames_done, frames_total, elapsed_s, failed_tiles)
    bar_columns = width - len(text) - 3  # brackets and one space
    if bar_columns < MIN_BAR_COLUMNS:
        return text[: max(width, 0)]
    fraction = min(max(tiles_done / tiles_total, 0.0), 1.0) if tiles_total > 0 else 0.0
    filled = int(fraction * bar_columns)
    return f"[{'#' * filled}{'.' * (bar_columns - filled)}] {text}"


class ProgressBar:
    """Shows a job's progress on ``stream``: redrawn in place on a TTY, sparse lines otherwise."""

    def __init__(
        self,
        stream: TextIO,
        tiles_total: int,
        frames_total: int,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        width: int | None = None,
    ) -> None:
        self._stream = stream
        self._tiles_total = tiles_total
        self._frames_total = frames_total
        self._tty = _is_tty(stream) if tty is None else tty
        self._clock = clock
        self._width = width
        self._started_s = clock()
        self._tiles_done = 0
        self._frames_done = 0
        self._failed_tiles = 0
        self._drawn = False
        self._closed = False
        self._last_plain_s: float | None = None
        self._last_plain_frames = 0

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started_s

    def update(self, tiles_done: int, frames_done: int, failed_tiles: int = 0) -> None:
        if self._closed:
            return
        self._tiles_done, self._frames_done = tiles_done, frames_done
        self._failed_tiles = failed_tiles
        if self._tty:
            self._redraw()
            return
        now_s = self._clock()
        frame_completed = frames_done > self._last_plain_frames
        due = self._last_plain_s is None or now_s - self._last_plain_s >= PLAIN_INTERVAL_S
        if frame_completed or due:
            self._last_plain_s = now_s
            self._last_plain_frames = frames_done
            self._write(self._status() + "\n")

    def note(self, line: str) -> None:
        """Print a message line; on a TTY the bar is cleared first and drawn again below it."""
        line = safe(line)  # messages carry users' names: no escape sequence gets through
        if self._tty and self._drawn:
            self._write(f"\r{CLEAR_TO_EOL}{line}\n")
            if not self._closed:
                self._redraw()
        else:
            self._write(line + "\n")

    def close(self, final: str) -> None:
        """Replace the bar with ``final``; later updates are ignored."""
        if self._closed:
            return
        self._closed = True
        prefix = f"\r{CLEAR_TO_EOL}" if self._tty and self._drawn else ""
        self._drawn = False
        self._write(f"{prefix}{safe(final)}\n")

    def _status(self) -> str:
        return status_text(
            self._tiles_done,
            self._tiles_total,
            self._frames_done,
            self._frames_total,
            self.elapsed_s,
            self._failed_tiles,
        )

    def _redraw(self) -> None:
        # One column short of the terminal: writing the last column wraps on some terminals.
        width = (self._width or _columns(self._stream)) - 1
        line = format_progress(
            self._tiles_done,
            self._tiles_total,
            self._frames_done,
            self._frames_total,
            self.elapsed_s,
            self._failed_tiles,
            width,
        )
        self._drawn = True
        self._write(f"\r{line}{CLEAR_TO_EOL}")

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or DEFAULT_COLUMNS
    except (AttributeError, ValueError, OSError):
        return DEFAULT_COLUMNS
