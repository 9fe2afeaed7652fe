"""Tiny Cycles test scenes, built by bpy in a subprocess so the test process never imports bpy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = Path(__file__).with_name("blendscenes_script.py")

#: time allowed to build and save one scene; a calibrated scene renders three times
BUILD_TIMEOUT_S = 120.0


def make_scene(
    path: Path,
    *,
    width: int = 67,
    height: int = 41,
    samples: int = 8,
    frame_end: int = 1,
    adaptive: bool = False,
    camera: bool = True,
    autorun_canary: Path | None = None,
    driver_canary: Path | None = None,
    missing_texture: bool = False,
    seconds_per_frame_hint: float | None = None,
    linked_library: Path | None = None,
    passes: bool = False,
    compositor: bool = False,
) -> Path:
    """Build and save a tiny Cycles scene at ``path``; return ``path``.

    Four objects with different materials (diffuse, metal, glass, floor), a point light and a
    camera; the cube moves between frame 1 and ``frame_end`` so frames differ.

    ``autorun_canary``: add a text block registered to run on load that writes that file.
    ``driver_canary``: add a Python (SCRIPTED) driver whose expression writes that file.
    ``missing_texture``: the floor gets an image texture at ``//textures/missing_texture.png``,
    which does not exist.
    ``linked_library``: the cube's material is linked from that .blend (one make_scene built),
    so the scene depends on an external library file.
    ``passes``: enable a set of view-layer passes (depth, normal, diffuse and glossy, emission,
    ambient occlusion, object index, mist) and Cryptomatte (object, material).
    ``compositor``: the scene composites: Render Layers' Image times its Ambient Occlusion pass
    (read by a Render Layers node inside a node group), a Hue/Saturation/Value node, then a flat
    colour mixed in by the Cube's Cryptomatte matte (enables the AO and Cryptomatte passes).
    ``seconds_per_frame_hint``: replace ``samples`` by a count measured on this machine to make
    one frame take about that long (approximate; costs three small renders while building).
    """
    spec = {
        "path": str(Path(path).absolute()),
        "width": width,
        "height": height,
        "samples": samples,
        "frame_end": frame_end,
        "adaptive": adaptive,
        "camera": camera,
        "autorun_canary": str(autorun_canary) if autorun_canary else None,
        "driver_canary": str(driver_canary) if driver_canary else None,
        "missing_texture": missing_texture,
        "seconds_per_frame_hint": seconds_per_frame_hint,
        "linked_library": str(Path(linked_library).absolute()) if linked_library else None,
        "passes": passes,
        "compositor": compositor,
    }
    run_bpy([str(_SCRIPT)], spec, BUILD_TIMEOUT_S, f"building test scene {path}", Path(path))
    for canary in (autorun_canary, driver_canary):
        if canary is not None and Path(canary).exists():
            raise RuntimeError(f"the scene builder itself ran the canary script {canary}")
    return Path(path)


def render_reference(
    blend: Path,
    out_path: Path,
    file_format: str = "PNG",
    quality: int | None = None,
    compositing: bool = False,
) -> Path:
    """Render ``blend``'s whole frame the plain Blender way (denoising off; compositing off
    unless ``compositing``).

    The image is written by Blender itself (``write_still``), with the scene's colour
    management: the reference for what the farm's own output must look like.
    """
    request = {
        "op": "render_reference",
        "blend": str(Path(blend).absolute()),
        "out_path": str(Path(out_path).absolute()),
        "file_format": file_format,
        "quality": quality,
        "compositing": compositing,
    }
    proc = subprocess.run(
        [sys.executable, str(_SCRIPT), json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0 or not Path(out_path).is_file():
        raise RuntimeError(
            f"reference render of {blend} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return Path(out_path)


def run_bpy(
    script: list[str], spec: dict[str, object], timeout_s: float, what: str, made: Path
) -> None:
    """Run a bpy script (``[path]`` or ``["-c", source]``) in a fresh Python with ``spec`` as
    its JSON argument; RuntimeError naming ``what`` with the output's tail unless it exits 0
    and ``made`` exists."""
    proc = subprocess.run(
        [sys.executable, *script, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0 or not made.is_file():
        raise RuntimeError(
            f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
