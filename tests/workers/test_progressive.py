"""Live-preview merging: plain RGBA passes merged as they land are honest images of the samples
so far, and all of them the full-sample image (the render itself: tests/web/test_live_preview)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from farm.passschedule import pass_schedule
from workers import exr, progressive
from workers.samplesplit import merge_parts


def test_rgba_passes_merge_to_the_mean_of_every_sample_so_far(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    total = 64
    # one "sample" per slice: a pass's pixels are the mean of its run of samples
    samples = rng.random((total, 3, 5, 4)).astype(np.float32)
    parts = []
    for number, (offset, count) in enumerate(pass_schedule(total), start=1):
        path = tmp_path / f"p{number}.exr"
        exr.write_rgba(path, samples[offset : offset + count].mean(axis=0))
        parts.append((progressive._read(path, layered=False), count))
        merged = merge_parts(parts)
        so_far = samples[: offset + count].mean(axis=0)
        got = np.stack([merged.channels[c] for c in "RGBA"], axis=-1)
        assert np.abs(got - so_far).max() <= 1e-6 + 1e-6 * np.abs(so_far).max()
    out = tmp_path / "tile.exr"
    progressive._write(out, merged, layered=False)
    assert np.abs(exr.read_rgba(out) - samples.mean(axis=0)).max() <= 2e-6
