"""The add-on's HTTP client for a Tessera farm: resumable upload, inspection and job submission.

Pure Python (urllib only, no bpy) so it runs and is tested outside Blender; the add-on's UI
calls ``submit_blend`` from a background thread and shows the progress it reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: bytes per PATCH of a resumable upload; a lost connection costs at most one chunk
CHUNK_BYTES = 8 * 1024 * 1024
#: times a chunk is sent again after a connection error before the upload gives up
CHUNK_RETRIES = 4
DEFAULT_TIMEOUT_S = 120.0

#: progress(stage, done, total): stage is "upload", "inspect" or "submit"
Progress = Callable[[str, int, int], None]


class FarmClientError(Exception):
    """The farm refused a request or could not be reached; ``code`` is the farm's error code."""

    def __init__(
        self, message: str, *, status: int = 0, code: str = "", fields: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.fields = fields or {}


@dataclass
class SubmitOptions:
    """What the add-on asks for; ``None`` leaves the farm's default or the file's setting."""

    frames: str | None = None
    tiles: str = "2x2"
    samples: int | None = None
    resolution: str | None = None
    formats: str = "exr,png"
    priority: int = 0
    device: str = "cpu"
    accept_missing: bool = False
    name: str | None = None
    #: denoise each frame once after stitching (the farm never denoises a tile alone)
    denoise: bool = False
    #: tags a worker must all have (comma-separated); empty: any worker
    tags: str = ""
    #: "sequential" or "first-last-middle" (those three frames first, to see problems early)
    frame_order: str = "sequential"
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, project: str, upload_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "project": project,
            "upload_id": upload_id,
            "tiles": self.tiles,
            "formats": self.formats,
            "priority": self.priority,
            "device": self.device,
        }
        for key in ("frames", "samples", "resolution", "name"):
            value = getattr(self, key)
            if value is not None:
                body[key] = value
        if self.accept_missing:
            body["accept_missing"] = True
        if self.denoise:
            body["denoise"] = True
        if self.tags.strip():
            body["tags"] = self.tags
        if self.frame_order != "sequential":
            body["frame_order"] = self.frame_order
        body.update(self.extra)
        return body


@dataclass(frozen=True)
class Submitted:
    upload: dict[str, Any]
    job: dict[str, Any]
    job_url: str

    @property
    def job_id(self) -> str:
        return str(self.job.get("id") or self.job.get("job_id"))


def frames_text(frame_start: int, frame_end: int, frame_step: int = 1) -> str:
    """A scene's frame range in the farm's frame-list syntax (``1-250``, ``1-250x2``, ``7``)."""
    if frame_end < frame_start:
        raise ValueError(f"frame range {frame_start}-{frame_end} ends before it starts")
    if frame_start == frame_end:
        return str(frame_start)
    sep = ".." if frame_start < 0 or frame_end < 0 else "-"
    step = f"x{frame_step}" if frame_step > 1 else ""
    return f"{frame_start}{sep}{frame_end}{step}"


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise FarmClientError(
            f"farm URL {url!r} is not an http(s) URL, for example http://farm.example:8080",
            code="bad_url",
        )
    return url


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FarmClient:
    """Talks to one farm's API with a bearer token."""

    def __init__(self, url: str, token: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = normalize_url(url)
        if not token.strip():
            raise FarmClientError(
                "no access token set; paste one in the add-on's preferences", code="no_token"
            )
        self.token = token.strip()
        self.timeout_s = timeout_s

    # --- plumbing ------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One API call; the decoded JSON answer (None when empty). Errors -> FarmClientError."""
        hdrs = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        hdrs.update(headers or {})
        if json_body is not None:
            data = json.dumps(json_body).encode()
            hdrs["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            with e:
                raise _http_error(e.code, e.read()) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise FarmClientError(
                f"cannot reach the farm at {self.url}: {reason}", code="unreachable"
            ) from e
        return json.loads(raw) if raw.strip() else None

    # --- API -----------------------------------------------------------------------------------

    def me(self) -> dict[str, Any]:
        return dict(self.request("GET", "/api/me"))

    def default_project(self) -> str:
        projects = self.me().get("projects") or []
        writable = [p for p in projects if p.get("role") in ("admin", "member")]
        if not writable:
            raise FarmClientError("this token may not submit jobs to any project", code="forbidden")
        return str(writable[0]["id"])

    def upload(
        self,
        path: str,
        project: str,
        progress: Progress | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> dict[str, Any]:
        """Upload a file through a resumable session; return the farm's Upload."""
        size = os.path.getsize(path)
        session = self.request(
            "POST",
            "/api/uploads/sessions",
            json_body={"project": project, "name": os.path.basename(path), "size": size},
        )
        return self.resume_upload(
            path, str(session["session_id"]), int(session.get("offset", 0)), progress, chunk_bytes
        )

    def resume_upload(
        self,
        path: str,
        session_id: str,
        offset: int = 0,
        progress: Progress | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> dict[str, Any]:
        """Send ``path`` from ``offset`` into an open session, following the server's offset."""
        size = os.path.getsize(path)
        url = f"/api/uploads/sessions/{urllib.parse.quote(session_id)}"
        failures = 0
        with open(path, "rb") as f:
            while offset < size:
                f.seek(offset)
                chunk = f.read(chunk_bytes)
                try:
                    answer = self.request(
                        "PATCH",
                        url,
                        data=chunk,
                        headers={
                            "Upload-Offset": str(offset),
                            "Content-Type": "application/offset+octet-stream",
                        },
                    )
                    offset, failures = int(answer["offset"]), 0
                except FarmClientError as e:
                    at = e.fields.get("offset")
                    if e.status == 409 and isinstance(at, int) and at != offset:
                        offset = at  # the server knows better: go on from there
                        continue
                    failures += 1
                    if e.code != "unreachable" or failures > CHUNK_RETRIES:
                        raise
                    offset = int(self.request("GET", url)["offset"])
                if progress:
                    progress("upload", offset, size)
        upload = dict(self.request("POST", url + "/complete"))
        # uploads are named by the sha256 of their bytes: a different name means damaged bytes
        if upload.get("upload_id") and upload["upload_id"] != file_sha256(path):
            raise FarmClientError(
                f"the farm stored {path} with a different checksum; try again",
                code="checksum_mismatch",
            )
        return upload

    def inspect(self, upload_id: str) -> dict[str, Any]:
        return dict(self.request("POST", f"/api/uploads/{urllib.parse.quote(upload_id)}/inspect"))

    def submit(self, project: str, upload_id: str, options: SubmitOptions) -> dict[str, Any]:
        return dict(self.request("POST", "/api/jobs", json_body=options.body(project, upload_id)))

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/api/jobs/{urllib.parse.quote(job_id)}"))

    def job_page(self, job_id: str) -> str:
        return f"{self.url}/jobs/{urllib.parse.quote(job_id)}"

    def submit_blend(
        self, path: str, options: SubmitOptions, project: str = "", progress: Progress | None = None
    ) -> Submitted:
        """Upload ``path``, inspect it and queue a job: what the add-on's Submit button does."""
        if not os.path.isfile(path):
            raise FarmClientError(f"{path} does not exist; save the .blend first", code="no_file")
        project = project or self.default_project()
        upload = self.upload(path, project, progress)
        if progress:
            progress("inspect", 0, 1)
        report = self.inspect(str(upload["upload_id"]))
        missing = list(report.get("missing_files") or [])
        if missing and not options.accept_missing:
            raise FarmClientError(
                f"{len(missing)} external file(s) are missing on the farm: "
                + ", ".join(missing[:5])
                + ("…" if len(missing) > 5 else "")
                + " (pack resources into the .blend, or allow missing files)",
                code="missing_files",
                fields={"files": missing},
            )
        if progress:
            progress("submit", 0, 1)
        job = self.submit(project, str(upload["upload_id"]), options)
        done = Submitted(upload=upload, job=job, job_url="")
        return Submitted(upload=upload, job=job, job_url=self.job_page(done.job_id))


def _http_error(status: int, raw: bytes) -> FarmClientError:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    body = body if isinstance(body, dict) else {}
    inner = body.get("error")
    # fields may sit in the error object or beside it ({"error": ..., "offset": N})
    err: dict[str, Any] = {k: v for k, v in body.items() if k != "error"}
    if isinstance(inner, dict):
        err.update(inner)
    message = str(err.get("message") or raw[:200].decode(errors="replace") or f"HTTP {status}")
    if status == 401:
        message = "the farm refused the access token (wrong or revoked): " + message
    fields = {k: v for k, v in err.items() if k not in ("code", "message")}
    return FarmClientError(message, status=status, code=str(err.get("code", "")), fields=fields)
