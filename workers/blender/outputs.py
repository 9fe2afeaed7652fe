"""Writing a frame in its delivery formats (PNG, JPEG, EXR) with the scene's colour management;
a scene that composites gets its compositor's result, fed from the frame's stitched passes."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bpy

from workers.blender import compositor
from workers.blender.errors import ChildError
from workers.blender.process import log
from workers.exr import read_size

if TYPE_CHECKING:
    from workers.blender.session import Session


def convert(session: Session, req: dict[str, Any]) -> dict[str, Any]:
    """Write the frame as each output; a scene that composites gets its compositor's result.

    ``exr_in`` is the linear RGBA frame; ``layers_in`` (the stitched multilayer EXR of every
    pass) is what the compositor reads in place of its Render Layers nodes.
    """
    log("convert", frame=req.get("frame"), outputs=len(req["outputs"]))
    session.open(req["path"], req.get("root"))
    scene = bpy.context.scene
    tree = compositor.final_tree(scene, session.saved)
    # a live-preview pass shows the render itself (a tile alone cannot be composited)
    if tree is not None and req.get("composite", True):
        return _convert_composited(scene, tree, req)
    settings = scene.render.image_settings
    saved = _image_settings(settings)
    image = bpy.data.images.load(str(Path(req["exr_in"]).absolute()), check_existing=False)
    try:
        return {"outputs": _save_outputs(image, scene, req["outputs"])}
    finally:
        bpy.data.images.remove(image)
        _restore_image_settings(settings, saved)


def _convert_composited(scene: Any, tree: Any, req: dict[str, Any]) -> dict[str, Any]:
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
        scene.compositing_node_group = compositor.fed_copy(tree, image, scene, copies)
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


def _image_settings(settings: Any) -> dict[str, Any]:
    names = ("media_type", "file_format", "color_mode", "color_depth", "quality", "exr_codec")
    return {name: getattr(settings, name) for name in names if hasattr(settings, name)}


def _restore_image_settings(settings: Any, saved: dict[str, Any]) -> None:
    # Order matters: the format decides which colour modes and depths are valid.
    for name, value in saved.items():
        with contextlib.suppress(TypeError, AttributeError, ValueError):
            setattr(settings, name, value)
