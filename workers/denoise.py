"""Denoising a whole frame once, after stitching or merging, from its noisy and guide passes."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np

from farm.errors import RenderError
from workers import exr
from workers.child import BlenderChild
from workers.exr import LayeredImage

#: the guide passes OIDN needs besides the noisy Combined (Cycles' "Denoising Data" passes)
GUIDES = ("Denoising Normal", "Denoising Albedo")


def combined_layers(image: LayeredImage) -> list[str]:
    """The view layers of ``image`` that have a Combined pass, in the order they were rendered
    (``tessera/layers`` when the tile says so, else file order)."""
    have = [p.rsplit(".", 1)[0] for p in image.passes() if p.endswith(".Combined")]
    order = image.attrs.get("tessera/layers", "")
    ranked = [name for name in order.split("\n") if name in have] if order else []
    return ranked + [name for name in have if name not in ranked]


def prepare(image: LayeredImage) -> tuple[LayeredImage, list[str]]:
    """``image`` made readable by Cycles' standalone denoiser, and the channels added for it.

    The denoiser insists on a Vector (motion) pass, which it uses only between frames of an
    animation it denoises as a sequence; a still gets zero motion, removed again afterwards.
    """
    layers = combined_layers(image)
    if not layers:
        raise RenderError("the frame has no Combined pass to denoise")
    channels = dict(image.channels)
    added: list[str] = []
    for layer in layers:
        missing = [g for g in GUIDES if f"{layer}.{g}.X" not in channels]
        missing = [g for g in missing if f"{layer}.{g}.R" not in channels]
        if missing:
            raise RenderError(
                f"view layer {layer!r} has no {', '.join(missing)} pass: the tiles were rendered "
                "without denoising data"
            )
        for axis in "XYZW":
            name = f"{layer}.Vector.{axis}"
            if name not in channels:
                channels[name] = np.zeros(image.shape, np.float32)
                added.append(name)
    return LayeredImage(channels, dict(image.attrs)), added


def upside_down(image: LayeredImage) -> LayeredImage:
    """``image`` with its rows in the other order (every channel; the attributes as they are).

    Cycles' in-render denoiser hands OpenImageDenoise its render buffers, whose first row is the
    bottom of the frame; the standalone denoiser reads an EXR, whose first row is the top.
    OIDN's network is not symmetric under a vertical flip, so the same pixels denoised top-down
    came out differently from a Blender render with denoising on (example scene, 8 spp: max 3.8,
    mean 0.006); denoised bottom-up they are bit-identical to it.
    """
    return LayeredImage(
        {name: np.ascontiguousarray(plane[::-1]) for name, plane in image.channels.items()},
        dict(image.attrs),
    )


def denoise_frame(
    child: BlenderChild, blend: Path, image: LayeredImage, scratch: Path, timeout_s: float
) -> LayeredImage:
    """``image`` with each view layer's Combined denoised by one OIDN call on the whole frame,
    bottom row first as Cycles' in-render denoiser sees it (so the result is Blender's)."""
    prepared, added = prepare(image)
    token = uuid.uuid4().hex
    src = scratch / f"denoise-{token}-in.exr"
    out = scratch / f"denoise-{token}-out.exr"
    try:
        exr.write_layers(src, upside_down(prepared))
        child.denoise(blend, src, out, timeout_s)
        result = upside_down(exr.read_layers(out))
    finally:
        src.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
    for name in added:
        result.channels.pop(name, None)
    result.attrs = dict(image.attrs)
    return result
