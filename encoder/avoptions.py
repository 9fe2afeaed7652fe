"""Options of an opened FFmpeg encoder that PyAV sets only before opening.

FFmpeg's H.264 encoders take a new rate buffer (``bufsize``) and peak rate (``maxrate``) at
the next frame after they change on the open codec context (libx264's and NVENC's
``reconfig_encoder``), but PyAV exposes neither after ``open()``: its ``options`` are read once.
So the context's own ``AVCodecContext`` is found under the PyAV object (the pointer whose
``av_class`` is libavcodec's) and the option is set with FFmpeg's ``av_opt_set_int`` from the
very libavutil PyAV loaded. Where that cannot be done (another PyAV layout, a static build),
``OpenOptions.of`` answers None and the encoder keeps the options it was opened with.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

from av.codec.context import CodecContext

log = logging.getLogger("tessera.stream")

#: how far into the PyAV object the pointer is looked for (PyAV 18 keeps it at byte 24)
_SCAN_BYTES = 256


def _loaded(prefix: str, maps: list[str]) -> ctypes.CDLL | None:
    """The shared library this process already mapped (``maps``: /proc/self/maps) whose file
    name starts with ``prefix`` (PyAV's own copy: a wheel's av.libs/ or the system's)."""
    for line in maps:
        path = line.split(maxsplit=5)[-1]
        if Path(path).name.startswith((prefix + ".so", prefix + "-")):
            return ctypes.CDLL(path)
    return None


def _readable() -> list[tuple[int, int]]:
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms.startswith("r"):
            low, high = span.split("-")
            spans.append((int(low, 16), int(high, 16)))
    return spans


class _Ffmpeg:
    """libavcodec's AVClass for codec contexts and libavutil's av_opt_set_int, once."""

    def __init__(self, avcodec: ctypes.CDLL, avutil: ctypes.CDLL) -> None:
        avcodec.avcodec_get_class.restype = ctypes.c_void_p
        self.context_class: int = avcodec.avcodec_get_class()
        self.set_int = avutil.av_opt_set_int
        self.set_int.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int]
        self.set_int.restype = ctypes.c_int
        #: where the pointer sits in PyAV's object, once found
        self.offset: int | None = None

    def pointer(self, ctx: CodecContext) -> int | None:
        base = id(ctx)
        if self.offset is not None:
            return self._context_at(base + self.offset, None)
        spans = _readable()
        word = ctypes.sizeof(ctypes.c_void_p)
        for offset in range(word, _SCAN_BYTES, word):
            found = self._context_at(base + offset, spans)
            if found is not None:
                self.offset = offset
                return found
        return None

    def _context_at(self, address: int, spans: list[tuple[int, int]] | None) -> int | None:
        candidate = ctypes.c_void_p.from_address(address).value
        if not candidate:
            return None
        # a word of the object that is not a pointer must not be read through
        if spans is not None and not any(low <= candidate < high - 8 for low, high in spans):
            return None
        if ctypes.c_void_p.from_address(candidate).value != self.context_class:
            return None
        return candidate


@functools.cache
def _library() -> _Ffmpeg | None:
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    avcodec, avutil = _loaded("libavcodec", maps), _loaded("libavutil", maps)
    return _Ffmpeg(avcodec, avutil) if avcodec is not None and avutil is not None else None


class OpenOptions:
    """Integer options of one open codec context (``bufsize``, ``maxrate``: bits, bits/s)."""

    def __init__(self, ffmpeg: _Ffmpeg, pointer: int, ctx: CodecContext) -> None:
        self._ffmpeg = ffmpeg
        self._pointer = pointer
        self._ctx = ctx  # keeps the context (and so the pointer) alive

    @classmethod
    def of(cls, ctx: CodecContext) -> OpenOptions | None:
        ffmpeg = _library()
        pointer = ffmpeg.pointer(ctx) if ffmpeg is not None else None
        if ffmpeg is None or pointer is None:
            reason = "no libavcodec" if ffmpeg is None else "layout"
            log.warning("event=encoder_options_fixed reason=%s", reason)
            return None
        return cls(ffmpeg, pointer, ctx)

    def set(self, name: str, value: int) -> None:
        status = self._ffmpeg.set_int(self._pointer, name.encode(), value, 0)
        if status < 0:
            raise ValueError(f"FFmpeg refused {name}={value} ({status})")
