"""Checking a received upload, storing its bytes once by sha256; projects' upload records."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from farm import keys
from farm.blendfile import check_blend, expanded_size
from farm.errors import BadBlendFile, NotFound
from farm.models import BlendSource
from farm.redisclient import Redis, guard
from farm.storage.base import Storage
from farm.storage.local import LocalStorage
from farm.uploadrecords import bytes_locked
from web.archive import is_zip, unpack

log = logging.getLogger("tessera.web.uploads")

#: the storage name of an uploaded plain .blend (the user's file name lives in the record)
BLEND_NAME = "upload.blend"


def safe_file_name(raw: str) -> str:
    """A file name for display and scratch files: the last path part, tame characters only."""
    base = re.split(r"[\\/]", raw or "")[-1]
    clean = re.sub(r"[^A-Za-z0-9._ -]", "_", base).strip(" .")
    return clean[:200] or "upload.blend"


@dataclass(frozen=True)
class Stored:
    """What storage holds for one upload's bytes, whichever project sent them."""

    sha256: str
    size: int
    kind: str  # blend | zip
    location: str  # storage key of the .blend
    blend: str  # the .blend's path inside the zip, or the uploaded name
    files: list[str]


def scratch_dir(work_dir: Path) -> Path:
    path = work_dir / "web-uploads" / uuid.uuid4().hex
    path.mkdir(parents=True)
    return path


@dataclass(frozen=True)
class Received:
    """A file the web has received whole, before it is checked: what its sender called it."""

    path: Path  # the scratch file (consumed by ``receive``)
    sha256: str
    size: int
    name: str


def receive(
    conn: Redis, storage: Storage, upload: Received, unpack_limit: int, project: str, user: str
) -> dict[str, Any]:
    """Take the received ``upload`` into ``project``: its bytes stored, or the same bytes
    stored before reused, and the project's record of them, which is returned. The bytes'
    lock is held throughout: a deletion of the same bytes by another project
    (farm.uploadrecords.delete) either ends before (they are stored afresh) or starts after,
    and then finds this record and keeps them."""
    with bytes_locked(conn, upload.sha256, "the same file is being stored or deleted; try again"):
        stored = store(
            conn, storage, upload.path, upload.sha256, upload.size, upload.name, unpack_limit
        )
        return record(conn, project, stored, upload.name, user)


def store(
    conn: Redis,
    storage: Storage,
    received: Path,
    sha256: str,
    size: int,
    name: str,
    unpack_limit: int,
) -> Stored:
    """Check ``received`` (a .blend, compressed or not, or a zip) and put it in storage.

    The same bytes sent before are not stored again. Raises an InputError saying what is
    wrong; nothing is left in storage then. ``received`` is consumed (moved or removed).
    """
    known = guard(conn.get, keys.stored_upload(sha256))
    if known is not None:
        stored = Stored(**json.loads(known))
        if storage.exists(stored.location):
            received.unlink(missing_ok=True)
            return stored
    with received.open("rb") as fh:
        head = fh.read(16)
    base = f"uploads/{sha256}"
    if is_zip(head):
        stored = _store_zip(storage, received, sha256, size, base, unpack_limit)
    else:
        if not head.startswith(b"BLENDER") and not _compressed(head):
            # check_blend names what the file looks like (an image, text ...)
            check_blend(received)
            raise BadBlendFile(f"{name} is not a .blend file", reason="not_blend")
        expanded_size(received, unpack_limit)
        check_blend(received)
        location = f"{base}/{BLEND_NAME}"
        move_in(storage, location, received)
        stored = Stored(sha256, size, "blend", location, name, [name])
    guard(conn.set, keys.stored_upload(sha256), json.dumps(asdict(stored)))
    log.info("event=upload_stored sha256=%s kind=%s bytes=%d", sha256, stored.kind, size)
    return stored


def move_in(storage: Storage, key: str, src: Path) -> None:
    """Put a scratch file in storage: a rename for a local folder, an upload otherwise."""
    if isinstance(storage, LocalStorage):
        storage.move_in(key, src)
        return
    storage.put(key, src)
    src.unlink(missing_ok=True)


def _compressed(head: bytes) -> bool:
    return head.startswith(b"\x1f\x8b") or head.startswith(b"\x28\xb5\x2f\xfd")


def _store_zip(
    storage: Storage, received: Path, sha256: str, size: int, base: str, limit: int
) -> Stored:
    dest = received.parent / "unpacked"
    try:
        unpacked = unpack(received, dest, limit)
        blend = dest / unpacked.blend
        expanded_size(blend, limit - unpacked.total_bytes + blend.stat().st_size)
        check_blend(blend)
        # the .blend goes last: a Stored record is only written, and the upload only usable,
        # once every file is in place
        for rel in [*(f for f in unpacked.files if f != unpacked.blend), unpacked.blend]:
            move_in(storage, f"{base}/files/{rel}", dest / rel)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        received.unlink(missing_ok=True)
    return Stored(
        sha256, size, "zip", f"{base}/files/{unpacked.blend}", unpacked.blend, unpacked.files
    )


# --- the projects' records --------------------------------------------------------------------


def record(conn: Redis, project: str, stored: Stored, name: str, user: str) -> dict[str, Any]:
    """The project's record of the upload (created on its first upload there)."""
    now = time.time()
    rec = {
        "upload_id": stored.sha256,
        "project": project,
        "name": name,
        "size": stored.size,
        "kind": stored.kind,
        "blend": stored.blend,
        "files": stored.files,
        "created": now,
        "user": user,
        "location": stored.location,
    }
    pipe = conn.pipeline()
    pipe.set(keys.upload(project, stored.sha256), json.dumps(rec), nx=True)
    pipe.zadd(keys.project_uploads(project), {stored.sha256: now}, nx=True)
    pipe.sadd(keys.UPLOAD_PROJECTS, project)
    pipe.get(keys.upload(project, stored.sha256))
    created, _added, _indexed, text = guard(pipe.execute)
    if created:
        # the project's stored bytes count each of its uploads once (the limit reads them)
        guard(conn.incrby, keys.project_stored_bytes(project), stored.size)
    out: dict[str, Any] = json.loads(text)
    return out


def find(conn: Redis, projects: list[str], upload_id: str) -> dict[str, Any]:
    """The record of ``upload_id`` in the first of ``projects`` that has it; NotFound else."""
    if re.fullmatch(r"[0-9a-f]{64}", upload_id):
        pipe = conn.pipeline()
        for p in projects:
            pipe.get(keys.upload(p, upload_id))
        for text in guard(pipe.execute) if projects else []:
            if text is not None:
                rec: dict[str, Any] = json.loads(text)
                return rec
    raise NotFound(f"no upload {upload_id!r} in your projects", upload_id=upload_id)


def listing(conn: Redis, project: str, limit: int = 500) -> list[dict[str, Any]]:
    ids = guard(conn.zrevrange, keys.project_uploads(project), 0, limit - 1)
    pipe = conn.pipeline()
    for sha in ids:
        pipe.get(keys.upload(project, sha))
    texts = guard(pipe.execute) if ids else []
    return [json.loads(t) for t in texts if t is not None]


def source_of(rec: dict[str, Any]) -> BlendSource:
    return BlendSource("upload", rec["location"], rec["upload_id"], rec["name"])


def public(rec: dict[str, Any]) -> dict[str, Any]:
    """The record as the API shows it (storage keys stay inside)."""
    return {k: v for k, v in rec.items() if k != "location"}
