"""Drives the compose stack as a user would, then tears it down; prints each phase's time.

Run by deploy/stack/test-stack after deploy/stack/build-images (the engine and its private
configuration come from deploy/stack/engine.sh through the environment). The stack is
docker-compose.yml with deploy/compose/cpu.yml (GPU services on the CPU device), the
stand-in images where no registry answers (deploy/compose/standins.yml), a second cell and
the front door (deploy/compose/cells.yml) and deploy/compose/stack-test.yml (host ports for
this test), under its own project name.

Phases: up and healthy; a token (`farm token create` in the web container); the example scene
uploaded (resumable, as the UI does) and inspected; a job to S3; a worker killed (SIGKILL) and
Redis restarted while it renders; the job done with every tile once; each frame downloaded by
the link the API gives and compared with a plain bpy render of that frame, bit for bit; the
same token after the restart; a stream session started through the web, encoding, ended; a
project of cell c2 made through cell c1's web (the accounts are shared), its upload,
inspection and job through the front door, rendered in c2 and held only in c2's Redis;
everything torn down (only this project: its containers, network and volumes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from workers import exr  # noqa: E402  (the farm's own EXR reader, from this checkout)

EXAMPLE = REPO / "farm" / "examples" / "example.blend"
PROJECT = "stack"
#: the services a GPU host runs, then cell c2 and the front door (deploy/compose/cells.yml);
#: compose's monitoring profile stays off
CELL_SERVICES = ("redis-c2", "web-c2", "worker-c2", "frontdoor")
SERVICES = ("redis", "minio", "minio-init", "web", "worker", "stream", "coturn", *CELL_SERVICES)
HEALTHY = ("redis", "minio", "web", "worker", "stream", "coturn", *CELL_SERVICES)
#: the project of cell c2 (made pinned there) whose job renders in that cell
CELL_PROJECT = "stack-c2"
#: services on the host's network (started by the driver under podman-compose 1.0)
HOST_NETWORK = ("coturn",)
#: generous for a cold 2-core machine; every wait ends as soon as its condition holds
UP_TIMEOUT_S = 240.0
JOB_TIMEOUT_S = 420.0
STREAM_TIMEOUT_S = 90.0
CHUNK = 8 * 1024 * 1024
FRAMES = "1-3"
TILES = "2x2"
T = TypeVar("T")


class StackError(Exception):
    """The stack did not do what a user expects; the message says what and where to look."""


# --- the engine ----------------------------------------------------------------------------------


class Stack:
    """One compose project on podman (podman-compose) or Docker (docker compose)."""

    def __init__(self, engine: str, project: str, files: list[Path], env: dict[str, str]) -> None:
        self.engine = engine
        self.project = project
        self.files = files
        self.env = {**os.environ, **env}

    def compose(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # podman-compose 1.0 ignores compose's `cgroup: private` (the sandboxed services need
        # it) and podman's containers.conf `cgroupns` is not applied on cgroup v1: ask for it
        base = (
            ["podman-compose", "--podman-run-args=--cgroupns=private"]
            if self.engine == "podman"
            else ["docker", "compose"]
        )
        files = [a for f in self.files for a in ("-f", str(f))]
        return self.run([*base, "-p", self.project, *files, *args], check=check)

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, cwd=REPO, env=self.env, capture_output=True, text=True, check=False
        )
        if check and proc.returncode != 0:
            raise StackError(
                f"`{shlex.join(argv)}` exited {proc.returncode}:\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc

    def container(self, service: str) -> str:
        sep = "_" if self.engine == "podman" else "-"
        return f"{self.project}{sep}{service}{sep}1"

    def engine_cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run([self.engine, *args], check=check)

    def healthcheck(self, service: str) -> list[str]:
        """The service's healthcheck command as the compose files (the last that sets it) say."""
        test: list[str] = []
        for path in self.files:
            services = (yaml.safe_load(path.read_text()) or {}).get("services") or {}
            test = (services.get(service) or {}).get("healthcheck", {}).get("test", test)
        if test[:1] == ["CMD"]:
            return test[1:]
        if test[:1] == ["CMD-SHELL"]:
            return ["/bin/sh", "-c", test[1]]
        raise StackError(f"compose service {service} has no healthcheck to wait on")

    def healthy(self, service: str) -> bool:
        """The service's own compose healthcheck passes now. Under podman the driver runs it:
        podman has no systemd here to run it on a timer, and podman-compose 1.0 joins a CMD
        list into one shell word (`python -c ...` then fails), so `podman healthcheck run`
        would report every multi-word check unhealthy."""
        name = self.container(service)
        if self.engine == "podman":
            argv = ["exec", name, *self.healthcheck(service)]
            return self.engine_cmd(*argv, check=False).returncode == 0
        out = self.engine_cmd(
            "inspect", "--format", "{{.State.Health.Status}}", name, check=False
        ).stdout
        return out.strip() == "healthy"

    def running(self, service: str) -> bool:
        out = self.engine_cmd(
            "inspect", "--format", "{{.State.Running}}", self.container(service), check=False
        ).stdout
        return out.strip() == "true"

    def logs(self, service: str, lines: int = 60) -> str:
        proc = self.engine_cmd("logs", "--tail", str(lines), self.container(service), check=False)
        return proc.stdout + proc.stderr

    def exec(self, service: str, *argv: str) -> str:
        return self.engine_cmd("exec", self.container(service), *argv).stdout


# --- the web API, as a user's client -------------------------------------------------------------


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base = base
        self.token = token

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
        expect: tuple[int, ...] = (200, 201, 204),
    ) -> Any:
        hdrs = {"Authorization": f"Bearer {self.token}", **(headers or {})}
        if body is not None:
            data = json.dumps(body).encode()
            hdrs["Content-Type"] = "application/json"
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        if status not in expect:
            raise StackError(f"{method} {path} answered {status}: {raw[:2000]!r}")
        return json.loads(raw) if raw else None

    def download(self, url: str) -> tuple[bytes, str]:
        """What a browser gets for a download link, and from where: the web's own answer, or
        the target of its redirect (a presigned S3 URL, fetched as a browser would: without
        the farm's token, from where the user is)."""
        full = url if url.startswith("http") else self.base + url
        req = urllib.request.Request(full, headers={"Authorization": f"Bearer {self.token}"})
        try:
            with NO_REDIRECTS.open(req, timeout=60) as resp:
                return bytes(resp.read()), full
        except urllib.error.HTTPError as exc:
            target = exc.headers.get("Location")
            if exc.code not in (301, 302, 303, 307, 308) or not target:
                raise StackError(f"GET {url} answered {exc.code}: {exc.read()[:500]!r}") from None
        with urllib.request.urlopen(target, timeout=60) as resp:
            return bytes(resp.read()), target


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


NO_REDIRECTS = urllib.request.build_opener(_NoRedirect)


# --- waiting and timing --------------------------------------------------------------------------


def wait_for(what: str, check: Callable[[], T | None], timeout_s: float, every_s: float = 0.5) -> T:
    """Polls ``check`` until it gives something other than None/False; raises after
    ``timeout_s`` naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise StackError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


PHASES: list[tuple[str, float]] = []


@contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.monotonic()
    print(f"stack: {name} ...", flush=True)
    try:
        yield
    finally:
        took = time.monotonic() - start
        PHASES.append((name, took))
        print(f"stack: {name}: {took:.1f} s", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the journey ---------------------------------------------------------------------------------


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR}`` / ``${VAR:-default}`` substitution and ``$$`` for ``$``."""

    def sub(m: re.Match[str]) -> str:
        return env.get(m[1]) or (m[2] or "")

    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", sub, value).replace("$$", "$")


def start_host_network_service(stack: Stack, service: str) -> None:
    """Runs a `network_mode: host` service as compose describes it. podman-compose 1.0 adds its
    project network to every container (`--network host --net tessera-stack_default`), which
    podman refuses, so such a service never starts under it."""
    spec: dict[str, Any] = {}
    for path in stack.files:
        spec.update(
            ((yaml.safe_load(path.read_text()) or {}).get("services") or {}).get(service, {})
        )
    argv = [
        "run", "-d", "--name", stack.container(service), "--network", "host",
        "--label", f"io.podman.compose.project={stack.project}",
        "--label", f"com.docker.compose.project={stack.project}",
        str(spec["image"]), *(interpolate(str(a), stack.env) for a in spec.get("command", [])),
    ]  # fmt: skip
    stack.engine_cmd("rm", "-f", stack.container(service), check=False)
    stack.engine_cmd(*argv)


def bring_up(stack: Stack) -> None:
    if stack.engine == "podman":
        stack.compose("up", "-d", *(s for s in SERVICES if s not in HOST_NETWORK))
        for service in HOST_NETWORK:
            start_host_network_service(stack, service)
    else:
        stack.compose("up", "-d", *SERVICES)
    for service in HEALTHY:
        try:
            wait_for(f"{service} healthy", partial(stack.healthy, service), UP_TIMEOUT_S, 1.0)
        except StackError as exc:
            raise StackError(f"{exc}\n--- {service} log:\n{stack.logs(service)}") from None
    code = stack.engine_cmd("wait", stack.container("minio-init")).stdout.strip()
    if code != "0":
        raise StackError(f"minio-init exited {code}:\n{stack.logs('minio-init')}")


def create_token(stack: Stack, user: str, role: str) -> str:
    out = stack.exec(
        "web", "farm", "token", "create", "--user", user, "--project", PROJECT,
        "--role", role, "--json",
    )  # fmt: skip
    return str(json.loads(out)["token"])


#: counts the stream container's zombie processes (state Z in /proc/PID/stat)
ZOMBIES = (
    "import os\n"
    "n = 0\n"
    "for p in filter(str.isdigit, os.listdir('/proc')):\n"
    "    try: n += open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] == 'Z'\n"
    "    except OSError: pass\n"
    "print(n)"
)
#: prints where the gamepad shim is, or nothing where the image lacks it
PAD_SHIM = "from encoder.gamepad import SHIM\nprint(SHIM if SHIM.is_file() else '')"


def upload(api: Api, blend: Path, project: str = PROJECT) -> str:
    """A resumable upload in 8 MiB chunks, as the web UI sends it."""
    data = blend.read_bytes()
    session = api.request(
        "POST",
        "/api/uploads/sessions",
        body={"project": project, "name": blend.name, "size": len(data)},
    )
    sid = session["session_id"]
    for offset in range(0, len(data), CHUNK):
        api.request(
            "PATCH",
            f"/api/uploads/sessions/{sid}",
            data=data[offset : offset + CHUNK],
            headers={
                "Upload-Offset": str(offset),
                "Content-Type": "application/offset+octet-stream",
            },
        )
    done = api.request("POST", f"/api/uploads/sessions/{sid}/complete")
    return str(done["upload_id"])


def tiles_done(detail: dict[str, Any]) -> int:
    return sum(t == "done" for f in detail["frames"].values() for t in f["tiles"])


def faults_mid_job(stack: Stack, api: Api, job_id: str) -> None:
    """SIGKILL the worker while it renders, restart Redis, start the worker again."""
    wait_for(
        "the first tile done",
        lambda: tiles_done(api.request("GET", f"/api/jobs/{job_id}")) > 0,
        JOB_TIMEOUT_S,
    )
    stack.engine_cmd("kill", "--signal", "KILL", stack.container("worker"))
    print("stack:   worker killed (SIGKILL) mid-job", flush=True)
    stack.engine_cmd("restart", stack.container("redis"))
    wait_for("redis healthy after its restart", lambda: stack.healthy("redis"), 60.0)
    print("stack:   redis restarted mid-job", flush=True)
    if not stack.running("worker"):
        stack.engine_cmd("start", stack.container("worker"))
    wait_for("the worker healthy again", lambda: stack.healthy("worker"), UP_TIMEOUT_S, 1.0)
    print("stack:   worker started again", flush=True)


def wait_done(stack: Stack, api: Api, job_id: str, worker: str = "worker") -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        detail: dict[str, Any] = api.request("GET", f"/api/jobs/{job_id}")
        return detail if detail["state"] in ("done", "failed", "cancelled") else None

    try:
        detail = wait_for(f"job {job_id} to end", ended, JOB_TIMEOUT_S, 1.0)
    except StackError as exc:
        raise StackError(f"{exc}\n--- {worker} log:\n{stack.logs(worker, 120)}") from None
    if detail["state"] != "done":
        logs = api.request("GET", f"/api/jobs/{job_id}/logs")
        raise StackError(f"job {job_id} ended {detail['state']}:\n" + "\n".join(logs["lines"]))
    return detail


def plain_renders(frames: list[int], out: Path) -> dict[int, Path]:
    """The frames rendered the plain bpy way, outside the farm, on this host."""
    out.mkdir(parents=True, exist_ok=True)
    script = REPO / "deploy" / "stack" / "plainrender.py"
    argv = [sys.executable, str(script), str(EXAMPLE), str(out), *map(str, frames)]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        raise StackError(f"plain bpy render failed:\n{proc.stderr[-3000:]}")
    return {f: out / f"plain_{f:04d}.exr" for f in frames}


def check_frames(api: Api, job_id: str, frames: list[int], scratch: Path, public_s3: str) -> None:
    listing = api.request("GET", f"/api/jobs/{job_id}/frames")
    by_frame = {f["frame"]: f for f in listing["frames"]}
    if sorted(by_frame) != frames:
        raise StackError(f"job lists frames {sorted(by_frame)}, expected {frames}")
    plain = plain_renders(frames, scratch / "plain")
    for frame in frames:
        files = {x["name"]: x["url"] for x in by_frame[frame]["files"]}
        exr_name, png_name = f"frame_{frame:04d}.exr", f"frame_{frame:04d}.png"
        if exr_name not in files or png_name not in files:
            raise StackError(f"frame {frame} lacks its EXR or PNG: {sorted(files)}")
        data, source = api.download(files[exr_name])
        if frame == frames[0]:
            print(f"stack:   {files[exr_name]} -> {source.split('?')[0]}", flush=True)
        if public_s3 and not source.startswith(public_s3):
            raise StackError(f"{exr_name} came from {source}, not the public S3 {public_s3}")
        got = scratch / exr_name
        got.write_bytes(data)
        if not api.download(files[png_name])[0].startswith(b"\x89PNG"):
            raise StackError(f"{png_name} downloaded by its link is not a PNG")
        farm_px, plain_px = exr.read_rgba(got), exr.read_rgba(plain[frame])
        if farm_px.shape != plain_px.shape or not np.array_equal(farm_px, plain_px):
            diff = (
                float(np.abs(farm_px - plain_px).max())
                if farm_px.shape == plain_px.shape
                else f"shape {farm_px.shape} vs {plain_px.shape}"
            )
            raise StackError(f"frame {frame} differs from the plain bpy render (max {diff})")
    print(f"stack:   {len(frames)} frames bit-exact with plain bpy renders", flush=True)


def stream_session(api: Api, app: str) -> None:
    """Starts a session of ``app`` through the web, waits until it runs, ends it."""
    apps = api.request("GET", "/api/streams/apps")
    names = {a["name"] for a in (apps["apps"] if isinstance(apps, dict) else apps)}
    if app not in names:
        raise StackError(f"the stream catalog lacks {app}: {sorted(names)}")
    made = api.request(
        "POST",
        "/api/streams/sessions",
        body={"project": PROJECT, "app": app, "width": 640, "height": 360, "fps": 15},
    )
    sid = made["session_id"]

    def encoding() -> dict[str, Any] | None:
        info: dict[str, Any] = api.request("GET", f"/api/streams/sessions/{sid}")
        state = str(info.get("state", ""))
        if state in ("ended", "failed"):
            raise StackError(f"stream session {sid} {state}: {info}")
        return info if state == "running" else None

    info = wait_for(f"stream session {sid} running", encoding, STREAM_TIMEOUT_S)
    print(f"stack:   {app} session {sid} running ({info.get('encoder', {})})", flush=True)
    api.request("DELETE", f"/api/streams/sessions/{sid}")

    def gone() -> bool:
        info = api.request("GET", f"/api/streams/sessions/{sid}", expect=(200, 404)) or {}
        return "error" in info or str(info.get("state", "")) == "ended"

    wait_for(f"stream session {sid} gone", gone, STREAM_TIMEOUT_S)


def no_zombies(stack: Stack) -> None:
    """Ended sessions leave no zombie under the stream container's PID 1 (tini reaps them)."""
    count = int(stack.exec("stream", "python", "-c", ZOMBIES).strip())
    if count:
        raise StackError(f"{count} zombie processes in the stream container after sessions ended")
    print("stack:   no zombie processes in the stream container", flush=True)


def pad_shim(stack: Stack) -> None:
    """The image holds the gamepad shim where the stream service looks for it: a container
    has no /dev/uinput, so a session's pads reach its app only through the shim."""
    where = stack.exec("stream", "python", "-c", PAD_SHIM).strip()
    if not where:
        raise StackError("the stream image has no gamepad shim (deploy/Dockerfile, stage shim)")
    print(f"stack:   gamepad shim in the stream image: {where}", flush=True)


def second_cell(stack: Stack, door_url: str) -> None:
    """A project of cell c2, made through the web of c1 (the accounts are shared); through the
    front door its upload, inspection and job go to c2, and the job renders there."""
    out = stack.exec(
        "web", "farm", "token", "create", "--user", "stack-c2", "--project", CELL_PROJECT,
        "--cell", "c2", "--role", "member", "--json",
    )  # fmt: skip
    api = Api(door_url, str(json.loads(out)["token"]))
    me = api.request("GET", "/api/me")
    cells = {p["id"]: p.get("cell") for p in me["projects"]}
    if cells != {CELL_PROJECT: "c2"}:
        raise StackError(f"the front door's /api/me shows {cells}, not {CELL_PROJECT} in c2")
    upload_id = upload(api, EXAMPLE, CELL_PROJECT)
    api.request("POST", f"/api/uploads/{upload_id}/inspect")
    job = api.request(
        "POST", "/api/jobs",
        body={"project": CELL_PROJECT, "upload_id": upload_id, "frames": "1", "tiles": "1x1",
              "formats": ["png"], "name": "stack-cell-c2"},
    )  # fmt: skip
    job_id = str(job["job_id"])
    if not job_id.startswith("c2-"):
        raise StackError(f"the job of a project of cell c2 has the id {job_id}")
    detail = wait_done(stack, api, job_id, worker="worker-c2")
    held = {
        redis: stack.exec(redis, "redis-cli", "exists", f"tessera:job:{job_id}").strip()
        for redis in ("redis", "redis-c2")
    }
    if held != {"redis": "0", "redis-c2": "1"}:
        raise StackError(f"job {job_id} is held by {held} (1: that Redis has it), not c2's alone")
    print(f"stack:   job {job_id} done in cell c2: {tiles_done(detail)} tile, only in c2's Redis",
          flush=True)  # fmt: skip


def journey(stack: Stack, web_url: str, public_s3: str, scratch: Path, door_url: str) -> None:
    with phase("compose up, services healthy"):
        bring_up(stack)
    with phase("token (farm token create in the web container)"):
        api = Api(web_url, create_token(stack, "stack-test", "member"))
        # desktop apps (a shell) are for project admins only
        admin = Api(web_url, create_token(stack, "stack-admin", "admin"))
        me = api.request("GET", "/api/me")
        print(f"stack:   signed in as {me.get('user')}", flush=True)
    with phase("upload and inspection"):
        upload_id = upload(api, EXAMPLE)
        report = api.request("POST", f"/api/uploads/{upload_id}/inspect")
        if report.get("missing_files") or report.get("scripts_wanted"):
            raise StackError(f"inspection of the example found problems: {report}")
        print(f"stack:   inspected: frames {report['frames']}, {report['resolution']}", flush=True)
    with phase(f"job to S3 (frames {FRAMES}, tiles {TILES}), worker killed, redis restarted"):
        job = api.request(
            "POST",
            "/api/jobs",
            body={
                "project": PROJECT,
                "upload_id": upload_id,
                "frames": FRAMES,
                "tiles": TILES,
                "formats": ["exr", "png"],
                "name": "stack-test",
            },
        )
        job_id = job["job_id"]
        frames = [int(f) for f in job["spec"]["frames"]]
        faults_mid_job(stack, api, job_id)
        detail = wait_done(stack, api, job_id)
        per_frame = len(detail["frames"][str(frames[0])]["tiles"])
        if tiles_done(detail) != per_frame * len(frames):
            raise StackError(f"job {job_id} done with tiles missing: {detail['frames']}")
        print(f"stack:   job {job_id} done: {tiles_done(detail)} tiles", flush=True)
    with phase("frames downloaded by their links, compared with plain bpy renders"):
        check_frames(api, job_id, frames, scratch, public_s3)
    with phase("stream sessions through the web (testpattern, desktop), no zombies left"):
        stream_session(api, "testpattern")
        stream_session(admin, "desktop")
        no_zombies(stack)
        pad_shim(stack)
    with phase("a second cell behind the front door: a project of c2, its job rendered there"):
        second_cell(stack, door_url)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", default=os.environ.get("STACK_ENGINE", "podman"))
    parser.add_argument("--project", default="tessera-stack")
    parser.add_argument("--scratch", type=Path, default=Path(os.environ.get("STACK_DIR", "/tmp")))
    parser.add_argument("--standins", action="store_true", help="use deploy/compose/standins.yml")
    parser.add_argument("--keep", action="store_true", help="leave the stack up at the end")
    args = parser.parse_args()

    files = [REPO / "docker-compose.yml", REPO / "deploy/compose/cpu.yml"]
    if args.engine == "docker":
        files.append(REPO / "deploy/compose/cpu-docker.yml")
    files.append(REPO / "deploy/compose/cells.yml")
    if args.standins:
        files.append(REPO / "deploy/compose/standins.yml")
        files.append(REPO / "deploy/compose/cells-standins.yml")
    files.append(REPO / "deploy/compose/stack-test.yml")
    web_port, s3_port, door_port = free_port(), free_port(), free_port()
    env = {
        "WEB_PORT": str(web_port),
        "FRONTDOOR_PORT": str(door_port),
        "MINIO_CONSOLE_PORT": str(free_port()),
        "STACK_S3_PORT": str(s3_port),
        "STREAM_SECRET": secrets.token_urlsafe(32),
    }
    stack = Stack(args.engine, args.project, files, env)
    scratch = args.scratch / "drive"
    shutil.rmtree(scratch, ignore_errors=True)  # no frame of an earlier run can pass for this one
    scratch.mkdir(parents=True)
    started = time.monotonic()
    ok = False
    try:
        stack.compose("down", "-v", check=False)  # a previous run's leftovers, if any
        journey(stack, f"http://127.0.0.1:{web_port}", f"http://127.0.0.1:{s3_port}/", scratch,
                f"http://127.0.0.1:{door_port}")  # fmt: skip
        ok = True
    except StackError as exc:
        print(f"stack: FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            with phase("teardown (compose down -v)"):
                stack.compose("down", "-v", check=False)
                if stack.engine == "podman":  # podman-compose 1.0 leaves the network behind
                    stack.engine_cmd("network", "rm", f"{stack.project}_default", check=False)
    print("stack: phase timings")
    for name, took in PHASES:
        print(f"stack:   {took:7.1f} s  {name}")
    print(f"stack:   {time.monotonic() - started:7.1f} s  total", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
