"""Sample-split stills: which samples each part renders, and merging the parts as Cycles does.

N workers render the whole frame, each a disjoint run of the samples (Cycles' sample subset:
``sample_offset``, ``sample_subset_length``); the parts merge into the image one render of all
the samples gives, up to float rounding, the way Cycles' own ``merge`` (``cycles.merge_images``)
weighs them: each part's pixels count by its share of the samples.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from farm.errors import BadParameter, RenderError
from workers.exr import LayeredImage

#: passes that are not an average over samples: the first part's value is kept (Cycles' merge
#: copies them too); Cryptomatte ranks objects per pixel, so its coverage cannot be averaged
_COPIED = re.compile(r"^(Depth|IndexMA|IndexOB|Crypto.*)$")
#: passes Cycles sums over parts (debug timings)
_SUMMED = re.compile(r"^(Debug BVH.*|Debug Ray.*|Debug Render Time.*)$")


def split_samples(total: int, parts: int) -> list[tuple[int, int]]:
    """``(sample_offset, sample_count)`` of each part: disjoint, balanced, covering 0..total-1."""
    if parts < 1:
        raise BadParameter(f"a sample split needs at least one part, not {parts}")
    if total < parts:
        raise BadParameter(
            f"cannot split {total} sample(s) into {parts} parts: each part needs a sample"
        )
    cuts = [(i * total) // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1] - cuts[i]) for i in range(parts)]


def _pass_of(channel: str) -> tuple[str, str]:
    """(layer, pass) of ``Layer.Pass.Channel``; layer is '' for a channel outside any layer."""
    head, _, _ = channel.rpartition(".")
    layer, _, pass_name = head.rpartition(".")
    return layer, pass_name or head or channel


def merge_parts(parts: Sequence[tuple[LayeredImage, int]]) -> LayeredImage:
    """Merge ``(image, samples it rendered)`` parts into one image of all their samples.

    Averaged passes: ``sum(part * part_samples / total)`` in float32, part by part in order,
    as Cycles' merge computes it; so the result equals one render of every sample up to float
    rounding (a few ULPs). Depth, object/material index and Cryptomatte come from the first
    part. Parts must have the same size and channels.
    """
    if not parts:
        raise RenderError("no sample-split parts to merge")
    first, _ = parts[0]
    names = list(first.channels)
    for index, (image, samples) in enumerate(parts):
        if samples < 1:
            raise RenderError(f"sample-split part {index} rendered {samples} samples")
        if image.shape != first.shape or set(image.channels) != set(names):
            raise RenderError(
                f"sample-split part {index} does not match part 0: size {image.shape} vs "
                f"{first.shape}, or different passes",
                part=index,
            )
    total = sum(samples for _, samples in parts)
    out: dict[str, npt.NDArray[np.float32]] = {}
    for name in names:
        _, pass_name = _pass_of(name)
        if _COPIED.match(pass_name):
            out[name] = first.channels[name].copy()
            continue
        acc = np.zeros(first.shape, np.float32)
        for image, samples in parts:
            if _SUMMED.match(pass_name):
                acc += image.channels[name]
            else:
                acc += image.channels[name] * np.float32(samples / total)
        out[name] = acc
    attrs = dict(first.attrs)
    layers = {_pass_of(n)[0] for n in names if _pass_of(n)[0]}
    for layer in layers:
        # what Cycles' merge writes, and what its standalone denoiser reads
        attrs[f"cycles.{layer}.samples"] = str(total)
    return LayeredImage(out, attrs)
