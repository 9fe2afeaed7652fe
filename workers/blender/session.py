"""The Blender child's session: the device it renders on, the .blend it keeps open between
requests, and the loop that answers the worker's requests (framed by workers.wire)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import bpy

from workers import containment, wire
from workers.blender import denoise, gpu, inspection, outputs, probe, render
from workers.blender.errors import ChildError, blender_message
from workers.blender.process import log


class Session:
    """The child's state: the device it renders on and the .blend it keeps open between tiles."""

    def __init__(self, device: str, gpu_backend: str | None, threads: int) -> None:
        self.device_kind = device
        self.threads = threads
        self.device_name: str | None = "CPU" if device == "cpu" else None
        self.device_error: str | None = None
        self.open_key: tuple[str, int, int, str] | None = None
        self.report: dict[str, Any] | None = None
        #: external paths of the open file outside its file set, as written (made missing)
        self.cut: list[str] = []
        #: the file's own per-render settings, restored before each render that does not ask
        #: for something else (the kept-open file serves jobs with different options)
        self.saved: dict[str, Any] = {}
        if device == "gpu":
            try:
                self.device_name = gpu.setup(gpu_backend)
            except ChildError as exc:
                self.device_error = exc.message

    # -- opening

    def open(self, path: str, root: str | None = None) -> dict[str, Any]:
        """Open ``path`` (kept open for later requests) cut off every external file outside
        ``root``, the job's file set (the .blend's folder when None)."""
        path = os.path.abspath(path)
        root = os.path.abspath(root) if root else os.path.dirname(path)
        name = os.path.basename(path)
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ChildError(
                "bad_blend_file", f"cannot read {name}: {exc.strerror}", path=path
            ) from None
        key = (path, st.st_mtime_ns, st.st_size, root)
        reused = key == self.open_key
        if reused and self.report is not None:
            # The kept file is only as good as a fresh load if its external files (libraries,
            # textures) are still there, or still missing, as they were when it was loaded.
            reused = inspection.missing_files(root, self.cut) == self.report["missing_files"]
        if not reused:
            self.open_key = None
            self.report = None
            t0 = time.perf_counter()
            try:
                bpy.ops.wm.open_mainfile(filepath=path, load_ui=False, use_scripts=False)
            except RuntimeError as exc:
                raise ChildError(
                    "bad_blend_file",
                    f"Blender cannot open {name}: {blender_message(exc)}",
                    path=path,
                ) from None
            libraries = [lib.filepath for lib in bpy.data.libraries]
            # Before anything reads an image or a cache (inspection reads image sizes).
            self.cut = containment.contain(bpy, root)
            log("opened", path=path, open_s=round(time.perf_counter() - t0, 3),
                outside=len(self.cut))  # fmt: skip
            self.open_key = key
            self.saved = render.file_settings(bpy.context.scene)
            # Inspect now, before any render changes engine, resolution or denoising.
            self.report = inspection.report(
                path, libraries, inspection.missing_files(root, self.cut)
            )
        return {
            "path": path,
            "reused": reused,
            "autoexec_fail": bool(bpy.app.autoexec_fail),
            "autoexec_fail_message": bpy.app.autoexec_fail_message or "",
        }

    def inspect(self, path: str, root: str | None = None) -> dict[str, Any]:
        self.open(path, root)
        assert self.report is not None
        return self.report

    # -- rendering

    def pick_device(self, req: dict[str, Any]) -> tuple[str, str | None]:
        """("GPU" or "CPU", why a GPU render fell back to the CPU) for this request.

        A tile never silently leaves the GPU: without ``allow_cpu_fallback`` an unusable GPU or
        backend is an error naming the reason.
        """
        if self.device_kind != "gpu":
            return "CPU", None
        asked = req.get("backend")
        problem = self.device_error
        if problem is None and asked and str(asked).upper() != self.device_name:
            try:
                self.device_name = gpu.setup(str(asked))
            except ChildError as exc:
                problem = f"the job asks for the {str(asked).upper()} backend: {exc.message}"
        if problem is None:
            return "GPU", None
        if req.get("allow_cpu_fallback"):
            log("cpu_fallback", reason=problem)
            return "CPU", problem
        raise ChildError("device_unavailable", problem, backend=asked)


def serve(session: Session, cmd_fd: int, reply_fd: int) -> int:
    """Answer the worker's requests until it asks to quit or closes the pipe. A request that
    cannot be read leaves the pipe out of step: the child exits 1 (the worker sees it die)."""
    ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "ping": lambda req: {
            "pid": os.getpid(),
            "blender": bpy.app.version_string,
            "device": session.device_name,
            "device_error": session.device_error,
        },
        "open": lambda req: session.open(req["path"], req.get("root")),
        "inspect": lambda req: session.inspect(req["path"], req.get("root")),
        "render": lambda req: render.render(session, req),
        "denoise": lambda req: denoise.denoise(session, req),
        "convert": lambda req: outputs.convert(session, req),
        "probe": lambda req: probe.probe(session, req),
    }
    while True:
        try:
            req = wire.read_message(cmd_fd)
        except wire.WireError as exc:
            log("wire_error", error=str(exc))
            return 1
        if req is None:
            return 0
        op = req.get("op")
        if op == "quit":
            wire.write_message(reply_fd, {"ok": True, "result": {}})
            return 0
        try:
            if op not in ops:
                raise ChildError("bad_parameter", f"unknown operation {op!r}")
            reply: dict[str, Any] = {"ok": True, "result": ops[op](req)}
        except ChildError as exc:
            reply = {"ok": False, "error": exc.code, "message": exc.message, "fields": exc.fields}
        except Exception as exc:  # the child keeps serving whatever one request did
            log("op_failed", op=op, error=repr(exc))
            reply = {
                "ok": False,
                "error": "render_failed",
                "message": f"{op} failed: {blender_message(exc)}",
                "fields": {"exception": type(exc).__name__},
            }
        try:
            wire.write_message(reply_fd, reply)
        except wire.WireError as exc:
            # refused before a byte was written: the pipe is still in step for this answer
            log("wire_error", op=op, error=str(exc))
            wire.write_message(
                reply_fd,
                {"ok": False, "error": "render_failed", "message": f"{op} failed: {exc}"},
            )


def run(
    device: str, gpu_backend: str | None, threads: int, cmd_fd: int, reply_fd: int, import_s: float
) -> int:
    """Serve on the two pipes (``import_s``: the seconds importing bpy and this package took)."""
    bpy.context.preferences.filepaths.use_scripts_auto_execute = False
    log("started", pid=os.getpid(), import_s=round(import_s, 3))
    return serve(Session(device, gpu_backend, threads), cmd_fd, reply_fd)
