"""Delivering a job's frames to its output (a folder or an S3 prefix), and the job's manifest.

A frame's files go to ``<output>/frame_NNNN.<ext>``. In an object store each is committed once
(a late duplicate cannot replace it); a local folder is the user's and a re-run replaces its
files. When the last frame is delivered, ``manifest.json`` lists every file with its size,
sha256 and a download URL (presigned for S3), before the job is marked done.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from farm import keys
from farm.errors import OutputExists, QueueError
from farm.models import OUTPUT_FORMATS, JobSpec
from farm.redisclient import Redis, confirm_replicated, guard
from farm.settings import Settings
from farm.storage.base import Storage, StoredObject, sha256_file
from farm.storage.factory import is_url, open_storage, parse_url
from farm.storage.layout import frame_file_name
from farm.storage.local import LocalStorage

log = logging.getLogger("tessera.delivery")

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class DeliveredFile:
    name: str
    size: int
    sha256: str
    url: str


def output_address(output: str | Path) -> str:
    """The job's output as stored in its spec: an absolute folder, or a store URL as given."""
    text = str(output)
    if is_url(text):
        parse_url(text)  # refuses an unknown scheme or a URL without a bucket
        return text.rstrip("/")
    return str(Path(text).resolve())


@lru_cache(maxsize=16)
def open_output(output: str, settings: Settings) -> Storage:
    """The store a job's frames are delivered to (kept open: S3 clients are slow to build)."""
    return open_storage(output, settings)


def commits_once(target: Storage) -> bool:
    return not isinstance(target, LocalStorage)


def frame_names(spec: JobSpec) -> list[str]:
    return [
        frame_file_name(frame, OUTPUT_FORMATS[name][2])
        for frame in spec.frames
        for name in spec.formats
    ]


def check_output(spec: JobSpec, settings: Settings) -> None:
    """Refuse, before anything is queued, an object-store output already holding frames this
    job would write: they are committed once and could not be replaced."""
    target = open_output(spec.output, settings)
    if not commits_once(target):
        return
    wanted = set(frame_names(spec))
    taken = sorted(o.key for o in target.list("frame_") if o.key in wanted)
    if taken:
        more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
        raise OutputExists(
            f"{spec.output} already holds {', '.join(taken[:3])}{more}; objects there are never "
            "replaced: deliver to another prefix or remove them",
            output=spec.output,
            files=taken,
        )


def deliver_frame(
    conn: Redis,
    settings: Settings,
    spec: JobSpec,
    job_id: str,
    frame: int,
    files: list[Path],
    fence: Callable[[], None] | None = None,
) -> list[DeliveredFile]:
    """Put one frame's files into the job's output, record them, and write the manifest when
    this was the last frame to arrive.

    A frame is delivered once: its record is confirmed by a replica (behind Sentinels) before
    the frame is committed, and an assembly repeated after a failover lost the commit finds
    the record and puts nothing. A failover between the put and the record repeats the put of
    the same bytes, which changes nothing: an object store commits once, and a folder
    already holding those bytes is left as it is.

    ``fence`` (the assembly's lease check; raises when it is lost) runs right before each
    file is renamed into a folder or put into a store, and before the manifest is written:
    an assembler paused past its lease writes nothing."""
    check = fence or (lambda: None)
    target = open_output(spec.output, settings)
    recorded = guard(conn.hget, keys.delivered(job_id), str(frame))
    if recorded is not None:
        log.info("event=frame_already_delivered job=%s frame=%d", job_id, frame)
        return [DeliveredFile(**item) for item in json.loads(recorded)]

    def deliver(path: Path) -> DeliveredFile:
        t0 = time.monotonic()
        if isinstance(target, LocalStorage) and _holds(target, path):
            log.info("event=file_already_delivered job=%s frame=%d url=%s", job_id, frame,
                     target.url_for(path.name))  # fmt: skip
            return DeliveredFile(path.name, path.stat().st_size, sha256_file(path),
                                 target.url_for(path.name))  # fmt: skip
        if isinstance(target, LocalStorage):
            stored = target.put(path.name, path, deliverable=True, owner=job_id, fence=check)
        else:
            check()
            stored = target.put(path.name, path, once=True, deliverable=True, owner=job_id)
        log.info("event=file_delivered job=%s frame=%d url=%s bytes=%d took_s=%.3f",
                 job_id, frame, target.url_for(path.name), stored.size,
                 time.monotonic() - t0)  # fmt: skip
        sha = stored.sha256 or sha256_file(path)
        return DeliveredFile(path.name, stored.size, sha, target.url_for(path.name))

    if len(files) > 1 and commits_once(target):
        # a frame's formats (EXR, PNG, JPEG) go up side by side: each waits on the network
        with ThreadPoolExecutor(min(len(files), settings.s3_max_concurrency)) as pool:
            delivered = list(pool.map(deliver, files))
    else:
        delivered = [deliver(path) for path in files]
    entry = json.dumps([asdict(d) for d in delivered])
    _record(conn, job_id, frame, entry)
    count = guard(conn.hlen, keys.delivered(job_id))
    if count >= len(spec.frames):
        # every frame is recorded: this assembler saw the last one arrive (two may, at once;
        # both write the same list). The job is marked done only after this returns.
        write_manifest(conn, settings, spec, job_id, check)
    return delivered


#: times a frame's record is written when failovers lose it before a replica has it
RECORD_ATTEMPTS = 3


def _record(conn: Redis, job_id: str, frame: int, entry: str) -> None:
    for _ in range(RECORD_ATTEMPTS):
        guard(conn.hset, keys.delivered(job_id), str(frame), entry)
        try:
            if confirm_replicated(conn, keys.delivered(job_id), str(frame)):
                return
        except QueueError as exc:
            # the files are delivered: failing the job now would help no one. Were the record
            # lost after all, the frame's next assembly puts the same bytes again (no change)
            log.warning("event=delivery_unconfirmed job=%s frame=%d error=%r", job_id, frame,
                        exc.message)  # fmt: skip
            return
    raise QueueError(f"the delivery record of job {job_id} frame {frame} was lost in Redis "
                     f"failovers {RECORD_ATTEMPTS} times", job_id=job_id, frame=frame)  # fmt: skip


def _holds(target: LocalStorage, path: Path) -> bool:
    """The folder holds ``path``'s bytes under its name already (a delivery repeated)."""
    there = target.path(path.name)
    return (
        there.is_file()
        and there.stat().st_size == path.stat().st_size
        and sha256_file(there) == sha256_file(path)
    )


def manifest(conn: Redis, settings: Settings, spec: JobSpec, job_id: str) -> dict[str, Any]:
    target = open_output(spec.output, settings)
    raw: dict[str, str] = guard(conn.hgetall, keys.delivered(job_id))
    frames: list[dict[str, Any]] = []
    total = 0
    for frame in sorted(int(f) for f in raw):
        files = []
        for item in json.loads(raw[str(frame)]):
            item["url"] = target.presign(item["name"], settings.presign_expiry_s)
            total += int(item["size"])
            files.append(item)
        frames.append({"frame": frame, "files": files})
    linked = commits_once(target)
    return {
        "v": MANIFEST_VERSION,
        "job_id": job_id,
        "name": spec.name,
        "output": target.url,
        "created_s": time.time(),
        "urls_expire_s": time.time() + settings.presign_expiry_s if linked else None,
        "frames": frames,
        "files": sum(len(entry["files"]) for entry in frames),
        "bytes": total,
    }


def write_manifest(
    conn: Redis,
    settings: Settings,
    spec: JobSpec,
    job_id: str,
    fence: Callable[[], None] | None = None,
) -> StoredObject:
    target = open_output(spec.output, settings)
    body = json.dumps(manifest(conn, settings, spec, job_id), indent=2).encode()
    # not committed once: two last assemblers may both write it (same files, fresh URLs);
    # ``fence`` runs right before it replaces the old one
    if isinstance(target, LocalStorage):
        with tempfile.TemporaryDirectory(prefix="tessera-manifest-") as tmp:
            src = Path(tmp) / MANIFEST
            src.write_bytes(body)
            stored = target.put(MANIFEST, src, deliverable=True, fence=fence)
    else:
        if fence is not None:
            fence()
        stored = target.put_bytes(MANIFEST, body, deliverable=True)
    log.info("event=manifest_written job=%s url=%s files=%d", job_id, target.url_for(MANIFEST),
             len(json.loads(body)["frames"]))  # fmt: skip
    return stored


def read_manifest(output: str, settings: Settings) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(open_output(output, settings).read_bytes(MANIFEST))
    return data
