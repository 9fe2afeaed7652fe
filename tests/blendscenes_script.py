"""The bpy side of tests/blendscenes.py: builds and saves one tiny Cycles scene (a program)."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import bpy


def _material(name: str, color: tuple[float, float, float], **inputs: float) -> Any:
    mat = bpy.data.materials.new(name)
    mat.use_nodes = True
    bsdf = mat.node_tree.nodes["Principled BSDF"]
    bsdf.inputs["Base Color"].default_value = (*color, 1.0)
    for key, value in inputs.items():
        bsdf.inputs[key].default_value = value
    return mat


def _add(obj: Any, mat: Any) -> Any:
    obj.data.materials.append(mat)
    return obj


def build(spec: dict[str, Any]) -> None:
    bpy.ops.wm.read_factory_settings(use_empty=True)
    # New drivers would otherwise be evaluated here, in the builder, and write the canary.
    bpy.context.preferences.filepaths.use_scripts_auto_execute = False
    # Saving twice (missing_texture) must not leave a .blend1 backup beside the scene.
    bpy.context.preferences.filepaths.save_version = 0
    scene = bpy.context.scene
    scene.render.engine = "CYCLES"
    scene.cycles.device = "CPU"
    scene.cycles.samples = spec["samples"]
    scene.cycles.use_adaptive_sampling = spec["adaptive"]
    scene.render.resolution_x = spec["width"]
    scene.render.resolution_y = spec["height"]
    scene.render.resolution_percentage = 100
    scene.frame_start = 1
    scene.frame_end = spec["frame_end"]
    scene.render.fps = 24

    world = bpy.data.worlds.new("World")
    world.use_nodes = True
    world.node_tree.nodes["Background"].inputs["Color"].default_value = (0.05, 0.07, 0.1, 1.0)
    world.node_tree.nodes["Background"].inputs["Strength"].default_value = 1.0
    scene.world = world

    red = _material("RedDiffuse", (0.8, 0.1, 0.05), Roughness=0.9)
    metal = _material("GoldMetal", (0.9, 0.7, 0.2), Metallic=1.0, Roughness=0.25)
    glass = _material("Glass", (0.9, 0.95, 1.0), Roughness=0.0, **{"Transmission Weight": 1.0})
    floor = _material("Floor", (0.5, 0.5, 0.45), Roughness=0.6)

    bpy.ops.mesh.primitive_plane_add(size=12.0, location=(0.0, 0.0, 0.0))
    _add(bpy.context.object, floor).name = "Floor"
    bpy.ops.mesh.primitive_cube_add(size=1.4, location=(-1.6, 0.0, 0.7))
    cube = _add(bpy.context.object, red)
    cube.name = "Cube"
    bpy.ops.mesh.primitive_uv_sphere_add(
        radius=0.8, segments=24, ring_count=12, location=(0.3, 0.6, 0.8)
    )
    _add(bpy.context.object, metal).name = "Sphere"
    bpy.ops.mesh.primitive_ico_sphere_add(radius=0.6, subdivisions=2, location=(1.7, -0.6, 0.6))
    _add(bpy.context.object, glass).name = "Ico"

    # Frames must differ: the cube travels and turns over the frame range.
    cube.location = (-1.6, 0.0, 0.7)
    cube.rotation_euler = (0.0, 0.0, 0.0)
    cube.keyframe_insert("location", frame=1)
    cube.keyframe_insert("rotation_euler", frame=1)
    last = max(2, spec["frame_end"])
    cube.location = (-0.4, -1.2, 0.9)
    cube.rotation_euler = (0.0, 0.0, math.radians(90.0))
    cube.keyframe_insert("location", frame=last)
    cube.keyframe_insert("rotation_euler", frame=last)

    light_data = bpy.data.lights.new("Key", type="POINT")
    light_data.energy = 900.0
    light_data.shadow_soft_size = 0.5
    light = bpy.data.objects.new("Key", light_data)
    light.location = (3.0, -3.0, 5.0)
    scene.collection.objects.link(light)

    if spec["camera"]:
        cam_data = bpy.data.cameras.new("Camera")
        cam = bpy.data.objects.new("Camera", cam_data)
        cam.location = (0.0, -7.5, 4.0)
        cam.rotation_euler = (math.radians(63.0), 0.0, 0.0)
        scene.collection.objects.link(cam)
        scene.camera = cam

    if spec["autorun_canary"]:
        text = bpy.data.texts.new("canary.py")
        text.write(
            "import pathlib\n"
            f"pathlib.Path({spec['autorun_canary']!r}).write_text('auto-run script ran')\n"
        )
        text.use_module = True

    if spec["driver_canary"]:
        fcurve = cube.driver_add("location", 2)
        driver = fcurve.driver
        driver.type = "SCRIPTED"
        # Not a "simple expression": Blender can only evaluate it by running Python.
        driver.expression = (
            f"__import__('pathlib').Path({spec['driver_canary']!r}).write_text('driver ran') * 0"
            " + 0.7"
        )

    if spec.get("linked_library"):
        with bpy.data.libraries.load(spec["linked_library"], link=True) as (_, linked):
            linked.materials = ["GoldMetal"]
        cube.data.materials[0] = linked.materials[0]

    if spec.get("passes"):
        layer = scene.view_layers[0]
        for name in (
            "use_pass_z", "use_pass_normal", "use_pass_diffuse_direct", "use_pass_diffuse_color",
            "use_pass_glossy_direct", "use_pass_emit", "use_pass_ambient_occlusion",
            "use_pass_object_index", "use_pass_mist", "use_pass_cryptomatte_object",
            "use_pass_cryptomatte_material",
        ):  # fmt: skip
            setattr(layer, name, True)

    if spec.get("compositor"):
        _add_compositor(scene)

    path = Path(spec["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    if spec["missing_texture"]:
        img = bpy.data.images.new("MissingTexture", 4, 4)
        img.source = "FILE"
        nodes = floor.node_tree.nodes
        tex = nodes.new("ShaderNodeTexImage")
        tex.image = img
        floor.node_tree.links.new(
            tex.outputs["Color"], nodes["Principled BSDF"].inputs["Base Color"]
        )
        # Relative paths need a saved file to be relative to.
        bpy.ops.wm.save_as_mainfile(filepath=str(path))
        img.filepath = "//textures/missing_texture.png"

    if spec["seconds_per_frame_hint"]:
        scene.cycles.samples = _calibrated_samples(scene, float(spec["seconds_per_frame_hint"]))

    bpy.ops.wm.save_as_mainfile(filepath=str(path))


def _add_compositor(scene: Any) -> None:
    """Render Layers' Image x Ambient Occlusion (read inside a node group), Hue/Saturation, then
    the Cube's Cryptomatte matte mixes in a flat colour."""
    layer = scene.view_layers[0]
    layer.use_pass_ambient_occlusion = True
    layer.use_pass_cryptomatte_object = True
    group = bpy.data.node_groups.new("AO", "CompositorNodeTree")
    group.interface.new_socket("AO", in_out="OUTPUT", socket_type="NodeSocketColor")
    inner = group.nodes.new("CompositorNodeRLayers")
    group.links.new(
        inner.outputs["Ambient Occlusion"], group.nodes.new("NodeGroupOutput").inputs[0]
    )

    tree = bpy.data.node_groups.new("Compositing", "CompositorNodeTree")
    tree.interface.new_socket("Image", in_out="OUTPUT", socket_type="NodeSocketColor")
    scene.compositing_node_group = tree
    layers = tree.nodes.new("CompositorNodeRLayers")
    ao = tree.nodes.new("CompositorNodeGroup")
    ao.node_tree = group
    multiply = _mix(tree, "MULTIPLY", 0.7, layers.outputs["Image"], ao.outputs[0])
    hsv = tree.nodes.new("CompositorNodeHueSat")
    hsv.inputs["Saturation"].default_value = 1.6
    tree.links.new(multiply, hsv.inputs[0])
    matte = tree.nodes.new("CompositorNodeCryptomatteV2")
    matte.layer_name = "ViewLayer.CryptoObject"
    matte.matte_id = "Cube"
    tree.links.new(layers.outputs["Image"], matte.inputs["Image"])
    flat = tree.nodes.new("CompositorNodeRGB")
    flat.outputs[0].default_value = (0.1, 0.8, 0.3, 1.0)
    mixed = _mix(tree, "MIX", 0.0, hsv.outputs["Image"], flat.outputs[0])
    tree.links.new(matte.outputs["Matte"], mixed.node.inputs["Factor"])
    tree.links.new(mixed, tree.nodes.new("NodeGroupOutput").inputs[0])


def _mix(tree: Any, blend: str, factor: float, a: Any, b: Any) -> Any:
    """A colour Mix node of sockets ``a`` and ``b``; returns its result socket."""
    mix = tree.nodes.new("ShaderNodeMix")
    mix.data_type = "RGBA"
    mix.blend_type = blend
    mix.inputs["Factor"].default_value = factor
    by_id = {s.identifier: s for s in mix.inputs}
    tree.links.new(a, by_id["A_Color"])
    tree.links.new(b, by_id["B_Color"])
    return next(s for s in mix.outputs if s.identifier == "Result_Color")


def _calibrated_samples(scene: Any, seconds: float) -> int:
    """Samples that make one frame take about ``seconds`` here, as the farm renders it.

    Measured by test renders with the farm's settings (no denoising, persistent data), which
    are restored afterwards so the saved file keeps Blender's defaults.
    """
    saved = scene.cycles.use_denoising, scene.render.use_persistent_data
    scene.cycles.use_denoising = False
    scene.render.use_persistent_data = True

    def timed(samples: int) -> float:
        scene.cycles.samples = samples
        # With persistent data an add-on property change alone is not seen (bpy 5.0.1).
        scene.update_tag()
        t0 = time.perf_counter()
        bpy.ops.render.render(write_still=False)
        return time.perf_counter() - t0

    timed(1)  # warm-up: kernels and scene sync
    samples, took_s = 16, timed(16)
    # Grow until the render is long enough for its time to be mostly sampling, then scale.
    while took_s < seconds / 4 and samples < 1 << 16:
        samples *= 4
        took_s = timed(samples)
    scene.cycles.use_denoising, scene.render.use_persistent_data = saved
    return max(1, round(samples * seconds / max(took_s, 1e-3)))


def render_reference(spec: dict[str, Any]) -> None:
    """Render the whole frame the plain Blender way (render + write_still) as a reference."""
    bpy.ops.wm.open_mainfile(filepath=spec["blend"], load_ui=False, use_scripts=False)
    scene = bpy.context.scene
    scene.render.engine = "CYCLES"
    scene.cycles.device = "CPU"
    scene.cycles.use_denoising = False
    scene.render.use_compositing = bool(spec.get("compositing"))
    scene.render.use_sequencer = False
    settings = scene.render.image_settings
    settings.media_type = "IMAGE"
    settings.file_format = spec["file_format"]
    settings.color_mode = "RGB" if spec["file_format"] == "JPEG" else "RGBA"
    if spec.get("quality") is not None:
        settings.quality = spec["quality"]
    scene.render.filepath = spec["out_path"]
    scene.render.use_file_extension = False
    bpy.ops.render.render(write_still=True)


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    if request.get("op") == "render_reference":
        render_reference(request)
    else:
        build(request)
