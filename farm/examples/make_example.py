"""Builds the bundled example scene: a small animated Cycles still life, frames 1-6.

Run with the project's interpreter (it needs ``bpy``)::

    .venv/bin/python farm/examples/make_example.py farm/examples/example.blend

The scene is tuned so that one full frame renders in about 1 to 2 s on a 2-core CPU. It holds
no Python (no text blocks, no drivers, no handlers) and no external files, so it is safe to open
with scripts off and renders the same on any machine. Adaptive sampling and denoising are off
and the seed is fixed, so tiles of a frame stitch into exactly the full-frame image.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import bpy

RESOLUTION = (384, 216)
"""Output size in pixels (16:9)."""

SAMPLES = 16
"""Cycles samples per pixel; with adaptive sampling off every pixel takes exactly this many."""

SEED = 7
"""Cycles seed; fixed (and not animated) so renders are reproducible."""

FRAMES = (1, 6)
"""First and last frame of the animation."""


def principled(
    name: str,
    colour: tuple[float, float, float],
    roughness: float,
    metallic: float = 0.0,
    emission: float = 0.0,
) -> bpy.types.Material:
    material = bpy.data.materials.new(name)
    bsdf = material.node_tree.nodes["Principled BSDF"]
    bsdf.inputs["Base Color"].default_value = (*colour, 1.0)
    bsdf.inputs["Roughness"].default_value = roughness
    bsdf.inputs["Metallic"].default_value = metallic
    if emission > 0.0:
        bsdf.inputs["Emission Color"].default_value = (*colour, 1.0)
        bsdf.inputs["Emission Strength"].default_value = emission
    return material


def checker_floor() -> bpy.types.Material:
    material = principled("Floor", (0.8, 0.8, 0.8), roughness=0.35)
    nodes, links = material.node_tree.nodes, material.node_tree.links
    checker = nodes.new("ShaderNodeTexChecker")
    checker.inputs["Scale"].default_value = 6.0
    checker.inputs["Color1"].default_value = (0.6, 0.57, 0.52, 1.0)
    checker.inputs["Color2"].default_value = (0.06, 0.07, 0.09, 1.0)
    links.new(checker.outputs["Color"], nodes["Principled BSDF"].inputs["Base Color"])
    return material


def add_object(
    kind: str, location: tuple[float, float, float], material: bpy.types.Material, **kwargs: float
) -> bpy.types.Object:
    if kind == "sphere":
        bpy.ops.mesh.primitive_uv_sphere_add(
            segments=48, ring_count=24, location=location, **kwargs
        )
        bpy.ops.object.shade_smooth()
    elif kind == "cube":
        bpy.ops.mesh.primitive_cube_add(location=location, **kwargs)
        bevel = bpy.context.object.modifiers.new("Bevel", "BEVEL")
        bevel.width = 0.06
        bevel.segments = 3
    elif kind == "plane":
        bpy.ops.mesh.primitive_plane_add(location=location, **kwargs)
    elif kind == "torus":
        bpy.ops.mesh.primitive_torus_add(location=location, **kwargs)
        bpy.ops.object.shade_smooth()
    else:
        raise ValueError(kind)
    obj = bpy.context.object
    obj.data.materials.append(material)
    return obj


def build_scene() -> bpy.types.Scene:
    bpy.ops.wm.read_factory_settings(use_empty=True)
    scene = bpy.context.scene
    scene.name = "Example"

    floor = add_object("plane", (0.0, 0.0, 0.0), checker_floor(), size=12.0)
    floor.name = "Floor"

    sphere = add_object(
        "sphere",
        (-1.3, 0.6, 0.8),
        principled("Chrome", (0.9, 0.9, 0.92), 0.08, metallic=1.0),
        radius=0.8,
    )
    sphere.name = "GlossySphere"
    cube = add_object(
        "cube", (1.2, -0.2, 0.6), principled("Terracotta", (0.6, 0.12, 0.04), 0.55), size=1.2
    )
    cube.name = "DiffuseCube"
    torus = add_object(
        "torus",
        (0.15, -1.6, 0.25),
        principled("Glow", (0.1, 0.45, 1.0), 0.5, emission=2.5),
        major_radius=0.45,
        minor_radius=0.12,
    )
    torus.name = "GlowRing"

    # Animation over frames 1-6: the cube turns, the sphere slides, the ring spins.
    first, last = FRAMES
    scene.frame_start, scene.frame_end = first, last
    for frame, t in ((first, 0.0), (last, 1.0)):
        cube.rotation_euler = (0.0, 0.0, math.radians(75.0 * t))
        cube.keyframe_insert("rotation_euler", frame=frame)
        sphere.location = (-1.3 + 0.3 * t, 0.6 - 1.0 * t, 0.8)
        sphere.keyframe_insert("location", frame=frame)
        torus.rotation_euler = (math.radians(60.0 * t), 0.0, math.radians(90.0 * t))
        torus.keyframe_insert("rotation_euler", frame=frame)

    area = bpy.data.lights.new("KeyLight", "AREA")
    area.energy = 500.0
    area.size = 2.5
    area.color = (1.0, 0.93, 0.85)
    key = bpy.data.objects.new("KeyLight", area)
    key.location = (2.5, -3.0, 4.5)
    key.rotation_euler = (math.radians(40.0), 0.0, math.radians(35.0))
    scene.collection.objects.link(key)

    sun = bpy.data.lights.new("FillSun", "SUN")
    sun.energy = 1.2
    sun.angle = math.radians(8.0)
    sun.color = (0.8, 0.87, 1.0)
    fill = bpy.data.objects.new("FillSun", sun)
    fill.rotation_euler = (math.radians(50.0), 0.0, math.radians(-120.0))
    scene.collection.objects.link(fill)

    world = bpy.data.worlds.new("World")
    background = world.node_tree.nodes["Background"]
    background.inputs["Color"].default_value = (0.22, 0.3, 0.45, 1.0)
    background.inputs["Strength"].default_value = 0.5
    scene.world = world

    camera_data = bpy.data.cameras.new("Camera")
    camera_data.lens = 35.0
    camera = bpy.data.objects.new("Camera", camera_data)
    camera.location = (0.0, -6.4, 2.9)
    camera.rotation_euler = (math.radians(70.0), 0.0, 0.0)
    scene.collection.objects.link(camera)
    scene.camera = camera

    render = scene.render
    render.engine = "CYCLES"
    render.resolution_x, render.resolution_y = RESOLUTION
    render.resolution_percentage = 100
    render.use_border = False
    render.filepath = "//render/frame_"  # relative to the .blend
    render.image_settings.media_type = "IMAGE"
    render.image_settings.file_format = "PNG"

    cycles = scene.cycles
    cycles.device = "CPU"
    cycles.samples = SAMPLES
    cycles.use_adaptive_sampling = False
    cycles.use_denoising = False
    cycles.seed = SEED
    cycles.use_animated_seed = False
    cycles.max_bounces = 6
    cycles.diffuse_bounces = 3
    cycles.glossy_bounces = 3
    cycles.transmission_bounces = 4
    cycles.caustics_reflective = False
    cycles.caustics_refractive = False
    cycles.sample_clamp_indirect = 3.0
    scene.view_settings.view_transform = "AgX"
    scene.view_settings.look = "AgX - Medium High Contrast"

    scene.frame_set(first)
    return scene


def check_safe() -> None:
    """The example must be safe to open with scripts off: no Python and no external files."""
    if bpy.data.texts:
        raise RuntimeError(f"text blocks in scene: {[t.name for t in bpy.data.texts]}")
    for collection in (bpy.data.objects, bpy.data.materials, bpy.data.worlds, bpy.data.scenes):
        for block in collection:
            anim = getattr(block, "animation_data", None)
            if anim is not None and anim.drivers:
                raise RuntimeError(f"drivers on {block.name}")
    if bpy.data.images or bpy.data.libraries:
        raise RuntimeError("external images or libraries in scene")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT.blend", file=sys.stderr)
        return 2
    out = Path(argv[1]).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    build_scene()
    check_safe()
    bpy.context.preferences.filepaths.save_version = 0  # no example.blend1 backup
    bpy.ops.wm.save_as_mainfile(filepath=str(out), compress=True, relative_remap=True)
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
