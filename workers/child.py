"""The render worker's handle on its long-lived Blender child process (spawn, talk, time out, kill).

The child (workers/blender/) keeps the opened .blend between tiles. This side never imports
bpy: it speaks workers.wire's messages over two pipes and turns the child's deaths, timeouts,
unreadable replies and error replies into farm.errors.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import re
import select
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from farm import lifetime, sandbox
from farm.errors import (
    BlenderCrashed,
    RenderError,
    TileAbandoned,
    TileTimeout,
    error_class,
)
from farm.settings import Settings
from farm.tiling import Rect
from workers import wire

log = logging.getLogger("tessera.worker")

#: time allowed for a fresh child to import bpy and answer its first ping
START_TIMEOUT_S = 120.0
#: children that die (or hang) while starting, in a row, before a start gives up
START_ATTEMPTS = 5
#: seconds before the second start; doubled before each further one, up to START_BACKOFF_MAX_S
START_BACKOFF_S = 0.5
START_BACKOFF_MAX_S = 8.0
#: lines of the child's log quoted in a crash report
LOG_TAIL_LINES = 20

_PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: the only environment a sandboxed child gets (no FARM_*, no credentials of the worker's)
CHILD_ENV = frozenset({"PYTHONPATH", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "LANG"})


class BlenderChild(lifetime.ChildHandle):
    """One Blender child process; requests start it lazily, so a crash costs one request.

    Not thread-safe: one request at a time (``cancel`` and ``interrupt`` excepted). The child
    arms PR_SET_PDEATHSIG, which Linux fires when the *thread* that spawned it exits; start it
    from a long-lived thread.
    """

    def __init__(
        self,
        *,
        python: str,
        work_dir: Path,
        device: str = "cpu",
        gpu_index: int | None = None,
        gpu_backend: str | None = None,
        threads: int = 0,
        name: str = "blender",
        settings: Settings | None = None,
    ) -> None:
        self.python = python
        self.work_dir = Path(work_dir)
        self.device = device
        self.gpu_index = gpu_index
        self.gpu_backend = gpu_backend
        self.threads = threads
        self.name = name
        #: the farm's settings: the child then runs sandboxed (farm.sandbox, FARM_SANDBOX)
        self.settings = settings
        self._box: sandbox.Sandboxed | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._cmd_fd: int | None = None
        self._reply_fd: int | None = None
        #: a pipe another thread writes to stop the request in flight (``cancel``)
        self._cancel_r: int | None = None
        self._cancel_w: int | None = None
        self._cancel_why = ""
        self._in_flight = False
        self._lock = threading.Lock()
        #: the worker gave up its work (``interrupt``): a child killed while starting is then
        #: not started again
        self._interrupted = False
        self._log_path: Path | None = None
        self.blender_version: str | None = None
        #: the backend the child renders on ("CPU", "OPTIX", ...), None when no GPU was found
        self.device_name: str | None = None
        #: why the asked-for device is unusable; renders then raise DeviceUnavailable
        self.device_error: str | None = None
        #: seconds the last start took, from spawn to the first ping reply
        self.start_s: float | None = None
        self._started_at = 0.0
        #: the project and file set the child serves (see ``use``); None until bound
        self.project: str | None = None
        self.root: Path | None = None
        self.local = False
        #: times ``use`` stopped a running child to serve another project or file set
        self.switches = 0

    # --- lifecycle -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        """The current (or last) child's log: Blender's stdout and stderr."""
        return self._log_path

    @classmethod
    def for_settings(cls, settings: Settings, name: str) -> BlenderChild:
        """The child of worker ``name``: its device, GPU, backend and thread count."""
        return cls(
            python=settings.python,
            work_dir=settings.work_dir / name,
            device=settings.device,
            gpu_index=settings.gpu_index,
            gpu_backend=settings.gpu_backend,
            threads=settings.cpu_threads,
            name=name,
            settings=settings,
        )

    def start(self, wait: bool = True) -> None:
        """Spawn the child (if it is not running) and wait for its first ping reply.

        With ``wait=False`` the caller does other work while Blender imports, then calls
        ``wait_ready()`` before any request. A child ``interrupt``ed is not started again: the
        next request fails at once (TileAbandoned), so a stopping worker's task ends instead of
        starting its next step on a new child.
        """
        if self.alive:
            return
        if self._interrupted:
            raise TileAbandoned("the worker is stopping: no Blender child is started again")
        self._spawn()
        if wait:
            self.wait_ready()

    def _spawn(self) -> None:
        self._cleanup()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log_dir = self.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        argv = [
            self.python, "-m", "workers.blender",
            "--cmd-fd", str(cmd_r), "--reply-fd", str(reply_w),
            "--device", self.device, "--threads", str(self.threads),
        ]  # fmt: skip
        if self.gpu_backend:
            argv += ["--gpu-backend", self.gpu_backend]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_PROJECT_ROOT), env.get("PYTHONPATH", "")) if p
        )
        if self.gpu_index is not None:
            # NVML numbers GPUs in PCI order; make CUDA (and so Cycles) count the same way
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_index)
        # The pid names the log, but is known only after the spawn: start under a temp name.
        pending_log = log_dir / f"{self.name}-starting-{os.getpid()}-{id(self)}.log"
        self._started_at = time.monotonic()
        try:
            with open(pending_log, "ab") as log:
                if self.settings is not None:
                    spec = self.sandbox_spec(self.settings, env)
                    self._box = sandbox.spawn(
                        self.settings, spec, argv, stdin=subprocess.DEVNULL, stdout=log,
                        stderr=subprocess.STDOUT, pass_fds=(cmd_r, reply_w),
                    )  # fmt: skip
                    self._proc = self._box.proc
                else:
                    self._proc = self._plain(argv, env, log, (cmd_r, reply_w))
        finally:
            os.close(cmd_r)
            os.close(reply_w)
        self._cmd_fd, self._reply_fd = cmd_w, reply_r
        with self._lock:
            self._cancel_r, self._cancel_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._log_path = log_dir / f"{self.name}-{self._proc.pid}.log"
        os.replace(pending_log, self._log_path)

    @property
    def log_dir(self) -> Path:
        """Where the children's logs go: beside the scratch folder when sandboxed, so that a
        child never reads an earlier child's (another project's) log."""
        if self.settings is None:
            return self.work_dir
        return self.work_dir.parent / f"{self.work_dir.name}-logs"

    def sandbox_spec(self, settings: Settings, env: dict[str, str]) -> sandbox.SandboxSpec:
        """What the sandboxed child sees: the Python runtime (interpreter, venv with bpy, the
        farm's source) and the job's file set read-only, its scratch folder read-write, the
        GPU's device nodes; no network, no other environment than ``env``; the limits of
        FARM_BLENDER_*."""
        python = Path(self.python)
        # the interpreter's own installation and, for a venv's, the one it links to
        prefixes = {python.parent.parent, python.resolve().parent.parent}
        ro = [*sandbox.runtime_binds("farm", "workers")]
        ro += [(p, p) for p in sorted(prefixes) if p.is_absolute() and p != Path("/")]
        if self.root is not None:
            ro.append((self.root, self.root))
        devices: tuple[Path, ...] = ()
        if self.device == "gpu":
            devices = tuple(Path(p) for p in sorted(glob.glob("/dev/nvidia*")))
        spec = sandbox.SandboxSpec(
            name=re.sub(r"[^A-Za-z0-9_.-]", "_", f"blender-{self.name}")[:64],
            ro_binds=tuple(dict.fromkeys(ro)),
            rw_binds=((self.work_dir, self.work_dir),),
            env={k: v for k, v in env.items() if k in CHILD_ENV},
            limits=sandbox.Limits(
                memory_mib=settings.blender_memory_mib,
                pids=settings.blender_pids,
                cpu_cores=settings.blender_cpu_cores,
            ),
            uid=settings.sandbox_uid,
            gid=settings.sandbox_gid,
            chdir=self.work_dir,
            devices=devices,
            as_caller=self.local,
        )
        if self.local:
            # read and written as the caller: an earlier child may have had it as the sandbox's
            self.work_dir.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                os.chown(self.work_dir, os.getuid(), os.getgid())
        else:
            sandbox.owned_dir(self.work_dir, spec)
        return spec

    def writable(self, folder: Path) -> Path:
        """``folder`` (inside the scratch folder) made, and writable by the sandboxed child."""
        folder.mkdir(parents=True, exist_ok=True)
        sandboxed = self.settings is not None and self.settings.sandbox != "none"
        if sandboxed and not self.local and os.geteuid() == 0:
            assert self.settings is not None
            os.chown(folder, self.settings.sandbox_uid, self.settings.sandbox_gid)
        return folder

    def _plain(
        self, argv: list[str], env: dict[str, str], log: IO[bytes], fds: tuple[int, int]
    ) -> subprocess.Popen[bytes]:
        """The child as a plain subprocess (no settings: tests of the child itself)."""
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=fds,
            cwd=self.work_dir,
            env=env,
            # its own process group: a terminal's Ctrl-C or a group SIGTERM reaches the
            # worker, which decides whether the tile in hand finishes (workers.shutdown)
            process_group=0,
        )

    def wait_ready(self) -> None:
        """Wait for the started child's first reply: bpy imported, devices set up.

        A child that dies or hangs while starting is replaced by a new one, after a pause that
        doubles each time (START_BACKOFF_S...); after START_ATTEMPTS such children in a row the
        last one's error is raised, saying so. Where a sandbox cannot start at all, the first
        failure raises farm.sandbox's SetupError naming why: the child's own start is the
        sandbox's trial, so a worker whose child starts runs no other.
        """
        failures = 0
        while True:
            try:
                result = self._call({"op": "ping"}, START_TIMEOUT_S, "starting", start=False)
                break
            except RenderError as exc:  # died, hung, or answered nonsense while starting
                failures += 1
                self.kill()
                if self._interrupted:
                    raise  # killed on purpose (a stopping worker's grace ran out): no retry
                log.warning("event=child_start_failed worker=%s attempt=%d of=%d error=%s "
                            "message=%r log=%s", self.name, failures, START_ATTEMPTS, exc.code,
                            exc.message, self._log_path)  # fmt: skip
                if failures == 1 and self.settings is not None and self.settings.sandbox != "none":
                    sandbox.check(self.settings)  # SetupError where no sandbox starts at all
                if failures >= START_ATTEMPTS:
                    raise type(exc)(
                        f"Blender could not start: {failures} children in a row failed while "
                        f"starting, the last one: {exc.message}",
                        start_attempts=failures,
                        **exc.fields,
                    ) from exc
                # a pause between starts, not a synchronisation: a fault that passes (memory
                # pressure, a full disk) gets time to, and a lasting one costs no busy loop
                time.sleep(min(START_BACKOFF_S * 2 ** (failures - 1), START_BACKOFF_MAX_S))
                self._spawn()
        self.start_s = time.monotonic() - self._started_at
        self.blender_version = result.get("blender")
        self.device_name = result.get("device")
        self.device_error = result.get("device_error")

    def stop(self, timeout_s: float = 5) -> None:
        """Ask the child to quit; SIGKILL it if it has not exited within ``timeout_s``."""
        if self.alive and self._cmd_fd is not None:
            try:
                self._send({"op": "quit"})
                assert self._proc is not None
                self._proc.wait(timeout=timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the child and reap it; safe to call at any time."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait()
        self._cleanup()

    def interrupt(self) -> None:
        """SIGKILL the child from another thread than the one talking to it, for good: a child
        killed while starting is not replaced (``wait_ready``).

        Only the signal: the talking thread sees the reply pipe close, reaps the child and
        closes the pipes itself (closing them here would pull them from under its read).
        """
        self._interrupted = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()  # bubblewrap's --die-with-parent takes the sandbox with it

    def cancel(self, why: str) -> bool:
        """Stop the request in flight, from another thread, unless its reply has come.

        The talking thread decides, so a child that finished is never killed: when the reply is
        there it is returned as usual (the caller then knows, e.g. from its lease, not to use
        it); else the child is killed and the request raises RenderError saying ``why``.
        Returns whether a request was in flight.
        """
        with self._lock:
            if not self._in_flight or self._cancel_w is None:
                return False
            self._cancel_why = why
            with contextlib.suppress(BlockingIOError):  # one byte already waits: enough
                os.write(self._cancel_w, b"x")
            return True

    def _cleanup(self) -> None:
        if self._box is not None:
            # the sandbox's every process (a fork Blender left behind included) and its cgroup
            self._box.close()
            self._box = None
        for fd in (self._cmd_fd, self._reply_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._cmd_fd = self._reply_fd = None
        with self._lock:
            for fd in (self._cancel_r, self._cancel_w):
                if fd is not None:
                    os.close(fd)
            self._cancel_r = self._cancel_w = None

    def use(self, project: str | None, root: Path, local: bool = False) -> bool:
        """Serve ``project``'s file set ``root`` (the job's .blend folder or unpacked zip).

        A child never serves two projects, nor two file sets: when either changes, the running
        child is stopped and the next request starts a fresh one, which sees only the new file
        set. ``project`` None is an inspection that names none: its child has only opened that
        file set's .blend, so a job of any project on the same files takes it over (a crash the
        file causes is then its own job's); a child that served a project never goes back.
        ``local``: the files are the caller's own on this machine (``farm render FILE``), read
        as the caller (farm.sandbox's ``as_caller``). Returns whether the child was switched.

        The old child is killed, not asked to quit: it holds nothing to save (every output is
        written whole), and Blender's teardown (about 0.1 s here, more under load; up to
        ``stop``'s 5 s for a child that hangs in it) would be paid by the new project's task.
        """
        root = Path(root)
        # ``local`` too: a child started as the caller (``farm worker --local-files``) never
        # serves an upload of the same folder, which runs as the sandbox's user
        same_files = root == self.root and local == self.local
        if same_files and project == self.project:
            return False
        if same_files and self.project is None and project is not None:
            self.project = project
            return False
        switched = self.alive
        if switched:
            self.kill()
            self.switches += 1
        self.project, self.root, self.local = project, root, local
        return switched

    # --- operations ----------------------------------------------------------------------------

    def ping(self, timeout_s: float = 30.0) -> dict[str, Any]:
        return self._call({"op": "ping"}, timeout_s, "answering a ping")

    def open(self, path: Path, timeout_s: float) -> dict[str, Any]:
        """Open ``path`` in the child (kept open for later requests); says whether it was reused."""
        return self._call(
            {"op": "open", "path": str(path)}, timeout_s, f"opening {Path(path).name}"
        )

    def inspect(self, path: Path, timeout_s: float) -> dict[str, Any]:
        """The inspection report of ``path``: frames, size, samples, cameras, missing files..."""
        return self._call(
            {"op": "inspect", "path": str(path)}, timeout_s, f"inspecting {Path(path).name}"
        )

    def probe(
        self,
        path: Path,
        *,
        frames: Sequence[int],
        pixels: int,
        budget_s: float,
        out_dir: Path,
        timeout_s: float,
    ) -> dict[str, Any]:
        """The estimate's probe of ``path`` (workers.blender.probe): small renders of
        ``frames`` at about ``pixels`` pixels, timed, within about ``budget_s`` of rendering."""
        request = {
            "op": "probe",
            "path": str(path),
            "frames": list(frames),
            "pixels": pixels,
            "budget_s": budget_s,
            "out_dir": str(out_dir),
        }
        return self._call(request, timeout_s, f"probing {Path(path).name} for an estimate")

    def render(
        self,
        path: Path,
        *,
        frame: int,
        width: int,
        height: int,
        rect: Rect | None,
        samples: int | None,
        out_path: Path,
        timeout_s: float,
        options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Render ``rect`` of ``frame`` (the whole frame when None) to a 32-bit float RGBA EXR.

        ``options`` (see workers.blender.render.render): ``layers`` (a multilayer EXR of
        every pass), ``denoise_data``, ``sample_subset`` [offset, count], ``adaptive``,
        ``backend``, ``allow_cpu_fallback``.
        """
        where = f"tile x {rect.x0}-{rect.x1}, y {rect.y0}-{rect.y1}" if rect is not None else "full"
        request = {
            **(options or {}),
            "op": "render",
            "path": str(path),
            "frame": frame,
            "width": width,
            "height": height,
            "rect": [rect.x0, rect.y0, rect.x1, rect.y1] if rect is not None else None,
            "samples": samples,
            "out_path": str(out_path),
        }
        return self._call(
            request,
            timeout_s,
            f"rendering frame {frame} ({where}) of {Path(path).name}",
            frame=frame,
            rect=request["rect"],
        )

    def denoise(
        self, path: Path, in_path: Path, out_path: Path, timeout_s: float
    ) -> dict[str, Any]:
        """Denoise a stitched multilayer frame once (OIDN, Cycles' standalone denoiser)."""
        request = {
            "op": "denoise",
            "path": str(path),
            "in_path": str(in_path),
            "out_path": str(out_path),
        }
        return self._call(request, timeout_s, f"denoising {Path(in_path).name}")

    def convert(
        self,
        path: Path,
        exr_in: Path,
        outputs: Sequence[dict[str, Any]],
        timeout_s: float,
        *,
        layers_in: Path | None = None,
        frame: int | None = None,
        composite: bool = True,
    ) -> dict[str, Any]:
        """Write ``exr_in`` (a linear frame) as each output, with the scene's colour management.

        Each output is ``{"path", "format": "PNG"|"JPEG"|"OPEN_EXR", "color_depth", "quality"}``.
        When the scene composites, the outputs are its compositor's result for ``frame``, fed
        from ``layers_in`` (the frame's multilayer EXR of every pass) instead of a render;
        ``composite`` False skips the compositor (a live-preview pass shows the render).
        """
        request: dict[str, Any] = {
            "op": "convert",
            "path": str(path),
            "exr_in": str(exr_in),
            "outputs": [{**o, "path": str(o["path"])} for o in outputs],
        }
        if layers_in is not None:
            request["layers_in"] = str(layers_in)
        if frame is not None:
            request["frame"] = frame
        if not composite:
            request["composite"] = False
        return self._call(request, timeout_s, f"converting {Path(exr_in).name}")

    # --- protocol ------------------------------------------------------------------------------

    def _send(self, message: dict[str, Any]) -> None:
        assert self._cmd_fd is not None
        wire.write_message(self._cmd_fd, message)

    def _call(
        self,
        message: dict[str, Any],
        timeout_s: float,
        doing: str,
        *,
        start: bool = True,
        **context: Any,
    ) -> dict[str, Any]:
        if start:
            self.start()
        if self.root is not None and "path" in message:
            message = {**message, "root": str(self.root)}
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._in_flight = True
            if self._cancel_r is not None:
                with contextlib.suppress(BlockingIOError):  # a cancel of an earlier request
                    os.read(self._cancel_r, 64)
        try:
            self._send(message)
        except BrokenPipeError:
            raise self._crashed(doing, context) from None
        except wire.WireError as exc:
            # refused before a byte was written: the child is still in step
            raise RenderError(f"{doing} was not asked of Blender: {exc}", **context) from None
        try:
            reply = self._receive(deadline, timeout_s, doing, context)
        finally:
            with self._lock:
                self._in_flight = False
        if reply.get("ok"):
            result: dict[str, Any] = reply.get("result", {})
            return result
        code = str(reply.get("error", "render_failed"))
        fields = dict(reply.get("fields") or {})
        cls = error_class(code, default=RenderError)
        if cls is RenderError and code != RenderError.code:
            fields.setdefault("child_error", code)
        raise cls(str(reply.get("message", f"{doing} failed")), **context, **fields)

    def _receive(
        self, deadline: float, timeout_s: float, doing: str, context: dict[str, Any]
    ) -> dict[str, Any]:
        assert self._reply_fd is not None and self._cancel_r is not None
        poller = select.poll()
        poller.register(self._reply_fd, select.POLLIN)
        poller.register(self._cancel_r, select.POLLIN)
        decoder = wire.Decoder()
        replying = False
        while True:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                pid = self.pid
                self.kill()
                raise TileTimeout(
                    f"Blender took longer than the {timeout_s:g} s limit {doing}; "
                    "the Blender child was killed",
                    timeout_s=timeout_s,
                    pid=pid,
                    **context,
                )
            ready = {fd for fd, _ in poller.poll(math.ceil(left_s * 1000))}
            if not ready:
                continue
            if self._reply_fd not in ready:
                with self._lock:
                    why = self._cancel_why
                pid = self.pid
                self.kill()
                raise RenderError(
                    f"{doing} was stopped ({why}); the Blender child was killed",
                    pid=pid,
                    stopped=why,
                    **context,
                )
            if not replying:
                # the reply is on its way (or the child died): nothing is left to stop
                replying = True
                poller.unregister(self._cancel_r)
            chunk = os.read(self._reply_fd, 1 << 16)
            if not chunk:
                raise self._crashed(doing, context)
            try:
                reply = decoder.feed(chunk)
            except wire.WireError as exc:
                # the reply pipe is out of step: no later reply could be trusted either
                pid = self.pid
                self.kill()
                raise RenderError(
                    f"Blender's reply could not be read while {doing} ({exc}); "
                    "the Blender child was killed",
                    pid=pid,
                    **context,
                ) from None
            if reply is not None:
                return reply

    def _crashed(self, doing: str, context: dict[str, Any]) -> BlenderCrashed:
        """Reap the dead child and describe its death (signal or exit code, last log lines)."""
        assert self._proc is not None
        pid = self._proc.pid
        try:
            # EOF on the reply pipe comes as the child exits; give the exit a moment to land.
            status = self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            status = self._proc.wait()
        self._cleanup()
        tail = self._log_tail()
        if self.settings is not None and 128 < status < 128 + 65:
            status = 128 - status  # bubblewrap reports a child's death by signal N as 128 + N
        if status < 0:
            sig_name = signal.Signals(-status).name
            how = f"Blender crashed ({sig_name}, signal {-status})"
            exit_code: int | None = None
        else:
            sig_name = None
            how = f"Blender exited with status {status}"
            exit_code = status
        # Blender's log holds server paths and other files' names: operators and the tile's
        # own log get it (``log_tail``), the user's message does not.
        return BlenderCrashed(
            f"{how} while {doing}",
            exit_code=exit_code,
            signal=sig_name,
            pid=pid,
            log_path=str(self._log_path),
            log_tail=tail,
            **context,
        )

    def log_mark(self) -> tuple[Path | None, int]:
        """Where the child's log ends now; ``log_since`` gives what a request added after it."""
        path = self._log_path
        try:
            return path, path.stat().st_size if path is not None else 0
        except OSError:
            return path, 0

    def log_since(self, mark: tuple[Path | None, int], limit_bytes: int = 64 * 1024) -> list[str]:
        """Blender's log lines written since ``mark`` (at most the last ``limit_bytes``); all of
        a child's log when that child started after the mark."""
        path, offset = mark
        if self._log_path is None:
            return []
        if self._log_path != path:
            offset = 0
        try:
            with open(self._log_path, "rb") as log:
                end = log.seek(0, os.SEEK_END)
                log.seek(max(offset, end - limit_bytes))
                text = log.read(end - log.tell()).decode("utf-8", "replace")
        except OSError:
            return []
        return text.splitlines()

    def _log_tail(self) -> list[str]:
        if self._log_path is None:
            return []
        try:
            with open(self._log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 64 * 1024))
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return []
        return list(deque(text.splitlines(), maxlen=LOG_TAIL_LINES))
