"""Finished frames of a job: the listing, single files, a preview image, and a streamed zip."""

from __future__ import annotations

import asyncio
import io
import re
import tempfile
import zipfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from farm.errors import NotFound
from farm.models import JobSpec
from farm.settings import Settings
from farm.storage.base import Storage, content_type
from farm.storage.factory import is_url, open_storage
from farm.storage.local import LocalStorage
from web.appkeys import SETTINGS, blocking, waiting
from web.jobs import job_for

FRAME_FILE = re.compile(r"frame_(\d+)\.([A-Za-z0-9]+)")
#: files of the whole job delivered next to its frames: the animation's MP4 preview, the manifest
JOB_FILES = ("preview.mp4", "manifest.json")
#: preview formats, best first (a JPEG is the smallest of what the farm writes)
PREVIEW_EXTS = ("jpg", "png")
#: how long a presigned download link lives
LINK_TTL_S = 3600
ZIP_BUFFER_BYTES = 1 << 20


def output_store(spec: JobSpec, settings: Settings) -> Storage:
    """Where the job's frames are delivered: a folder, or a store named by URL (S3)."""
    if is_url(spec.output):
        return open_storage(spec.output, settings)
    return LocalStorage(Path(spec.output))


def frame_files(store: Storage) -> dict[int, dict[str, int]]:
    """frame -> {file name: size} of every delivered file; the job's own files under 0."""
    out: dict[int, dict[str, int]] = {}
    for obj in store.list(""):
        m = FRAME_FILE.fullmatch(obj.key)
        if m:
            out.setdefault(int(m.group(1)), {})[obj.key] = obj.size
        elif obj.key in JOB_FILES:
            out.setdefault(0, {})[obj.key] = obj.size
    return out


@asynccontextmanager
async def _output(
    request: web.Request,
) -> AsyncIterator[tuple[str, Storage, dict[int, dict[str, int]]]]:
    """The job in the URL (if the user may see it), its output store and delivered files."""
    status = await job_for(request)
    store = output_store(status.spec, request.app[SETTINGS])
    try:
        files = await blocking(request.app, frame_files, store)
        yield status.id, store, files
    finally:
        store.close()


async def list_frames(request: web.Request) -> web.Response:
    async with _output(request) as (job_id, _store, files):
        pass
    frames: list[dict[str, Any]] = []
    job_files = [
        {"name": name, "size": size, "url": f"/api/jobs/{job_id}/files/{name}"}
        for name, size in sorted(files.pop(0, {}).items())
    ]
    for frame in sorted(files):
        entries = [
            {"name": name, "size": size, "url": f"/api/jobs/{job_id}/frames/{frame}/{name}"}
            for name, size in sorted(files[frame].items())
        ]
        frames.append(
            {
                "frame": frame,
                "files": entries,
                "thumbnail": f"/api/jobs/{job_id}/frames/{frame}/thumbnail",
            }
        )
    return web.json_response({"job_id": job_id, "frames": frames, "files": job_files})


def _frame_number(request: web.Request) -> int:
    try:
        return int(request.match_info["frame"])
    except ValueError:
        raise NotFound(f"no frame {request.match_info['frame']!r}") from None


async def _serve(request: web.Request, store: Storage, key: str) -> web.StreamResponse:
    if isinstance(store, LocalStorage):
        return web.FileResponse(store.path(key), headers={"Cache-Control": "no-cache"})
    if store.browser_links():
        url = await blocking(request.app, store.presign, key, LINK_TTL_S)
        raise web.HTTPFound(url)
    return await _stream(request, store, key)


async def _stream(request: web.Request, store: Storage, key: str) -> web.StreamResponse:
    """The object's bytes through the web: the store's endpoint is the farm's, not the
    browser's (MinIO at http://minio:9000 with no FARM_S3_PUBLIC_URL)."""
    stored = await blocking(request.app, store.stat, key)
    if stored is None:
        raise NotFound(f"{key} is no longer stored")
    resp = web.StreamResponse(
        headers={"Content-Type": content_type(key), "Cache-Control": "no-cache"}
    )
    resp.content_length = stored.size
    await resp.prepare(request)
    sink = io.BufferedWriter(_ToResponse(asyncio.get_running_loop(), resp), ZIP_BUFFER_BYTES)
    await waiting(request.app, _copy, store, key, sink)
    await resp.write_eof()
    return resp


def _copy(store: Storage, key: str, sink: io.BufferedWriter) -> None:
    store.copy_to(key, sink)
    sink.flush()


async def frame_file(request: web.Request) -> web.StreamResponse:
    frame = _frame_number(request)
    name = request.match_info["file_name"]
    async with _output(request) as (job_id, store, files):
        if frame <= 0 or name not in files.get(frame, {}):
            raise NotFound(f"job {job_id} has no file {name!r} for frame {frame}")
        return await _serve(request, store, name)


async def job_file(request: web.Request) -> web.StreamResponse:
    """A file of the whole job: the MP4 preview of an animation, the manifest."""
    name = request.match_info["file_name"]
    async with _output(request) as (job_id, store, files):
        if name not in files.get(0, {}):
            raise NotFound(f"job {job_id} has no file {name!r} (yet)")
        return await _serve(request, store, name)


class _ToResponse(io.RawIOBase):
    """A file-like sink whose writes (from a worker thread) go out on the response."""

    def __init__(self, loop: asyncio.AbstractEventLoop, resp: web.StreamResponse) -> None:
        self.loop = loop
        self.resp = resp

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        asyncio.run_coroutine_threadsafe(self.resp.write(chunk), self.loop).result()
        return len(chunk)


def _write_zip(sink: io.RawIOBase, store: Storage, names: list[str]) -> None:
    buffered = io.BufferedWriter(sink, ZIP_BUFFER_BYTES)
    with (
        tempfile.TemporaryDirectory(prefix="tessera-zip-") as scratch,
        zipfile.ZipFile(buffered, "w", zipfile.ZIP_STORED, allowZip64=True) as zf,
    ):
        for name in names:
            zf.write(store.fetch(name, Path(scratch) / name), arcname=name)
    buffered.flush()


async def download_zip(request: web.Request) -> web.StreamResponse:
    async with _output(request) as (job_id, store, files):
        # frames first, then the job's own files (preview, manifest)
        names = [n for f in sorted(files, key=lambda f: (f == 0, f)) for n in sorted(files[f])]
        if not names:
            raise NotFound(f"job {job_id} has no finished frames to download yet")
        resp = web.StreamResponse(
            headers={
                "Content-Type": "application/zip",
                "Content-Disposition": f'attachment; filename="{job_id}.zip"',
            }
        )
        await resp.prepare(request)
        sink = _ToResponse(asyncio.get_running_loop(), resp)
        await waiting(request.app, _write_zip, sink, store, names)
    await resp.write_eof()
    return resp
