"""Hostile test scenes: a .blend reaching for files outside its own, and one that aborts Blender.

Built by bpy in a subprocess (this module run as a program), so the test process never imports
bpy.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: time allowed to build one scene
BUILD_TIMEOUT_S = 120.0


def _run(spec: dict[str, Any]) -> None:
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building {spec} failed (exit {proc.returncode}):\n{proc.stderr}")


def make_source(folder: Path, rgba: tuple[float, float, float, float]) -> tuple[Path, Path]:
    """Another project's upload in ``folder``: a flat-colour PNG and a library .blend whose
    material ``Paint`` (fake user) has that colour; returns (png, library)."""
    png, library = folder / "paint.png", folder / "paint.blend"
    _run({"op": "source", "png": str(png), "library": str(library), "rgba": list(rgba)})
    return png, library


def reach_out(base: Path, out: Path, image: str, library: str) -> Path:
    """``base`` (a make_scene scene) saved as ``out`` with the floor textured by ``image`` and
    the cube's material linked from ``library``, both paths written exactly as given
    (``/abs/path``, ``//../x``)."""
    _run({"op": "reach", "base": str(base), "out": str(out), "image": image, "library": library})
    return out


def make_poison(path: Path) -> Path:
    """A gas (smoke) simulation domain: it loads, but Blender then aborts (SIGABRT,
    ``Manta::Error: can't clean grid cache``) when the next file is loaded over it, as the
    2.79 smoke scene of issue 11 did with bpy 5.0.1."""
    _run({"op": "poison", "out": str(path)})
    return path


def make_segfault(base: Path, path: Path) -> Path:
    """``base`` (a make_scene scene, zstd) decompressed with every struct size over 100 bytes
    in its DNA set to 65000: the block walk passes, and Blender dies (SIGSEGV) reading it."""
    import struct

    import zstandard

    with base.open("rb") as fh:
        reader = zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)
        data = bytearray(reader.read())
    tlen = data.find(b"TLEN")
    count = struct.unpack_from("<i", data, data.rfind(b"TYPE", 0, tlen) + 4)[0]
    for k in range(count):
        if struct.unpack_from("<H", data, tlen + 4 + 2 * k)[0] > 100:
            struct.pack_into("<H", data, tlen + 4 + 2 * k, 65000)
    path.write_bytes(bytes(data))
    return path


# --- the bpy side ------------------------------------------------------------------------------


def _source(bpy: Any, spec: dict[str, Any]) -> None:
    bpy.ops.wm.read_factory_settings(use_empty=True)
    Path(spec["png"]).parent.mkdir(parents=True, exist_ok=True)
    img = bpy.data.images.new("Paint", 8, 8)
    img.pixels[:] = list(spec["rgba"]) * 64
    img.filepath_raw = spec["png"]
    img.file_format = "PNG"
    img.save()
    mat = bpy.data.materials.new("Paint")
    mat.use_nodes = True
    mat.node_tree.nodes["Principled BSDF"].inputs["Base Color"].default_value = spec["rgba"]
    mat.node_tree.nodes["Principled BSDF"].inputs["Emission Color"].default_value = spec["rgba"]
    mat.node_tree.nodes["Principled BSDF"].inputs["Emission Strength"].default_value = 5.0
    mat.use_fake_user = True  # a material nobody uses is not saved otherwise
    bpy.ops.wm.save_as_mainfile(filepath=spec["library"])


def _reach(bpy: Any, spec: dict[str, Any]) -> None:
    bpy.ops.wm.open_mainfile(filepath=spec["base"], load_ui=False, use_scripts=False)
    bpy.context.preferences.filepaths.save_version = 0
    Path(spec["out"]).parent.mkdir(parents=True, exist_ok=True)
    # saved where it will live first: "//" paths are relative to it
    bpy.ops.wm.save_as_mainfile(filepath=spec["out"])
    floor = bpy.data.materials["Floor"]
    nodes = floor.node_tree.nodes
    tex = nodes.new("ShaderNodeTexImage")
    tex.image = bpy.data.images.new("Paint", 4, 4)
    tex.image.source = "FILE"
    tex.image.filepath = spec["image"]
    floor.node_tree.links.new(tex.outputs["Color"], nodes["Principled BSDF"].inputs["Base Color"])
    relative = spec["library"].startswith("//")
    with bpy.data.libraries.load(spec["library"], link=True, relative=relative) as (_, linked):
        linked.materials = ["Paint"]
    bpy.data.objects["Cube"].data.materials[0] = linked.materials[0]
    bpy.data.libraries[0].filepath = spec["library"]  # Blender tidied it when linking
    bpy.ops.wm.save_as_mainfile(filepath=spec["out"], relative_remap=False)
    written = bpy.utils.blend_paths(absolute=False)
    if sorted(written) != sorted([spec["image"], spec["library"]]):
        raise RuntimeError(f"the scene names {written}, not what was asked")


def _poison(bpy: Any, spec: dict[str, Any]) -> None:
    bpy.ops.wm.read_factory_settings(use_empty=True)
    bpy.ops.mesh.primitive_cube_add(size=2)
    domain = bpy.context.object.modifiers.new("Fluid", "FLUID")
    domain.fluid_type = "DOMAIN"
    domain.domain_settings.domain_type = "GAS"
    domain.domain_settings.resolution_max = 8
    bpy.ops.mesh.primitive_uv_sphere_add(radius=0.3)
    flow = bpy.context.object.modifiers.new("Fluid", "FLUID")
    flow.fluid_type = "FLOW"
    flow.flow_settings.flow_type = "SMOKE"
    bpy.context.scene.frame_set(2)  # one simulation step: the saved domain holds its state
    Path(spec["out"]).parent.mkdir(parents=True, exist_ok=True)
    bpy.ops.wm.save_as_mainfile(filepath=spec["out"])


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    bpy_module = importlib.import_module("bpy")
    ops = {"source": _source, "reach": _reach, "poison": _poison}
    ops[request["op"]](bpy_module, request)
    sys.stdout.flush()
    # Blender's own teardown aborts on a fluid domain (the very bug): the file is saved
    os._exit(0)
