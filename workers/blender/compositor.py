"""The scene's compositor: the node tree a final render runs, and a copy of it rewired to read
the frame's stitched passes instead of a render."""

from __future__ import annotations

from typing import Any

from workers.blender.errors import ChildError


def final_tree(scene: Any, saved: dict[str, Any]) -> Any:
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


def fed_copy(tree: Any, image: Any, scene: Any, copies: dict[int, Any]) -> Any:
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
            node.node_tree = fed_copy(node.node_tree, image, scene, copies)
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
