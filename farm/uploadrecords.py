"""A project's upload records: listing them, and deleting one with its stored bytes.

Uploads are stored once by sha256 (``uploads/<sha256>/``), whichever projects sent the same
bytes, and ``farm submit`` stores its .blend files under the same folder. Deleting a project's
record therefore removes the bytes only when nothing else holds them: no other project's record
and no unfinished job of any project. While a job of the project that has not finished renders
the upload, the delete is refused with the jobs' ids.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from farm import keys
from farm.errors import Conflict, NotFound
from farm.models import JobSpec
from farm.redisclient import Redis, guard, locked
from farm.states import JOB_FINAL, JobState
from farm.storage.base import Storage

log = logging.getLogger("tessera.uploads")

#: the most records one listing returns, newest first
LIST_LIMIT = 500


@dataclass(frozen=True)
class DeletedUpload:
    upload_id: str
    project: str
    #: stored objects removed (0 when other projects or jobs still hold the bytes)
    objects: int
    #: why the bytes were kept, or "" when they went
    kept: str


def listing(conn: Redis, project: str, limit: int = LIST_LIMIT) -> list[dict[str, Any]]:
    """The project's upload records, newest first."""
    ids = guard(conn.zrevrange, keys.project_uploads(project), 0, limit - 1)
    pipe = conn.pipeline(transaction=False)
    for sha in ids:
        pipe.get(keys.upload(project, sha))
    texts = guard(pipe.execute) if ids else []
    return [json.loads(t) for t in texts if t is not None]


def _unfinished_users(conn: Any, job_ids: list[str], sha256: str) -> list[str]:
    """Those of ``job_ids`` that have not finished and render the upload ``sha256``."""
    pipe = conn.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hmget(keys.job(job_id), "state", "spec")
    rows = pipe.execute() if job_ids else []
    out = []
    for job_id, (state, spec) in zip(job_ids, rows, strict=True):
        if state is None or spec is None or JobState(state) in JOB_FINAL:
            continue
        if JobSpec.from_json(spec).source.sha256 == sha256:
            out.append(job_id)
    return out


def users(conn: Redis, project: str, sha256: str) -> list[str]:
    """The project's unfinished jobs that render the upload."""
    ids = guard(conn.zrange, keys.project_jobs(project), 0, -1)
    busy: list[str] = guard(_unfinished_users, conn, list(ids), sha256)
    return busy


#: how long an upload's bytes stay locked at most (a dead holder frees them then): taking a
#: zip in (unpacked, checked and stored, up to FARM_UNPACK_MAX_BYTES) or deleting its objects
BYTES_LOCK_S = 600.0
#: how long an intake or a deletion waits for the other to be done with the same bytes
BYTES_WAIT_S = 120.0


@contextlib.contextmanager
def bytes_locked(conn: Redis, sha256: str, busy: str) -> Iterator[None]:
    """Hold the lock of the stored bytes ``sha256``: taken by whatever stores them and makes
    them held (an upload's intake until its record, ``farm submit`` until its job exists) and
    by a deletion from its checks to its removal. QueueError(``busy``) past BYTES_WAIT_S."""
    with locked(conn, keys.upload_bytes_lock(sha256), BYTES_LOCK_S, BYTES_WAIT_S, busy):
        yield


def delete(conn: Redis, storage: Storage, project: str, upload_id: str) -> DeletedUpload:
    """Remove the project's record of ``upload_id``, and its stored bytes when nothing else
    holds them. NotFound without the record; Conflict, changing nothing, while a job of the
    project that has not finished uses it (a job submitted meanwhile retries the check);
    QueueError, changing nothing, when an upload of the same bytes holds them past
    BYTES_WAIT_S."""
    record_key = keys.upload(project, upload_id)
    jobs_key = keys.project_jobs(project)

    def drop(pipe: Any) -> dict[str, Any]:
        text = pipe.get(record_key)
        if text is None:
            raise NotFound(f"no upload {upload_id!r} in project {project}", upload_id=upload_id)
        busy = _unfinished_users(pipe, list(pipe.zrange(jobs_key, 0, -1)), upload_id)
        if busy:
            shown = ", ".join(busy[:5]) + (f" and {len(busy) - 5} more" if len(busy) > 5 else "")
            raise Conflict(
                f"upload {upload_id[:12]} is used by job(s) {shown} that have not finished; "
                "cancel them or wait for them to end, then delete it",
                upload_id=upload_id, jobs=busy,
            )  # fmt: skip
        rec: dict[str, Any] = json.loads(text)
        pipe.multi()
        pipe.delete(record_key)
        pipe.zrem(keys.project_uploads(project), upload_id)
        pipe.decrby(keys.project_stored_bytes(project), int(rec.get("size", 0)))
        return rec

    objects = 0
    # another project may be taking the same bytes in (web.intake.receive, `farm submit`)
    # right now: the whole deletion holds the bytes' lock, so a record or a job made beside it
    # names bytes that stay
    with bytes_locked(conn, upload_id, f"the file of upload {upload_id[:12]} is being stored "
                      "by an upload or a submission of the same bytes; nothing was deleted, try "
                      "again"):  # fmt: skip
        guard(conn.transaction, drop, record_key, jobs_key, value_from_callable=True)
        kept = _still_held(conn, upload_id)
        if not kept:
            # the record of the stored bytes first: were this process to die mid-removal, the
            # next upload of the same bytes stores them afresh rather than name half of them
            guard(conn.delete, keys.stored_upload(upload_id), keys.inspection(upload_id))
            objects = storage.delete_prefix(f"uploads/{upload_id}")
    log.info("event=upload_deleted project=%s upload=%s objects=%d kept=%r", project,
             upload_id, objects, kept)  # fmt: skip
    return DeletedUpload(upload_id, project, objects, kept)


def _still_held(conn: Redis, sha256: str) -> str:
    """Why the bytes of ``sha256`` must stay ("" when nothing holds them): another project's
    record, or an unfinished job of any project (``farm submit`` jobs have no record)."""
    # the projects with uploads in this Redis; the projects' own set is read too for records
    # made before that index (it is in the control Redis, not here, in a farm of cells)
    projects = sorted(guard(conn.sunion, keys.UPLOAD_PROJECTS, keys.PROJECTS))
    pipe = conn.pipeline(transaction=False)
    for p in projects:
        pipe.exists(keys.upload(p, sha256))
    if projects and any(guard(pipe.execute)):
        return "another project has the same file"
    if users_anywhere := guard(_unfinished_users, conn, list(guard(conn.zrange, keys.JOBS, 0, -1)),
                               sha256):  # fmt: skip
        return f"unfinished job {users_anywhere[0]} renders the same file"
    return ""
