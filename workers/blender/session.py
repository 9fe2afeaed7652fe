"""The program inside the Blender child process: the only module that imports bpy.

Run as ``python -m workers.blender_child --cmd-fd N --reply-fd M [--device cpu|gpu]
[--gpu-backend X] [--threads N]``. Requests and replies are length-prefixed JSON (4-byte
big-endian length, then UTF-8) on the two pipe fds; Blender's own output goes to stdout/stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import signal
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from farm.lifetime import arm_parent_death_signal
from farm.settings import GPU_BACKENDS
from farm.tiling import Rect, border_floats
from workers import containment, redaction
from workers.backends import choose_backend
from workers.exr import read_layers, read_size, write_layers

# bpy is imported in main(), after the parent-death signal is armed.
bpy: Any = None

_IOLBF = 1


class ChildError(Exception):
    """An error reply: ``code`` is a farm.errors code the parent maps back to its class."""

    def __init__(self, code: str, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields


def log(event: str, **fields: Any) -> None:
    """One key=value line on stderr (line-buffered), so the parent's log tail shows our steps."""
    parts = " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items())
    print(f"tessera-child event={event} {parts}", file=sys.stderr, flush=True)


# --- process set-up (before bpy) ---------------------------------------------------------------


def _line_buffer_c_stdout() -> None:
    """Blender prints through C stdio; line-buffer it so a crash's last lines reach the log."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        c_stdout = ctypes.c_void_p.in_dll(libc, "stdout")
        libc.setvbuf(c_stdout, None, _IOLBF, 0)
    except (OSError, ValueError):
        pass


# --- protocol ----------------------------------------------------------------------------------


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = os.read(fd, size - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return bytes(chunks)


def read_message(fd: int) -> dict[str, Any] | None:
    """The next request, or None when the parent closed the pipe."""
    head = _read_exact(fd, 4)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack(">I", head)[0])
    if body is None:
        return None
    message: dict[str, Any] = json.loads(body.decode("utf-8"))
    return message


def write_message(fd: int, message: dict[str, Any]) -> None:
    body = json.dumps(message).encode("utf-8")
    data = struct.pack(">I", len(body)) + body
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# --- the open file -----------------------------------------------------------------------------


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
                self.device_name = _setup_gpu(gpu_backend)
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
            reused = _missing_files(root, self.cut) == self.report["missing_files"]
        if not reused:
            self.open_key = None
            self.report = None
            t0 = time.perf_counter()
            try:
                bpy.ops.wm.open_mainfile(filepath=path, load_ui=False, use_scripts=False)
            except RuntimeError as exc:
                raise ChildError(
                    "bad_blend_file",
                    f"Blender cannot open {name}: {_blender_message(exc)}",
                    path=path,
                ) from None
            libraries = [lib.filepath for lib in bpy.data.libraries]
            # Before anything reads an image or a cache (inspection reads image sizes).
            self.cut = containment.contain(bpy, root)
            log("opened", path=path, open_s=round(time.perf_counter() - t0, 3),
                outside=len(self.cut))  # fmt: skip
            self.open_key = key
            self.saved = _file_settings(bpy.context.scene)
            # Inspect now, before any render changes engine, resolution or denoising.
            self.report = _inspect(path, libraries, _missing_files(root, self.cut))
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

    def _pick_device(self, req: dict[str, Any]) -> tuple[str, str | None]:
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
                self.device_name = _setup_gpu(str(asked))
            except ChildError as exc:
                problem = f"the job asks for the {str(asked).upper()} backend: {exc.message}"
        if problem is None:
            return "GPU", None
        if req.get("allow_cpu_fallback"):
            log("cpu_fallback", reason=problem)
            return "CPU", problem
        raise ChildError("device_unavailable", problem, backend=asked)

    def render(self, req: dict[str, Any]) -> dict[str, Any]:
        cycles_device, fallback = self._pick_device(req)
        opened = self.open(req["path"], req.get("root"))
        scene = bpy.context.scene
        width, height = int(req["width"]), int(req["height"])
        out_path = Path(req["out_path"]).absolute()
        _prepare_scene(scene, width, height, req.get("samples"), req.get("rect"))
        layers = _prepare_passes(scene, self.saved, req)
        scene.cycles.device = cycles_device
        if self.threads > 0:
            scene.render.threads_mode = "FIXED"
            scene.render.threads = self.threads
        else:
            scene.render.threads_mode = "AUTO"
        scene.frame_set(int(req["frame"]))
        # after frame_set: timeline markers may switch the camera per frame
        if scene.camera is None:
            raise ChildError(
                "no_camera", f"scene {scene.name!r} of {Path(req['path']).name} has no camera"
            )

        settings = scene.render.image_settings
        if req.get("layers"):
            # Every pass of every view layer. Blender 5 writes one EXR part per pass unless told
            # to interleave; readers that see one part (OpenImageIO in Cycles' denoiser, most
            # tools) then find only Combined, which is why "only Combined was written" was seen.
            settings.media_type = "MULTI_LAYER_IMAGE"
            settings.file_format = "OPEN_EXR_MULTILAYER"
            settings.use_exr_interleave = True
        else:
            settings.media_type = "IMAGE"  # Blender 5: video-output files refuse file_format
            settings.file_format = "OPEN_EXR"
            settings.color_mode = "RGBA"
        settings.color_depth = "32"
        settings.exr_codec = "ZIP"
        tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex}.tmp.exr")
        scene.render.filepath = str(tmp)
        scene.render.use_file_extension = False
        log("render", frame=req["frame"], rect=req.get("rect"), out=str(out_path))
        # With persistent data Cycles re-reads its settings only when the scene is tagged, and
        # setting add-on properties (scene.cycles.samples, device) alone does not tag it:
        # measured with bpy 5.0.1, a samples change was otherwise silently ignored.
        scene.update_tag()
        t0 = time.perf_counter()
        try:
            bpy.ops.render.render(write_still=True, scene=scene.name)
            render_s = time.perf_counter() - t0
            if not tmp.is_file():
                raise ChildError("render_failed", f"Blender wrote no image for {out_path.name}")
            if req.get("layers") and len(layers) > 1:
                # The file lists passes by name only; say which view layer is the image.
                image = read_layers(tmp)
                image.attrs["tessera/layers"] = "\n".join(layers)
                write_layers(tmp, image)
            os.replace(tmp, out_path)
        finally:
            tmp.unlink(missing_ok=True)
        # The Render Result image reports 0x0 until its pixels are read: ask the file.
        width_px, height_px = read_size(out_path)
        return {
            "out_path": str(out_path),
            "width": width_px,
            "height": height_px,
            "render_s": round(render_s, 4),
            "autoexec_fail": opened["autoexec_fail"],
            "device": self.device_name if cycles_device == "GPU" else "CPU",
            "fallback": fallback,
            "layers": layers,
            "samples": int(scene.cycles.samples),
        }

    # -- denoising the stitched (or merged) frame

    def denoise(self, req: dict[str, Any]) -> dict[str, Any]:
        """Denoise a single-part multilayer EXR with Cycles' standalone denoiser (OIDN).

        The input holds each view layer's noisy Combined, Denoising Normal, Denoising Albedo and
        Vector passes and ``cycles.<layer>.samples``; the output is the same file with every
        layer's Combined RGB denoised. One call for the whole frame, never per tile.
        """
        # Cycles' own Python module, present once bpy is imported (no stubs: typed as a module)
        _cycles = importlib.import_module("_cycles")

        self.open(req["path"], req.get("root"))
        scene = bpy.context.scene
        if not getattr(_cycles, "with_openimagedenoise", False):
            raise ChildError("render_failed", "this Blender build has no OpenImageDenoise")
        scene.cycles.denoiser = "OPENIMAGEDENOISE"
        src = Path(req["in_path"]).absolute()
        out_path = Path(req["out_path"]).absolute()
        tmp = out_path.with_name(f".{out_path.name}.{uuid.uuid4().hex}.tmp.exr")
        t0 = time.perf_counter()
        try:
            _cycles.denoise(
                bpy.context.preferences.as_pointer(),
                scene.as_pointer(),
                scene.view_layers[0].as_pointer(),
                input=[str(src)],
                output=[str(tmp)],
            )
            if not tmp.is_file():
                raise ChildError("render_failed", f"the denoiser wrote no image for {src.name}")
            os.replace(tmp, out_path)
        except RuntimeError as exc:
            raise ChildError(
                "render_failed", f"denoising {src.name} failed: {_blender_message(exc)}"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)
        return {"out_path": str(out_path), "denoise_s": round(time.perf_counter() - t0, 4)}

    # -- converting to delivery formats

    def convert(self, req: dict[str, Any]) -> dict[str, Any]:
        """Write the frame as each output; a scene that composites gets its compositor's result.

        ``exr_in`` is the linear RGBA frame; ``layers_in`` (the stitched multilayer EXR of every
        pass) is what the compositor reads in place of its Render Layers nodes.
        """
        self.open(req["path"], req.get("root"))
        scene = bpy.context.scene
        tree = _compositor_tree(scene, self.saved)
        if tree is not None:
            return self._convert_composited(scene, tree, req)
        settings = scene.render.image_settings
        saved = _image_settings(settings)
        image = bpy.data.images.load(str(Path(req["exr_in"]).absolute()), check_existing=False)
        try:
            return {"outputs": _save_outputs(image, scene, req["outputs"])}
        finally:
            bpy.data.images.remove(image)
            _restore_image_settings(settings, saved)

    def _convert_composited(self, scene: Any, tree: Any, req: dict[str, Any]) -> dict[str, Any]:
        """Run the scene's compositor on the stitched passes, then save its result."""
        if not req.get("layers_in"):
            raise ChildError(
                "bad_parameter",
                f"scene {scene.name!r} composites its render (node tree {tree.name!r}): "
                "its outputs need the frame's passes, which this job did not render",
            )
        layers_in = Path(req["layers_in"]).absolute()
        width, height = read_size(layers_in)
        render = scene.render
        names = ("resolution_x", "resolution_y", "resolution_percentage", "use_border",
                 "use_crop_to_border", "use_compositing", "use_sequencer", "use_stamp")  # fmt: skip
        saved_render = {name: getattr(render, name) for name in names}
        settings = render.image_settings
        saved_settings = _image_settings(settings)
        image = bpy.data.images.load(str(layers_in), check_existing=False)
        copies: dict[int, Any] = {}
        try:
            scene.compositing_node_group = _fed_copy(tree, image, scene, copies)
            render.resolution_x, render.resolution_y = width, height
            render.resolution_percentage = 100
            render.use_border = render.use_crop_to_border = False
            render.use_compositing = True
            render.use_sequencer = False
            render.use_stamp = False
            if "frame" in req:
                scene.frame_set(int(req["frame"]))
            t0 = time.perf_counter()
            # No Render Layers node is left, so Blender renders nothing and only composites.
            bpy.ops.render.render(write_still=False, scene=scene.name)
            log("composited", tree=tree.name, s=round(time.perf_counter() - t0, 4))
            result = bpy.data.images["Render Result"]
            return {"outputs": _save_outputs(result, scene, req["outputs"]), "composited": True}
        finally:
            scene.compositing_node_group = tree
            for name, value in saved_render.items():
                setattr(render, name, value)
            _restore_image_settings(settings, saved_settings)
            for copy in copies.values():
                bpy.data.node_groups.remove(copy)
            bpy.data.images.remove(image)


def _save_outputs(image: Any, scene: Any, outputs: list[dict[str, Any]]) -> list[str]:
    """Save ``image`` as each requested output file (format, depth, quality)."""
    settings = scene.render.image_settings
    written = []
    for out in outputs:
        fmt = str(out["format"]).upper()
        target = Path(out["path"]).absolute()
        ext = {"PNG": ".png", "JPEG": ".jpg", "OPEN_EXR": ".exr"}.get(fmt, ".img")
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp{ext}")
        settings.media_type = "IMAGE"
        try:
            settings.file_format = fmt
            settings.color_mode = "RGB" if fmt == "JPEG" else "RGBA"
            if "color_depth" in out and fmt != "JPEG":
                settings.color_depth = str(out["color_depth"])
            if "quality" in out:
                settings.quality = int(out["quality"])
            if fmt == "OPEN_EXR":
                settings.exr_codec = "ZIP"
        except TypeError as exc:
            raise ChildError(
                "bad_parameter", f"output {target.name}: {exc}", path=str(target)
            ) from None
        try:
            # save_render applies the scene's view transform, look, exposure and
            # display (or the output's override), as a final render's file gets.
            image.save_render(str(tmp), scene=scene)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(str(target))
    return written


def _blender_message(exc: BaseException) -> str:
    """Blender's message for the user: its lines joined, paths cut to file names (the full
    text is in this child's log, for operators)."""
    text = str(exc).strip()
    log("blender_error", text=text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    joined = "; ".join(line.removeprefix("Error: ") for line in lines)
    return redaction.public(joined) or type(exc).__name__


def _prepare_scene(
    scene: Any, width: int, height: int, samples: int | None, rect: list[int] | None
) -> None:
    render = scene.render
    render.engine = "CYCLES"
    render.use_persistent_data = True
    # OSL shaders can read any image file by name (texture("/any/path")): SVM only.
    scene.cycles.shading_system = False
    # Denoising per tile makes every pixel differ and seams show; the frame is denoised once.
    scene.cycles.use_denoising = False
    render.resolution_x = width
    render.resolution_y = height
    render.resolution_percentage = 100
    if samples is not None:
        scene.cycles.samples = int(samples)
    # The raw render result: compositing, sequencer and burnt-in stamps would act per tile.
    render.use_compositing = False
    render.use_sequencer = False
    render.use_stamp = False
    if rect is None:
        render.use_border = False
        render.use_crop_to_border = False
    else:
        x0, y0, x1, y1 = (int(v) for v in rect)
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ChildError(
                "bad_parameter", f"tile {rect} is not inside the {width}x{height} frame"
            )
        min_x, max_x, min_y, max_y = border_floats(Rect(x0, y0, x1, y1), width, height)
        render.use_border = True
        render.use_crop_to_border = True
        render.border_min_x, render.border_max_x = min_x, max_x
        render.border_min_y, render.border_max_y = min_y, max_y


def _file_settings(scene: Any) -> dict[str, Any]:
    """The settings a render request may change, as the file has them."""
    return {
        # tiles render with compositing off; converting asks whether the file composites
        "compositing": bool(scene.render.use_compositing),
        "adaptive": bool(scene.cycles.use_adaptive_sampling),
        "denoising_passes": {
            vl.name: bool(vl.cycles.denoising_store_passes) for vl in scene.view_layers
        },
    }


def _prepare_passes(scene: Any, saved: dict[str, Any], req: dict[str, Any]) -> list[str]:
    """Set the sample subset, adaptive sampling and denoising passes a request asks for (the
    file's own values otherwise); returns the view layers that render, in order."""
    cycles = scene.cycles
    subset = req.get("sample_subset")
    if subset is None:
        cycles.use_sample_subset = False
    else:
        offset, count = (int(v) for v in subset)
        if not (offset >= 0 and count >= 1 and offset + count <= cycles.samples):
            raise ChildError(
                "bad_parameter",
                f"sample subset {offset}+{count} is outside the {cycles.samples} samples",
            )
        cycles.use_sample_subset = True
        cycles.sample_offset = offset
        cycles.sample_subset_length = count
    adaptive = req.get("adaptive")
    cycles.use_adaptive_sampling = saved.get("adaptive", False) if adaptive is None else adaptive
    originals = saved.get("denoising_passes", {})
    for vl in scene.view_layers:
        vl.cycles.denoising_store_passes = bool(req.get("denoise_data")) or originals.get(
            vl.name, False
        )
    return [vl.name for vl in scene.view_layers if vl.use]


def _compositor_tree(scene: Any, saved: dict[str, Any]) -> Any:
    """The compositor node tree a final render of ``scene`` runs, or None when it runs none.

    Blender 5 keeps it in ``scene.compositing_node_group``; a tree whose output is linked to
    nothing composites nothing.
    """
    if not saved.get("compositing", bool(scene.render.use_compositing)):
        return None
    tree = scene.compositing_node_group
    if tree is None:
        return None
    outputs = [n for n in tree.nodes if n.bl_idname == "NodeGroupOutput"]
    if not any(socket.is_linked for node in outputs for socket in node.inputs):
        return None
    return tree


def _fed_copy(tree: Any, image: Any, scene: Any, copies: dict[int, Any]) -> Any:
    """A copy of the compositor ``tree`` that reads the stitched passes (``image``, a multilayer
    EXR) instead of a render: each Render Layers node becomes an Image node, its outputs linked
    where the Render Layers' were; Cryptomatte nodes read the image; node groups are copied the
    same way. Every copy made is in ``copies`` (original's pointer -> copy), for removal."""
    key = tree.as_pointer()
    if key in copies:
        return copies[key]
    copy = copies[key] = tree.copy()
    for node in list(copy.nodes):
        kind = node.bl_idname
        if kind == "CompositorNodeRLayers":
            _check_own_scene(node, scene)
            _feed_render_layers(copy, node, image)
        elif kind == "CompositorNodeCryptomatteV2" and node.source == "RENDER":
            _check_own_scene(node, scene)
            layer_name = node.layer_name
            node.source = "IMAGE"
            node.image = image
            try:
                node.layer_name = layer_name
            except TypeError:
                raise ChildError(
                    "bad_parameter",
                    f"compositor node {node.name!r} reads Cryptomatte {layer_name!r}, which the "
                    "frame's passes do not hold (enable it in the view layer)",
                ) from None
        elif kind == "CompositorNodeOutputFile":
            # it would write files on the worker, outside the job's outputs
            node.mute = True
        elif getattr(node, "node_tree", None) is not None:
            node.node_tree = _fed_copy(node.node_tree, image, scene, copies)
    return copy


def _check_own_scene(node: Any, scene: Any) -> None:
    if node.scene is not None and node.scene != scene:
        raise ChildError(
            "bad_parameter",
            f"compositor node {node.name!r} reads scene {node.scene.name!r}: the farm "
            f"composites only scene {scene.name!r}'s own render",
        )


def _feed_render_layers(tree: Any, node: Any, image: Any) -> None:
    feed = tree.nodes.new("CompositorNodeImage")
    feed.image = image
    if node.layer:
        try:
            feed.layer = node.layer
        except TypeError:
            raise ChildError(
                "bad_parameter",
                f"compositor node {node.name!r} reads view layer {node.layer!r}, "
                "which the frame's passes do not hold",
            ) from None
    feed.location = node.location
    for link in list(tree.links):
        if link.from_node != node:
            continue
        # the Render Layers' "Image" is the image's Combined pass
        name = "Combined" if link.from_socket.name == "Image" else link.from_socket.name
        source = feed.outputs.get(name)
        if source is None:
            raise ChildError(
                "bad_parameter",
                f"compositor node {node.name!r} uses the {link.from_socket.name!r} pass, "
                "which the frame's passes do not hold (enable it in the view layer)",
            )
        tree.links.new(source, link.to_socket)
    tree.nodes.remove(node)


def _image_settings(settings: Any) -> dict[str, Any]:
    names = ("media_type", "file_format", "color_mode", "color_depth", "quality", "exr_codec")
    return {name: getattr(settings, name) for name in names if hasattr(settings, name)}


def _restore_image_settings(settings: Any, saved: dict[str, Any]) -> None:
    # Order matters: the format decides which colour modes and depths are valid.
    for name, value in saved.items():
        with contextlib.suppress(TypeError, AttributeError, ValueError):
            setattr(settings, name, value)


# --- GPU ---------------------------------------------------------------------------------------


def _setup_gpu(backend: str | None) -> str:
    """Select ``backend`` (or the best that has a device) and enable its GPUs, or raise."""
    prefs = bpy.context.preferences.addons["cycles"].preferences
    found: dict[str, int | None] = {}
    for name in [backend.upper()] if backend else GPU_BACKENDS:
        try:
            prefs.compute_device_type = name
        except TypeError:
            found[name] = None
            continue
        prefs.refresh_devices()
        found[name] = sum(1 for d in prefs.get_devices_for_type(name) if d.type == name)
    chosen, reasons = choose_backend(found, backend)
    if chosen is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ChildError(
            "device_unavailable",
            f"no GPU for Cycles ({'; '.join(reasons)})"
            + (f"; CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""),
            backends=reasons,
        )
    prefs.compute_device_type = chosen
    prefs.refresh_devices()
    devices = prefs.get_devices_for_type(chosen)
    for device in devices:
        # Never mix CPU into GPU tiles: sampling features differ between devices.
        device.use = device.type == chosen
    log("gpu", backend=chosen, devices=[d.name for d in devices if d.type == chosen])
    return chosen


# --- inspection --------------------------------------------------------------------------------


def _ids() -> Iterator[Any]:
    """Every datablock of the open file, with the node trees embedded in them."""
    for attr in dir(bpy.data):
        collection = getattr(bpy.data, attr, None)
        if not isinstance(collection, bpy.types.bpy_prop_collection):
            continue
        for item in collection:
            if not isinstance(item, bpy.types.ID):
                break
            yield item
            tree = getattr(item, "node_tree", None)
            if isinstance(tree, bpy.types.ID):
                yield tree


def _drivers() -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    for item in _ids():
        if item.as_pointer() in seen:
            continue
        seen.add(item.as_pointer())
        anim = getattr(item, "animation_data", None)
        if anim is None:
            continue
        for fcurve in anim.drivers:
            owner = item.name if not item.is_embedded_data else f"{item.name} (embedded)"
            yield f"{owner} {fcurve.data_path}[{fcurve.array_index}]", fcurve.driver


def _packed_or_generated_paths() -> set[str]:
    skip: set[str] = set()
    for collection in (bpy.data.images, bpy.data.sounds, bpy.data.fonts, bpy.data.volumes):
        for item in collection:
            packed = getattr(item, "packed_file", None) is not None or bool(
                getattr(item, "packed_files", None)
            )
            generated = getattr(item, "source", "") in {"GENERATED", "VIEWER"}
            if packed or generated:
                skip.add(os.path.normpath(bpy.path.abspath(item.filepath, library=item.library)))
    return skip


def _missing_files(root: str, cut: list[str]) -> list[str]:
    """The open file's missing external files as written in Blender: those outside its file set
    (``cut``, never looked for) and those inside it that are not there."""
    skip = _packed_or_generated_paths()
    missing = set(cut)
    for raw, full in containment.external_paths(bpy):
        path = os.path.normpath(full)
        if containment.outside(root, path):
            missing.add(raw)  # left by contain() (a path it cannot clear): still never looked at
        elif path not in skip and not containment.exists(path):
            missing.add(raw)
    return sorted(missing)


def _inspect(path: str, libraries: list[str], missing: list[str]) -> dict[str, Any]:
    """The report of the open file; ``libraries`` and ``missing`` as written in Blender."""
    scene = bpy.context.scene
    render = scene.render
    cycles = getattr(scene, "cycles", None)
    scripts = [
        f"text {t.name!r} is registered to run on load" for t in bpy.data.texts if t.use_module
    ]
    for where, driver in _drivers():
        if driver.type == "SCRIPTED" and not driver.is_simple_expression:
            scripts.append(f"driver on {where}: {driver.expression}")
    autoexec_fail = bool(bpy.app.autoexec_fail)
    version = bpy.data.version
    report: dict[str, Any] = {
        "path": path,
        "version": f"{version[0]}.{version[1]}",
        "scene": scene.name,
        "engine": render.engine,
        "frame_start": scene.frame_start,
        "frame_end": scene.frame_end,
        "frame_step": scene.frame_step,
        "fps": render.fps / render.fps_base,
        # Blender's own integer maths for the output size
        "width": render.resolution_x * render.resolution_percentage // 100,
        "height": render.resolution_y * render.resolution_percentage // 100,
        "samples": int(cycles.samples) if cycles is not None else None,
        "adaptive_sampling": bool(cycles.use_adaptive_sampling) if cycles is not None else False,
        "denoising": bool(cycles.use_denoising) if cycles is not None else False,
        "cameras": sorted(o.name for o in scene.objects if o.type == "CAMERA"),
        "camera": scene.camera.name if scene.camera is not None else None,
        "missing_files": missing,
        "libraries": libraries,
        "autoexec_fail": autoexec_fail,
        "autoexec_fail_message": bpy.app.autoexec_fail_message or "",
        "wants_scripts": autoexec_fail or bool(scripts),
        "scripts": scripts,
        "vram_estimate_mib": _vram_estimate_mib(scene),
    }
    if _compositor_tree(scene, {}) is not None:
        # PNG and JPEG take the compositor's result, made from the stitched passes; absent
        # (InspectionReport.compositor False) for a scene without one, as in older reports
        report["compositor"] = True
    return report


#: what Cycles holds per triangle (geometry plus BVH) and per vertex, in bytes, and what a
#: device context costs before any scene data: coarse figures, so the floor stays the minimum
_BYTES_PER_TRIANGLE = 160
_BYTES_PER_VERTEX = 32
_BYTES_PER_PIXEL_BUFFERS = 64
_CONTEXT_MIB = 300


def _vram_estimate_mib(scene: Any) -> int:
    """A coarse device-memory estimate: geometry, textures and render buffers of the scene."""
    import numpy as np

    total = 0
    seen: set[str] = set()
    for obj in scene.objects:
        mesh = obj.data if obj.type == "MESH" else None
        if mesh is None or mesh.name in seen:
            continue
        seen.add(mesh.name)
        loop_totals = np.empty(len(mesh.polygons), dtype=np.int32)
        mesh.polygons.foreach_get("loop_total", loop_totals)
        triangles = int((loop_totals - 2).clip(min=0).sum())
        total += triangles * _BYTES_PER_TRIANGLE + len(mesh.vertices) * _BYTES_PER_VERTEX
    for image in bpy.data.images:
        width, height = image.size[:]
        channels = image.channels or 4
        total += width * height * channels * (4 if image.is_float else 1)
    render = scene.render
    pixels = (render.resolution_x * render.resolution_percentage // 100) * (
        render.resolution_y * render.resolution_percentage // 100
    )
    total += pixels * _BYTES_PER_PIXEL_BUFFERS
    return int(_CONTEXT_MIB + total // (1024 * 1024))


# --- the loop ----------------------------------------------------------------------------------


def serve(session: Session, cmd_fd: int, reply_fd: int) -> int:
    ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
        "ping": lambda req: {
            "pid": os.getpid(),
            "blender": bpy.app.version_string,
            "device": session.device_name,
            "device_error": session.device_error,
        },
        "open": lambda req: session.open(req["path"], req.get("root")),
        "inspect": lambda req: session.inspect(req["path"], req.get("root")),
        "render": session.render,
        "denoise": session.denoise,
        "convert": session.convert,
    }
    while True:
        req = read_message(cmd_fd)
        if req is None:
            return 0
        op = req.get("op")
        if op == "quit":
            write_message(reply_fd, {"ok": True, "result": {}})
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
                "message": f"{op} failed: {_blender_message(exc)}",
                "fields": {"exception": type(exc).__name__},
            }
        write_message(reply_fd, reply)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workers.blender_child")
    parser.add_argument("--cmd-fd", type=int, required=True)
    parser.add_argument("--reply-fd", type=int, required=True)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--gpu-backend", default=None)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)

    arm_parent_death_signal(signal.SIGKILL)
    _line_buffer_c_stdout()
    # Anything Blender spawns must not hold our protocol pipes open after we die.
    os.set_inheritable(args.cmd_fd, False)
    os.set_inheritable(args.reply_fd, False)

    global bpy
    t0 = time.perf_counter()
    import bpy as bpy_module

    bpy = bpy_module
    bpy.context.preferences.filepaths.use_scripts_auto_execute = False
    log("started", pid=os.getpid(), import_s=round(time.perf_counter() - t0, 3))
    session = Session(args.device, args.gpu_backend, args.threads)
    return serve(session, args.cmd_fd, args.reply_fd)


if __name__ == "__main__":
    sys.exit(main())
