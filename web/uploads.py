"""Upload routes: multipart, raw PUT, resumable sessions (chunks at offsets), inspection."""

from __future__ import annotations

import json
import logging
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import BodyPartReader, web

from farm import cells, keys, queue, queuewhy, submission, uploadrecords, workerstate
from farm.errors import BadParameter, Conflict, FarmError, NotFound
from farm.models import InspectionReport
from farm.redisclient import guard
from farm.settings import DEVICE_KINDS
from farm.storage.base import sha256_file
from web import intake, jsonio
from web.appkeys import CONN, RQ_CONN, SETTINGS, STORAGE, blocking, checking, user_of, waiting
from web.auth import role_in
from web.incoming import READ_BYTES, Incoming, too_large
from web.limits import INSPECTIONS, UPLOADS, in_flight, limits_of

log = logging.getLogger("tessera.web.uploads")

#: how long an inspection report stays cached (it depends only on the upload's bytes)
INSPECTION_TTL_S = 7 * 24 * 3600
#: the longest one upload request may hold one of its project's upload slots (a web process
#: that dies holding one frees it then)
UPLOAD_HOLD_S = 6 * 3600.0
#: an inspection holds its project's slot this much longer than it may wait for its worker
INSPECTION_HOLD_EXTRA_S = 30.0


def _project_param(request: web.Request) -> str:
    project = request.query.get("project", "")
    if not project:
        raise BadParameter("say which project the upload belongs to: ?project=<id>")
    return project


def _check_length(request: web.Request, limit: int) -> None:
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)


async def _check_room(request: web.Request, project: str, size: int | None) -> None:
    """429 before a byte is read when the project's stored bytes cannot take ``size`` more."""
    if size:
        await blocking(request.app, limits_of(request).check_stored_bytes, project, size)


async def _receive(
    request: web.Request, project: str, name: str, incoming: Incoming
) -> web.Response:
    """Store what ``incoming`` received and answer with the project's record of it."""
    try:
        await incoming.finish()
    except BaseException:
        await blocking(request.app, shutil.rmtree, incoming.path.parent, ignore_errors=True)
        raise
    return await _receive_file(
        request, project, name, incoming.path, incoming.sha256, incoming.size
    )


async def _raw(request: web.Request, project: str, raw_name: str) -> web.Response:
    settings = request.app[SETTINGS]
    role_in(request, project, "member")
    _check_length(request, settings.upload_max_bytes)
    await _check_room(request, project, request.content_length)
    async with in_flight(request, project, UPLOADS, UPLOAD_HOLD_S):
        return await _raw_body(request, project, raw_name)


async def _raw_body(request: web.Request, project: str, raw_name: str) -> web.Response:
    settings = request.app[SETTINGS]
    name = intake.safe_file_name(raw_name)
    scratch = await blocking(request.app, intake.scratch_dir, settings.work_dir)
    incoming = Incoming(request.app, scratch / name, settings.upload_max_bytes)
    try:
        await incoming.open()
        await incoming.feed_all(request.content.iter_chunked(READ_BYTES))
    except BaseException:
        await incoming.discard()
        await blocking(request.app, shutil.rmtree, scratch, ignore_errors=True)
        raise
    return await _receive(request, project, name, incoming)


async def put_upload(request: web.Request) -> web.Response:
    return await _raw(request, _project_param(request), request.match_info["name"])


async def post_upload(request: web.Request) -> web.Response:
    if not request.content_type.startswith("multipart/"):
        name = request.headers.get("X-Filename", "")
        if not name:
            raise BadParameter(
                'send multipart/form-data with a "file" field, or the raw bytes with an '
                "X-Filename header"
            )
        return await _raw(request, _project_param(request), name)
    settings = request.app[SETTINGS]
    _check_length(request, settings.upload_max_bytes + (1 << 20))
    project = request.query.get("project", "")
    reader = await request.multipart()
    while True:
        part = await reader.next()
        if part is None:
            break
        if not isinstance(part, BodyPartReader):
            raise BadParameter("nested multipart bodies are not accepted")
        if part.name == "project":
            project = (await part.text()).strip()
        elif part.name == "file":
            if not project:
                raise BadParameter(
                    'the project must come before the file: ?project=<id>, or a "project" '
                    'form field placed before "file"'
                )
            role_in(request, project, "member")
            await _check_room(request, project, request.content_length)
            async with in_flight(request, project, UPLOADS, UPLOAD_HOLD_S):
                return await _multipart_file(request, project, part)
        else:
            await part.release()
    raise BadParameter('the form has no "file" field')


async def _multipart_file(request: web.Request, project: str, part: BodyPartReader) -> web.Response:
    settings = request.app[SETTINGS]
    name = intake.safe_file_name(part.filename or "upload.blend")
    scratch = await blocking(request.app, intake.scratch_dir, settings.work_dir)
    incoming = Incoming(request.app, scratch / name, settings.upload_max_bytes)
    try:
        await incoming.open()
        while chunk := await part.read_chunk(READ_BYTES):
            await incoming.feed(chunk)
    except BaseException:
        await incoming.discard()
        await blocking(request.app, shutil.rmtree, scratch, ignore_errors=True)
        raise
    return await _receive(request, project, name, incoming)


# --- resumable sessions ---------------------------------------------------------------------


def _part_path(request: web.Request, session_id: str) -> Path:
    return request.app[SETTINGS].work_dir / "web-uploads" / "sessions" / f"{session_id}.part"


async def _session(request: web.Request, at_least: str = "member") -> tuple[str, dict[str, str]]:
    session_id = request.match_info["session_id"]
    data = await blocking(request.app, guard, request.app[CONN].hgetall,
                          keys.upload_session(session_id))  # fmt: skip
    if not data or user_of(request).role(data["project"]) is None:
        raise NotFound(f"no upload session {session_id!r} (finished, expired or never started)")
    role_in(request, data["project"], at_least)
    return session_id, data


def _session_json(session_id: str, data: dict[str, str]) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "project": data["project"],
        "name": data["name"],
        "size": int(data["size"]),
        "offset": int(data["offset"]),
    }


async def create_session(request: web.Request) -> web.Response:
    body = await jsonio.read_object(
        request, {"project": str, "name": str, "size": int}, required=("project", "name", "size")
    )
    settings = request.app[SETTINGS]
    role_in(request, body["project"], "member")
    size = body["size"]
    if size < 1:
        raise BadParameter("size must be the upload's length in bytes, at least 1")
    if size > settings.upload_max_bytes:
        raise too_large(settings.upload_max_bytes)
    await _check_room(request, body["project"], size)
    # in a farm of cells the id names its cell, so the front door finds the session
    session_id = cells.new_id(request.app[SETTINGS].cell, 32)
    # an open resumable upload holds one of the project's upload slots until it completes,
    # is aborted or expires
    limits = limits_of(request)
    await blocking(request.app, limits.acquire, body["project"], UPLOADS, session_id,
                   settings.upload_session_ttl_s)  # fmt: skip
    data: dict[str, str] = {
        "project": body["project"],
        "user": user_of(request).name,
        "name": intake.safe_file_name(body["name"]),
        "size": str(size),
        "offset": "0",
        "created": str(time.time()),
    }
    key = keys.upload_session(session_id)
    conn = request.app[CONN]

    def create() -> None:
        part = _part_path(request, session_id)
        part.parent.mkdir(parents=True, exist_ok=True)
        _drop_abandoned(conn, part.parent, settings.upload_session_ttl_s)
        part.touch()
        pipe = conn.pipeline()
        pipe.hset(key, mapping={k: v for k, v in data.items()})
        pipe.expire(key, int(settings.upload_session_ttl_s))
        guard(pipe.execute)

    try:
        await blocking(request.app, create)
    except BaseException:
        await blocking(request.app, limits.release, body["project"], UPLOADS, session_id)
        raise
    return web.json_response(_session_json(session_id, data), status=201)


def _drop_abandoned(conn: Any, folder: Path, ttl_s: float) -> None:
    """Remove the part files of sessions that expired (their Redis record is gone)."""
    cutoff = time.time() - ttl_s
    for part in folder.glob("*.part"):
        try:
            idle = part.stat().st_mtime < cutoff
        except FileNotFoundError:
            continue
        if idle and not guard(conn.exists, keys.upload_session(part.stem)):
            part.unlink(missing_ok=True)


async def session_status(request: web.Request) -> web.Response:
    session_id, data = await _session(request, "viewer")
    return web.json_response(_session_json(session_id, data))


async def session_chunk(request: web.Request) -> web.Response:
    """Append a chunk at ``Upload-Offset``; an interrupted chunk keeps what arrived."""
    session_id, data = await _session(request)
    try:
        offset = int(request.headers["Upload-Offset"])
    except (KeyError, ValueError):
        raise BadParameter(
            "send the chunk's position as an Upload-Offset: <bytes> header"
        ) from None
    conn = request.app[CONN]
    key = keys.upload_session(session_id)
    settings = request.app[SETTINGS]
    # one writer at a time: a second PATCH while this one runs gets a 409
    lock = f"{key}:lock"
    if not await blocking(request.app, guard, conn.set, lock, "1", nx=True, ex=3600):
        raise Conflict(
            "another chunk of this upload is being written; wait for it",
            offset=int(data["offset"]),
        )
    try:
        # read under the lock: the offset another chunk left is the one that counts
        have = int(await blocking(request.app, guard, conn.hget, key, "offset") or -1)
        size = int(data["size"])
        if offset != have:
            raise Conflict(
                f"the upload is at byte {have}, not {offset}; send the chunk from there",
                offset=have,
            )
    except BaseException:
        await blocking(request.app, guard, conn.delete, lock)
        raise
    incoming = Incoming(
        request.app, _part_path(request, session_id), size, offset=offset, hashing=False
    )
    try:
        await incoming.open()
        try:
            await incoming.feed_all(request.content.iter_chunked(READ_BYTES))
        except FarmError:
            await incoming.close_quietly()
            raise
        except BaseException as exc:
            # the client went away mid-chunk: keep what arrived, it resumes from there
            log.info("event=chunk_interrupted session=%s bytes=%d error=%r", session_id,
                     incoming.size - offset, exc)  # fmt: skip
            await incoming.finish()
            await _save_offset(request, key, incoming.size, settings.upload_session_ttl_s)
            if not isinstance(exc, ConnectionError):
                raise
        else:
            await incoming.finish()
            await _save_offset(request, key, incoming.size, settings.upload_session_ttl_s)
    finally:
        await blocking(request.app, guard, conn.delete, lock)
    return web.json_response({"session_id": session_id, "offset": incoming.size, "size": size})


async def _save_offset(request: web.Request, key: str, offset: int, ttl_s: float) -> None:
    conn = request.app[CONN]

    def save() -> None:
        pipe = conn.pipeline()
        pipe.hset(key, "offset", offset)
        pipe.expire(key, int(ttl_s))
        guard(pipe.execute)

    await blocking(request.app, save)


async def complete_session(request: web.Request) -> web.Response:
    session_id, data = await _session(request)
    have, size = int(data["offset"]), int(data["size"])
    if have != size:
        raise Conflict(f"the upload has {have} of {size} bytes; send the rest first", offset=have)
    app = request.app
    settings = app[SETTINGS]
    part = _part_path(request, session_id)
    scratch = await blocking(app, intake.scratch_dir, settings.work_dir)
    target = scratch / data["name"]
    await blocking(app, part.replace, target)
    await blocking(app, guard, app[CONN].delete, keys.upload_session(session_id))
    try:
        sha = await checking(app, sha256_file, target)
        return await _receive_file(request, data["project"], data["name"], target, sha, size)
    finally:
        await blocking(app, limits_of(request).release, data["project"], UPLOADS, session_id)


async def _receive_file(
    request: web.Request, project: str, name: str, path: Path, sha: str, size: int
) -> web.Response:
    app = request.app
    user = user_of(request).name
    try:
        # decompression and zip checks: on their own few threads, so a flood of them waits
        # there and never holds the threads other requests are answered on
        rec = await checking(
            app, intake.receive, app[CONN], app[STORAGE], intake.Received(path, sha, size, name),
            app[SETTINGS].unpack_max_bytes, project, user,
        )  # fmt: skip
    finally:
        await blocking(app, shutil.rmtree, path.parent, ignore_errors=True)
    log.info("event=upload project=%s upload=%s name=%r bytes=%d user=%s", project, sha,
             name, rec["size"], user)  # fmt: skip
    return web.json_response(intake.public(rec), status=201)


async def abort_session(request: web.Request) -> web.Response:
    session_id, data = await _session(request)
    await blocking(request.app, guard, request.app[CONN].delete, keys.upload_session(session_id))
    await blocking(request.app, _part_path(request, session_id).unlink, missing_ok=True)
    await blocking(request.app, limits_of(request).release, data["project"], UPLOADS, session_id)
    return web.Response(status=204)


# --- records and inspection -------------------------------------------------------------------


async def list_uploads(request: web.Request) -> web.Response:
    user = user_of(request)
    project = request.query.get("project")
    projects = [project] if project else user.projects_in(request.app[SETTINGS].cell)
    out: list[dict[str, Any]] = []
    for p in projects:
        role_in(request, p)
        out.extend(await blocking(request.app, intake.listing, request.app[CONN], p))
    return web.json_response({"uploads": [intake.public(r) for r in out]})


async def find_upload(request: web.Request, upload_id: str) -> dict[str, Any]:
    user = user_of(request)
    project = request.query.get("project")
    projects = (
        [project] if project and user.role(project)
        else user.projects_in(request.app[SETTINGS].cell)
    )  # fmt: skip
    return await blocking(request.app, intake.find, request.app[CONN], projects, upload_id)


async def get_upload(request: web.Request) -> web.Response:
    rec = await find_upload(request, request.match_info["upload_id"])
    return web.json_response(intake.public(rec))


def inspecting_class(conn: Any, settings: Any, wanted: str | None) -> str:
    """The device class whose workers inspect: ``wanted`` when one of its workers takes work
    (an idle one first), else another class's (the report is the same on every device);
    NoWorker at once, saying why, when no worker is online and enabled (farm.queuewhy)."""
    return queuewhy.inspecting_kind(workerstate.registry_for(conn, settings).list(), wanted)


async def inspection(
    request: web.Request, rec: dict[str, Any], device: str | None, probe: bool = False
) -> InspectionReport:
    """The upload's inspection report: cached, or asked of a worker now (of ``device`` where
    one is online). Refused at once when no worker is online, or when the project has its
    limit of inspections running (429). ``probe``: the report carries the estimate's probe
    (a cached report without one is made again with it)."""
    app = request.app
    conn = app[CONN]
    key = keys.inspection(rec["upload_id"])
    cached = await blocking(app, guard, conn.get, key)
    if cached is not None:
        known = InspectionReport.from_dict(json.loads(cached))
        if not probe or known.probe is not None:
            return known
    source = intake.source_of(rec)
    settings = app[SETTINGS]
    device = await blocking(app, inspecting_class, conn, settings, device)
    render_queue = queue.RenderQueue(app[RQ_CONN], device)
    # with the probe, the worker may take the inspection's time twice (farm.submission.inspect)
    hold_s = settings.inspect_timeout_s * (2 if probe else 1) + INSPECTION_HOLD_EXTRA_S
    async with in_flight(request, rec["project"], INSPECTIONS, hold_s):
        report = await waiting(
            app,
            partial(submission.inspect, project=rec["project"], probe=probe),
            conn,
            render_queue,
            source,
            settings.inspect_timeout_s,
        )
    await blocking(app, guard, conn.set, key, json.dumps(report.to_dict()), ex=INSPECTION_TTL_S)
    return report


def report_json(report: InspectionReport) -> dict[str, Any]:
    data = report.to_dict()
    data.pop("path", None)
    data["missing_files"] = report.missing_as_written()
    data["libraries"] = [report.as_written(p) for p in report.libraries]
    missing = set(data["missing_files"])
    step = f"x{report.frame_step}" if report.frame_step > 1 else ""
    data.update(
        {
            "frames": f"{report.frame_start}-{report.frame_end}{step}",
            "resolution": f"{report.width}x{report.height}",
            "missing_libraries": [lib for lib in data["libraries"] if lib in missing],
            "scripts_wanted": report.wants_scripts,
        }
    )
    return data


async def inspect_upload(request: web.Request) -> web.Response:
    rec = await find_upload(request, request.match_info["upload_id"])
    device = request.query.get("device") or None
    if device is not None and device not in DEVICE_KINDS:
        raise BadParameter(f"device {device!r} is not one of {', '.join(DEVICE_KINDS)}")
    report = await inspection(request, rec, device)
    return web.json_response({"upload_id": rec["upload_id"], **report_json(report)})


async def delete_upload(request: web.Request) -> web.Response:
    """Delete one of the project's uploads (its stored bytes too when nothing else holds
    them); refused while a job of the project that has not finished renders it."""
    project = request.query.get("project")
    if project:
        # strict: another project's upload is not found, whichever of one's own holds it
        role_in(request, project)
    rec = await find_upload(request, request.match_info["upload_id"])
    role_in(request, rec["project"], "member")
    app = request.app
    gone = await blocking(app, uploadrecords.delete, app[CONN], app[STORAGE], rec["project"],
                          rec["upload_id"])  # fmt: skip
    body = {"upload_id": gone.upload_id, "project": gone.project, "deleted": True,
            "objects": gone.objects, "kept": gone.kept}  # fmt: skip
    return web.json_response(body)
