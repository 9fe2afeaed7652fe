"""Images of a delivered frame for the page: a real thumbnail (scaled, cached on disk) and a
full-size view of its EXR at an exposure the viewer asks for.

The thumbnail is made from the frame's preview (JPEG or PNG: Blender's own colour management),
else from its EXR; it is cached under FARM_WORK_DIR/web-thumbnails, keyed by the job, frame,
file and its size and checksum (a frame is delivered once, so the key changes only when the
file does). The exposure view reads the EXR's linear RGB, scales it by 2^stops and applies the
sRGB transfer curve (Blender's "Standard" view), as an 8-bit PNG.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import OpenEXR
from aiohttp import web
from PIL import Image

from farm.errors import BadParameter, NotFound, RenderError
from farm.storage.base import Storage
from web.appkeys import SETTINGS, blocking
from web.downloads import PREVIEW_EXTS, _frame_number, _output

#: the longest side of a thumbnail, px
THUMB_PX = 256
#: thumbnails kept on disk per web instance; the oldest go beyond it
THUMB_CACHE_FILES = 4096
#: exposure the viewer may ask for, in stops either way
MAX_STOPS = 16.0
#: the largest EXR the web decodes (its float channels are held in memory: 4096 x 4096 RGB
#: float32 is 192 MiB; the web's pods are limited to 1 GiB), px
MAX_VIEW_PIXELS = 4096 * 4096
#: rows tone-mapped at a time, so the float temporaries stay a few MiB
ROWS_PER_PASS = 128
CACHE_HEADERS = {"Cache-Control": "private, max-age=3600"}


def _source(names: dict[str, int], frame: int) -> tuple[str, int] | None:
    """The file a thumbnail is made from: the preview, else the EXR."""
    for ext in (*PREVIEW_EXTS, "exr"):
        for name, size in sorted(names.items()):
            if name.endswith("." + ext):
                return name, size
    return None


def _cache_dir(request: web.Request) -> Path:
    path: Path = request.app[SETTINGS].work_dir / "web-thumbnails"
    return path


async def thumbnail(request: web.Request) -> web.StreamResponse:
    """``GET /api/jobs/{job_id}/frames/{frame}/thumbnail``: a JPEG of at most 256 px a side."""
    frame = _frame_number(request)
    async with _output(request) as (job_id, store, files):
        found = _source(files.get(frame, {}), frame) if frame > 0 else None
        if found is None:
            raise NotFound(
                f"job {job_id} has no image of frame {frame} yet (the thumbnail is made from "
                "its preview or EXR once the frame is done)"
            )
        name, size = found
        stat = await blocking(request.app, store.stat, name)
        tag = hashlib.sha256(
            f"{job_id}|{frame}|{name}|{size}|{stat.sha256 if stat else ''}".encode()
        ).hexdigest()[:32]
        etag = f'"{tag}"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={**CACHE_HEADERS, "ETag": etag})
        data = await blocking(request.app, _cached_thumbnail, _cache_dir(request), tag, store,
                              name)  # fmt: skip
    return web.Response(body=data, content_type="image/jpeg",
                        headers={**CACHE_HEADERS, "ETag": etag})  # fmt: skip


def _cached_thumbnail(folder: Path, tag: str, store: Storage, name: str) -> bytes:
    path = folder / f"{tag}.jpg"
    try:
        data = path.read_bytes()
        os.utime(path)  # the cache drops the least recently used
        return data
    except FileNotFoundError:
        pass
    with tempfile.TemporaryDirectory(prefix="tessera-thumb-") as scratch:
        src = store.fetch(name, Path(scratch) / name)
        image = _exr_image(src, 0.0) if name.endswith(".exr") else Image.open(src)
        data = _jpeg(image)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{tag}.{uuid.uuid4().hex}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, path)
    _prune(folder)
    return data


def _jpeg(image: Image.Image) -> bytes:
    image = image.convert("RGB")
    image.thumbnail((THUMB_PX, THUMB_PX), Image.Resampling.LANCZOS)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=85)
    return out.getvalue()


def _prune(folder: Path) -> None:
    entries = list(os.scandir(folder))
    if len(entries) <= THUMB_CACHE_FILES:
        return
    entries.sort(key=lambda e: e.stat().st_mtime)
    for entry in entries[: len(entries) - THUMB_CACHE_FILES]:
        Path(entry.path).unlink(missing_ok=True)


async def exposure_view(request: web.Request) -> web.StreamResponse:
    """``GET /api/jobs/{job_id}/frames/{frame}/view?exposure=STOPS``: the frame's EXR, full
    size, as a PNG at that exposure (sRGB transfer, Blender's "Standard" view)."""
    frame = _frame_number(request)
    text = request.query.get("exposure", "0")
    try:
        stops = float(text)
    except ValueError:
        stops = math.nan
    if not math.isfinite(stops) or abs(stops) > MAX_STOPS:
        raise BadParameter(f"exposure must be a number of stops from {-MAX_STOPS:g} to "
                           f"{MAX_STOPS:g}, not {text!r}", field="exposure")  # fmt: skip
    async with _output(request) as (job_id, store, files):
        names = sorted(n for n in files.get(frame, {}) if n.endswith(".exr")) if frame > 0 else []
        if not names:
            raise NotFound(f"job {job_id} has no EXR of frame {frame} (the exposure view "
                           "needs the EXR output format)")  # fmt: skip
        data = await blocking(request.app, _view_png, store, names[0], stops)
    return web.Response(body=data, content_type="image/png", headers=CACHE_HEADERS)


def _view_png(store: Storage, name: str, stops: float) -> bytes:
    with tempfile.TemporaryDirectory(prefix="tessera-view-") as scratch:
        image = _exr_image(store.fetch(name, Path(scratch) / name), stops)
    out = io.BytesIO()
    image.save(out, "PNG", compress_level=1)
    return out.getvalue()


def _exr_image(path: Path, stops: float) -> Image.Image:
    """The EXR's first part's RGB, linear, times 2^stops, sRGB-encoded to 8 bits."""
    try:
        with OpenEXR.File(str(path), header_only=True) as exr:
            low, high = exr.header()["dataWindow"]
        pixels = int(high[0] - low[0] + 1) * int(high[1] - low[1] + 1)
        if pixels > MAX_VIEW_PIXELS:
            raise BadParameter(f"{path.name} has {pixels} pixels; the web shows EXRs of at most "
                               f"{MAX_VIEW_PIXELS} (download the file instead)",
                               field="frame")  # fmt: skip
        with OpenEXR.File(str(path), separate_channels=True) as exr:
            channels = exr.channels()
            rgb = []
            for c in "RGB":
                # a multilayer EXR: the Combined pass, not whichever pass comes first
                names = [n for n in channels if n == c or n.endswith("." + c)]
                names.sort(key=lambda n: (n != c, not n.endswith(".Combined." + c), n))
                name = names[0] if names else None
                if name is None:
                    raise RenderError(f"{path.name} has no {c} channel")
                rgb.append(channels[name].pixels)
            out = np.empty((*rgb[0].shape, 3), dtype=np.uint8)
            for top in range(0, out.shape[0], ROWS_PER_PASS):
                rows = slice(top, top + ROWS_PER_PASS)
                out[rows] = _srgb8(np.stack([c[rows] for c in rgb], axis=-1), stops)
    except (BadParameter, RenderError):
        raise
    except Exception as exc:
        raise RenderError(f"cannot read {path.name}: {type(exc).__name__}") from None
    return Image.fromarray(out, "RGB")


def _srgb8(linear: npt.NDArray[Any], stops: float) -> npt.NDArray[np.uint8]:
    """Linear RGB times 2^stops, clipped, through the sRGB transfer curve, as 8-bit values."""
    x = np.nan_to_num(linear.astype(np.float32) * np.float32(2.0**stops), nan=0.0)
    np.clip(x, 0.0, 1.0, out=x)
    srgb = np.where(x <= 0.0031308, x * 12.92, 1.055 * np.power(x, 1 / 2.4) - 0.055)
    out: npt.NDArray[np.uint8] = np.round(srgb * 255).astype(np.uint8)
    return out
