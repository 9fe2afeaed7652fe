"""Which external files a job's .blend may use: only its own file set; the rest is made missing.

A .blend names external files (images, libraries, volumes, caches, fonts, sounds...) by absolute
path or relative to itself (``//textures/a.png``). The job's file set is the folder its .blend
came in (the upload's folder, or the unpacked zip). A path that resolves outside it, however it
is written (``/etc/passwd``, ``//../../other/upload.png``, a Windows or cwd-relative path), is
reported missing as written and never looked at on the host: whether such a file exists must not
show in a report (no oracle), nor its content in a render.

Runs inside the Blender child (the caller passes its ``bpy``); ``outside`` is pure.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from typing import Any

#: ID collections whose items name one external file in ``filepath``
PATH_COLLECTIONS = ("images", "volumes", "sounds", "movieclips", "fonts", "cache_files")
#: string property subtypes that hold a file or folder on disk
_PATH_SUBTYPES = frozenset({"FILE_PATH", "DIR_PATH"})


def outside(root: str, path: str) -> bool:
    """Whether ``path`` (absolute, as Blender resolved it) leaves the folder ``root``.

    Decided on the text alone (``..`` collapsed, ``\\`` read as a separator, since Blender may),
    so a path outside is never stat'ed; a path inside is resolved for symbolic links, which
    must not lead out either.
    """
    root = os.path.normpath(root)
    for candidate in {path, path.replace("\\", "/")}:
        if not os.path.isabs(candidate):
            return True  # relative to the process's cwd: nobody's file set
        norm = os.path.normpath(candidate)
        if norm != root and not norm.startswith(root.rstrip(os.sep) + os.sep):
            return True
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.normpath(path))
    return real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep)


def external_paths(bpy: Any) -> list[tuple[str, str]]:
    """(as written, as resolved) of every external path of the open file, packed ones left out.

    Blender resolves each path relative to the file (or linked library) that holds it.
    """
    written = bpy.utils.blend_paths(absolute=False, packed=False, local=False)
    resolved = bpy.utils.blend_paths(absolute=True, packed=False, local=False)
    pairs = []
    for raw, full in zip(written, resolved, strict=True):
        if raw and not raw.startswith("<"):  # "<builtin>" font
            pairs.append((raw, full))
    return pairs


def exists(path: str) -> bool:
    """Whether a path inside the file set is there (a UDIM or UV-tile pattern: any tile)."""
    if "<UDIM>" in path or "<UVTILE>" in path:
        pattern = path.replace("<UDIM>", "[0-9]" * 4).replace("<UVTILE>", "u*_v*")
        folder, name = os.path.split(pattern)
        return bool(glob.glob(os.path.join(glob.escape(folder), name)))
    return os.path.exists(path)


def contain(bpy: Any, root: str) -> list[str]:
    """Cut the open file off every external file outside ``root``; returns them as written.

    Libraries outside are removed (with the data linked from them); images, volumes, caches,
    fonts, sounds and clips outside lose their path (Blender treats them as missing: a missing
    image renders magenta); file and folder paths of modifiers, physics caches and nodes
    outside are cleared. The sandbox the child runs in hides such files anyway: this makes a
    render the same whether they exist or not.
    """
    cut = sorted({raw for raw, full in external_paths(bpy) if outside(root, full)})
    if not cut:
        return []
    for name in [lib.name for lib in bpy.data.libraries]:
        lib = bpy.data.libraries.get(name)
        if lib is not None and outside(root, _resolved(bpy, lib.filepath, lib.parent)):
            bpy.data.libraries.remove(lib)
    for attr in PATH_COLLECTIONS:
        for item in getattr(bpy.data, attr):
            if _packed(item) or not item.filepath or item.filepath.startswith("<"):
                continue
            if outside(root, _resolved(bpy, item.filepath, item.library)):
                item.filepath = ""
    for owner, prop, value in _path_properties(bpy):
        owner_id = getattr(owner, "id_data", None)
        if outside(root, _resolved(bpy, value, getattr(owner_id, "library", None))):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(owner, prop, "")
    return cut


def _resolved(bpy: Any, path: str, library: Any) -> str:
    """``path`` made absolute as Blender does: ``//`` is the folder of the file that holds it
    (``library``, None for the opened file itself)."""
    return os.path.normpath(str(bpy.path.abspath(path, library=library)))


def _packed(item: Any) -> bool:
    return getattr(item, "packed_file", None) is not None or bool(
        getattr(item, "packed_files", None)
    )


def _path_properties(bpy: Any) -> Iterator[tuple[Any, str, str]]:
    """(struct, property, value) of every non-empty file or folder path held by modifiers (and
    their settings: fluid domains, point caches), particle caches and node tree nodes."""
    for obj in bpy.data.objects:
        for modifier in getattr(obj, "modifiers", ()):
            yield from _struct_paths(modifier, depth=2)
        for system in getattr(obj, "particle_systems", ()):
            yield from _struct_paths(system.point_cache, depth=0)
    trees = [t for t in bpy.data.node_groups]
    for attr in ("materials", "worlds", "lights", "textures", "scenes", "linestyles"):
        for item in getattr(bpy.data, attr):
            tree = getattr(item, "node_tree", None)
            if tree is not None:
                trees.append(tree)
    for tree in trees:
        for node in tree.nodes:
            yield from _struct_paths(node, depth=0)


def _struct_paths(struct: Any, depth: int) -> Iterator[tuple[Any, str, str]]:
    if struct is None:
        return
    for prop in struct.bl_rna.properties:
        ident = prop.identifier
        if prop.type == "STRING" and prop.subtype in _PATH_SUBTYPES:
            value = getattr(struct, ident, "")
            if value:
                yield struct, ident, value
        elif prop.type == "POINTER" and depth > 0 and ident not in ("rna_type", "id_data"):
            target = getattr(struct, ident, None)
            if target is not None and not hasattr(target, "users"):  # settings, not an ID
                yield from _struct_paths(target, depth - 1)
