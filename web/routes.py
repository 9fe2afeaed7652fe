"""The one URL table of the web app: every route, its handler, whether it is public, its doc."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from web import (
    auth,
    blocklists,
    downloads,
    estimates,
    events,
    frameimages,
    health,
    jobcontrol,
    jobs,
    livepreview,
    livewebrtc,
    metrics,
    openapi,
    pages,
    projects,
    streams,
    tasks,
    tilelogs,
    uploads,
    webhooks,
    workers,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    summary: str
    #: served without a user (pages, login, the spec, metrics)
    public: bool = False
    #: JSON request body: field name -> JSON schema (OpenAPI)
    body: dict[str, Any] | None = None
    #: what the body is when it is not JSON (uploads)
    body_type: str | None = None
    query: tuple[str, ...] = ()
    tags: tuple[str, ...] = field(default=())


S = {"type": "string"}
I = {"type": "integer"}  # noqa: E741
B = {"type": "boolean"}


def _job_body() -> dict[str, Any]:
    names = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
             dict: "object"}  # fmt: skip
    out: dict[str, Any] = {}
    for name, types in jobs.body_fields().items():
        kinds = types if isinstance(types, tuple) else (types,)
        schemas = [{"type": names[t]} for t in kinds if t in names]
        out[name] = schemas[0] if len(schemas) == 1 else {"oneOf": schemas}
    return out


def table() -> list[Route]:
    R = Route
    return [
        # pages
        R("GET", "/", pages.index, "jobs list page", public=True, tags=("pages",)),
        R("GET", "/login", pages.login_page, "login page", public=True, tags=("pages",)),
        R("GET", "/upload", pages.upload_page, "upload and submit page", public=True,
          tags=("pages",)),
        R("GET", "/jobs/{job_id}", pages.job_page, "job page", public=True, tags=("pages",)),
        R("GET", "/streams", pages.streams_page, "streams page", public=True, tags=("pages",)),
        R("GET", "/workers", pages.workers_page, "workers page", public=True, tags=("pages",)),
        R("GET", "/project", pages.project_page, "project settings page (webhooks)",
          public=True, tags=("pages",)),
        R("GET", "/static/{path}", pages.static_file, "page assets", public=True,
          tags=("pages",)),
        R("GET", "/player", pages.player, "stream player page", public=True, tags=("pages",)),
        R("GET", "/player.{ext}", pages.player_asset, "stream player script and style",
          public=True, tags=("pages",)),
        R("GET", "/metrics", metrics.metrics,
          "Prometheus metrics (FARM_METRICS_TOKEN or a farm admin's token)", public=True,
          tags=("meta",)),
        R("GET", "/healthz", health.healthz, "liveness and readiness probe (no Redis round trip)",
          public=True, tags=("meta",)),
        R("GET", "/api/openapi.json", openapi.spec, "this API description", public=True,
          tags=("meta",)),
        # accounts
        R("POST", "/api/login", auth.login, "trade an API token for a session cookie",
          public=True, body={"token": S}, tags=("accounts",)),
        R("POST", "/api/logout", auth.logout, "end the browser session", tags=("accounts",)),
        R("GET", "/api/me", auth.me, "the user, their projects, roles and device classes",
          tags=("accounts",)),
        R("POST", "/api/tokens", auth.create_token, "create a user's API token (farm admins)",
          body={"user": S, "project": S, "role": S, "admin": B}, tags=("accounts",)),
        R("DELETE", "/api/tokens/{token_id}", auth.revoke_token, "revoke an API token",
          tags=("accounts",)),
        R("GET", "/api/sessions", auth.list_sessions,
          "the user's browser sessions (farm admins: anyone's, ?user=)", query=("user",),
          tags=("accounts",)),
        R("DELETE", "/api/sessions/{session_id}", auth.end_session,
          "end a browser session (one's own; farm admins: anyone's)", tags=("accounts",)),
        R("GET", "/api/projects/{project}/members", projects.list_members,
          "the project's members and roles (project admins)", tags=("accounts",)),
        R("DELETE", "/api/projects/{project}/members/{user}", projects.remove_member,
          "remove a member from the project (project admins)", tags=("accounts",)),
        R("GET", "/api/projects/{project}/limits", projects.get_limits,
          "the project's limits: uploads and inspections in flight, tiles, stored bytes",
          tags=("accounts",)),
        R("PUT", "/api/projects/{project}/limits", projects.set_limits,
          "set a project's own limits (farm admins)",
          body={"uploads_in_flight": I, "inspections": I, "queued_tiles": I,
                "tiles_per_job": I, "stored_bytes": I}, tags=("accounts",)),
        R("PUT", "/api/projects/{project}/policy", projects.set_policy,
          "set the device classes a role may lease (cpu, t4, a100, ...; gpu: every GPU "
          "class) and who may launch desktop apps (project admins)",
          body={"role": S, "devices": {"type": "array", "items": S}, "desktop_apps": S},
          tags=("accounts",)),
        R("GET", "/api/projects/{project}/budget", estimates.get_budget,
          "the project's budget per period: spent, committed to unfinished jobs, left",
          tags=("accounts",)),
        R("PUT", "/api/projects/{project}/budget", estimates.set_budget,
          "set the project's budget: an amount per period (30d, 24h); null removes it "
          "(project admins)", body={"amount": {"type": ["number", "null"]}, "period": S},
          tags=("accounts",)),
        R("GET", "/api/projects/{project}/webhooks", webhooks.list_hooks,
          "the project's webhooks, without their secrets (project admins)", tags=("webhooks",)),
        R("POST", "/api/projects/{project}/webhooks", webhooks.create_hook,
          "add a webhook: an http(s) URL and the events it wants (job.submitted, frame.done, "
          "job.done, job.failed, job.canceled; default all); the answer shows its signing "
          "secret once (project admins)",
          body={"url": S, "events": {"type": "array", "items": S}}, tags=("webhooks",)),
        R("DELETE", "/api/projects/{project}/webhooks/{hook_id}", webhooks.delete_hook,
          "delete a webhook (project admins)", tags=("webhooks",)),
        R("POST", "/api/projects/{project}/webhooks/{hook_id}/rotate", webhooks.rotate_secret,
          "a new signing secret, shown once; the old one signs deliveries too for "
          "FARM_WEBHOOK_SECRET_GRACE_S (project admins)", tags=("webhooks",)),
        R("POST", "/api/projects/{project}/webhooks/{hook_id}/enable", webhooks.enable_hook,
          "deliver to a disabled webhook again (a receiver's 410 Gone disables it; project "
          "admins)", tags=("webhooks",)),
        R("GET", "/api/projects/{project}/webhooks/{hook_id}/deliveries",
          webhooks.list_deliveries,
          "the webhook's latest deliveries: state, attempts, last result (project admins)",
          tags=("webhooks",)),
        # uploads (sessions first: /api/uploads/sessions must not match {upload_id})
        R("POST", "/api/uploads/sessions", uploads.create_session,
          "start a resumable upload", body={"project": S, "name": S, "size": I},
          tags=("uploads",)),
        R("GET", "/api/uploads/sessions/{session_id}", uploads.session_status,
          "where a resumable upload stands", tags=("uploads",)),
        R("PATCH", "/api/uploads/sessions/{session_id}", uploads.session_chunk,
          "append a chunk at Upload-Offset", body_type="application/octet-stream",
          tags=("uploads",)),
        R("DELETE", "/api/uploads/sessions/{session_id}", uploads.abort_session,
          "drop a resumable upload", tags=("uploads",)),
        R("POST", "/api/uploads/sessions/{session_id}/complete", uploads.complete_session,
          "finish a resumable upload", tags=("uploads",)),
        R("POST", "/api/uploads", uploads.post_upload,
          "upload a .blend or a zip (multipart field \"file\", or raw with X-Filename)",
          body_type="multipart/form-data", query=("project",), tags=("uploads",)),
        R("GET", "/api/uploads", uploads.list_uploads, "the projects' uploads",
          query=("project",), tags=("uploads",)),
        R("PUT", "/api/uploads/{name}", uploads.put_upload, "upload raw bytes as NAME",
          body_type="application/octet-stream", query=("project",), tags=("uploads",)),
        R("GET", "/api/uploads/{upload_id}", uploads.get_upload, "one upload",
          query=("project",), tags=("uploads",)),
        R("DELETE", "/api/uploads/{upload_id}", uploads.delete_upload,
          "delete one of the project's uploads, its stored file too when no other project or "
          "unfinished job holds it; refused while an unfinished job of the project renders it",
          query=("project",), tags=("uploads",)),
        R("POST", "/api/uploads/{upload_id}/inspect", uploads.inspect_upload,
          "inspect the .blend (scripts off): frames, resolution, cameras, missing files",
          query=("project", "device"), tags=("uploads",)),
        # jobs
        R("POST", "/api/jobs", jobs.submit_job, "submit a render job", body=_job_body(),
          tags=("jobs",)),
        R("POST", "/api/jobs/estimate", estimates.estimate,
          "estimate a job before submitting it (the submit body; nothing is queued): per "
          "device class, time per frame, wall time with the devices free now, device-hours, "
          "cost, kWh, CO2e; and what the project's budget has left", body=_job_body(),
          tags=("jobs",)),
        R("GET", "/api/estimates/errors", estimates.estimate_errors,
          "the newest estimate-vs-actual checks of the jobs of the user's projects",
          query=("limit",), tags=("jobs",)),
        R("GET", "/api/jobs", jobs.list_jobs,
          "jobs of the user's projects, sorted (submitted, state, name, progress)",
          query=("project", "state", "archived", "sort", "order", "limit"), tags=("jobs",)),
        R("POST", "/api/jobs/batch", jobcontrol.batch,
          "one action (suspend, resume, requeue, archive, unarchive, delete, cancel) on many "
          "jobs; a result per job",
          body={"action": S, "ids": {"type": "array", "items": S}, "confirm": B,
                "frames": {"type": "array", "items": I}, "tasks": {"type": "array", "items": S}},
          tags=("jobs",)),
        R("GET", "/api/events", jobcontrol.project_events,
          "what changes in the jobs of the user's projects, as server-sent events",
          query=("project",), tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}", jobs.get_job, "a job with its tile grid per frame",
          tags=("jobs",)),
        R("PATCH", "/api/jobs/{job_id}", jobs.patch_job, "change a job's priority",
          body={"priority": I}, tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/why", workers.job_why,
          "why the job waits: no worker of its device kind online, all busy (its queue "
          "position), all disabled, or its project's device policy", tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/events", events.job_events,
          "the job's progress as server-sent events", query=("after",), tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/live", livepreview.live_passes,
          "a live-preview job's frame converging, as server-sent events: each tile's current "
          "pass (a JPEG), then each pass as it lands", tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/live/webrtc", livewebrtc.ice,
          "the STUN/TURN servers for a live-preview WebRTC offer (503 where the farm previews "
          "over JPEG/SSE only)", tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/live/webrtc", livewebrtc.offer,
          "a live-preview job's frame converging as a WebRTC video: the viewer's SDP offer in, "
          "the answer out (429/503 at the viewer caps: watch over .../live)",
          body={"type": S, "sdp": S}, tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/cancel", jobs.cancel_job, "cancel a job",
          tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/retry", jobs.retry_job,
          "render the unfinished tiles of a failed job again", tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/suspend", jobcontrol.suspend_job,
          "start no more tiles of the job (those rendering finish)", tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/resume", jobcontrol.resume_job,
          "run a suspended job again", tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/requeue", jobcontrol.requeue_job,
          "render and deliver chosen frames or tasks (\"frame:index\") again, also of an "
          "ended job; none chosen: its unfinished tiles",
          body={"frames": {"type": "array", "items": I}, "tasks": {"type": "array", "items": S}},
          tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/archive", jobcontrol.archive_job,
          "hide an ended job from the default list (kept)", tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/unarchive", jobcontrol.unarchive_job,
          "show an archived job in the default list again", tags=("jobs",)),
        R("POST", "/api/jobs/{job_id}/delete", jobcontrol.delete_job,
          "delete a job, its records and files (confirm: true; a running job is canceled)",
          body={"confirm": B}, tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/logs", jobs.job_logs, "the job's events and errors",
          tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/blocklist", blocklists.get_blocklist,
          "the workers that failed the job's tiles and those blocklisted for it", tags=("jobs",)),
        R("DELETE", "/api/jobs/{job_id}/blocklist", blocklists.clear_blocklist,
          "clear the job's blocklist: every worker may render it again (?worker=: only that one)",
          query=("worker",), tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/tiles/{frame}/{tile}/attempts/{attempt}/log",
          tilelogs.tile_log, "a tile attempt's own log (Blender's lines, a failure's detail)",
          tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/frames", downloads.list_frames, "finished frame files",
          tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/tasks", tasks.job_tasks,
          "the job's tasks (tiles or sample parts) with worker, times, attempts, render time, "
          "peak memory and failure cause; the job's ETA and per-frame times",
          query=("state", "frames", "sort", "offset", "limit"), tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/frames/{frame}/thumbnail", frameimages.thumbnail,
          "a finished frame's thumbnail (JPEG, at most 256 px a side, cached)", tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/frames/{frame}/view", frameimages.exposure_view,
          "a finished frame's EXR, full size, as a PNG at an exposure (stops)",
          query=("exposure",), tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/frames/{frame}/{file_name}", downloads.frame_file,
          "one frame file", tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/files/{file_name}", downloads.job_file,
          "a file of the whole job: the animation's MP4 preview, the manifest", tags=("jobs",)),
        R("GET", "/api/jobs/{job_id}/download.zip", downloads.download_zip,
          "every finished frame file, the preview and the manifest as one zip (streamed)",
          tags=("jobs",)),
        # workers
        R("GET", "/api/workers", workers.list_workers,
          "render workers and stream services: state, current task (other projects' hidden), "
          "last heartbeat, tiles today, GPU utilisation", tags=("workers",)),
        R("POST", "/api/workers/{name}/disable", workers.disable_worker,
          "disable (drain) a worker: it finishes its task and takes no new ones; a stream "
          "service starts no new session, its running ones continue (farm admins)",
          tags=("workers",)),
        R("POST", "/api/workers/{name}/enable", workers.enable_worker,
          "let a disabled worker take tasks again (farm admins)", tags=("workers",)),
        # streams
        R("GET", "/api/streams/apps", streams.apps, "the stream app catalog",
          tags=("streams",)),
        R("GET", "/api/streams/ice", streams.ice, "STUN/TURN servers for WebRTC",
          tags=("streams",)),
        R("GET", "/api/streams/sessions", streams.list_sessions,
          "running stream sessions of the user's projects", query=("project",),
          tags=("streams",)),
        R("POST", "/api/streams/sessions", streams.create_session, "launch a stream session",
          body={"app": S, "project": S, "width": I, "height": I, "fps": I, "device": S},
          tags=("streams",)),
        R("GET", "/api/streams/sessions/{session_id}", streams.get_session,
          "one stream session", tags=("streams",)),
        R("DELETE", "/api/streams/sessions/{session_id}", streams.end_session,
          "end a stream session", tags=("streams",)),
        R("POST", "/api/streams/sessions/{session_id}/viewers", streams.join,
          "join with a WebRTC offer (player or spectator)",
          body={"type": S, "sdp": S, "role": S, "name": S}, tags=("streams",)),
        R("DELETE", "/api/streams/sessions/{session_id}/viewers/{viewer_id}", streams.leave,
          "leave a session", tags=("streams",)),
        R("GET", "/api/streams/sessions/{session_id}/ws", streams.watch,
          "watch (and drive) a session over a WebSocket: the fallback where WebRTC cannot "
          "connect", tags=("streams",)),
        R("POST", "/api/streams/sessions/{session_id}/control", streams.control,
          "hand control to a viewer", body={"viewer_id": S}, tags=("streams",)),
        R("GET", "/api/streams/sessions/{session_id}/files", streams.list_files,
          "the files of a session's home folder", tags=("streams",)),
        R("GET", "/api/streams/sessions/{session_id}/files/{name}", streams.download_file,
          "download a file of a session's home folder", tags=("streams",)),
        R("PUT", "/api/streams/sessions/{session_id}/files/{name}", streams.upload_file,
          "upload a file into a session's home folder",
          body_type="application/octet-stream", tags=("streams",)),
    ]  # fmt: skip


def add_routes(app: web.Application, routes: list[Route]) -> dict[tuple[str, str], Route]:
    """Register every route; returns (method, canonical path) -> route for auth and OpenAPI."""
    by_key: dict[tuple[str, str], Route] = {}
    for r in routes:
        path = r.path.replace("{ext}", "{ext:(?:js|css)}").replace("{path}", "{path:.+}")
        resource = app.router.add_route(r.method, path, r.handler).resource
        assert resource is not None
        by_key[(r.method, resource.canonical)] = r
    return by_key
