"""One still frame three ways in one run, each denoised: which still mode is fastest, and does
its image match the full frame?

(a) full frame: one worker renders the whole frame (1x1), the baseline;
(b) tiles: 2x2 tiles on 2 workers, stitched, denoised once;
(c) sample split: 2 workers each render the whole frame with half the samples, merged, denoised.

Each is a complete embedded-farm job (`farm render`: private redis-server, workers, inspection,
assembly), so the times include the farm's fixed start-up. Workers share the machine's cores
(--threads per worker, default cores / workers), as they would share a host. Prints medians
and [min..max] over --runs repetitions, the ratio to (a), and each mode's largest absolute
difference and RMS difference from (a)'s image of the same run, the worst over every run; then
one JSON line with every figure.

Targets: tiles equal to the full frame, the sample split within float rounding of it
(max |d| <= 1e-3), in every run; no verdict when (a)'s image is blank or not the size asked
(an empty frame equals an empty frame).

    python bench/still_modes.py [--scene farm/examples/example.blend] [--resolution 384x216]
        [--samples 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402

from farm import embedded, submission  # noqa: E402
from farm.settings import Settings  # noqa: E402
from workers import exr  # noqa: E402

MODES: dict[str, tuple[int, dict[str, Any]]] = {
    "full_frame_1_worker": (1, {"tiles": "1x1"}),
    "tiles_2x2_2_workers": (2, {"tiles": "2x2"}),
    "sample_split_2_workers": (2, {"mode": "sample_split", "split_parts": 2}),
}
BASE = "full_frame_1_worker"
#: the largest absolute difference from (a) each mode may show in any run
TOLERANCE = {"tiles_2x2_2_workers": 0.0, "sample_split_2_workers": 1e-3}


def run(mode: str, args: argparse.Namespace, tmp: Path) -> tuple[float, npt.NDArray[np.float32]]:
    workers, options = MODES[mode]
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // workers)
    settings = Settings().with_(
        storage_dir=tmp / "storage", work_dir=tmp / "work", cpu_threads=threads
    )
    req = submission.RenderRequest(
        output=tmp / "o", frames=str(args.frame), samples=args.samples,
        resolution=args.resolution, formats="exr", denoise=True, **options,
    )  # fmt: skip
    t0 = time.perf_counter()
    outcome = embedded.render(settings, Path(args.scene), req, workers, io.StringIO())
    took = time.perf_counter() - t0
    if outcome.job.state != "done":
        raise SystemExit(f"{mode}: job ended {outcome.job.state}: {outcome.job.reason}")
    return took, exr.read_rgba(tmp / "o" / f"frame_{args.frame:04d}.exr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", default=str(REPO / "farm/examples/example.blend"))
    parser.add_argument("--resolution", default="384x216")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--frame", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="Cycles threads per worker")
    args = parser.parse_args()

    width, height = (int(v) for v in args.resolution.lower().split("x"))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    # per mode, each run's (max |d|, rms d) from that run's full frame
    diffs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    blank_or_wrong_size = 0
    for index in range(args.runs):
        images = {}
        for mode in MODES:  # interleaved, so machine noise falls on every mode alike
            with tempfile.TemporaryDirectory(prefix="still-modes-") as tmp:
                took, images[mode] = run(mode, args, Path(tmp))
            times[mode].append(took)
        base = images[BASE]
        if base.shape[:2] != (height, width) or not np.any(base[..., :3] > 0):
            blank_or_wrong_size += 1
        for mode, image in images.items():
            if image.shape != base.shape:
                raise SystemExit(f"run {index + 1}: {mode} is {image.shape}, {BASE} {base.shape}")
            d = np.abs(image[..., :3] - base[..., :3])
            diffs[mode].append((float(d.max()), float(np.sqrt((d**2).mean()))))
        compared = [f"{m} max |d| {diffs[m][-1][0]:.2e}" for m in MODES if m != BASE]
        print(f"run {index + 1}: " + ", ".join(compared), flush=True)

    base_s = statistics.median(times[BASE])
    print(f"still {args.resolution}, {args.samples} samples, denoised; {args.runs} run(s); "
          f"{os.cpu_count()} cores")  # fmt: skip
    print(f"{'mode':<26} {'wall s (median [min..max])':>30} {'x full':>7} {'max |d|':>10} "
          f"{'rms d':>10}")  # fmt: skip
    figures: dict[str, float | int | str] = {
        "resolution": args.resolution, "samples": args.samples, "runs": args.runs,
    }  # fmt: skip
    for mode, values in times.items():
        med = statistics.median(values)
        spread = f"{med:.2f} [{min(values):.2f}..{max(values):.2f}]"
        # the worst run's differences: a mismatch in any run shows
        max_abs = max(d[0] for d in diffs[mode])
        rms = max(d[1] for d in diffs[mode])
        print(f"{mode:<26} {spread:>30} {med / base_s:>7.2f} {max_abs:>10.2e} "
              f"{rms:>10.2e}")  # fmt: skip
        figures[f"{mode}_wall_s"] = round(med, 3)
        figures[f"{mode}_ratio_to_full"] = round(med / base_s, 3)
        figures[f"{mode}_max_abs_diff"] = max_abs
        figures[f"{mode}_rms_diff"] = rms
    figures["runs_compared"] = len(diffs[BASE])
    print("\ntargets")
    for mode, bound in TOLERANCE.items():
        max_abs = float(figures[f"{mode}_max_abs_diff"])
        if blank_or_wrong_size or len(diffs[mode]) != args.runs:
            verdict = f"no verdict ({blank_or_wrong_size} run(s) with a blank or wrong-size {BASE})"
        else:
            verdict = "met" if max_abs <= bound else "NOT met"
        figures[f"{mode}_match_verdict"] = verdict.split(" (")[0]
        print(f"  {mode} max |d| {max_abs:.2e} in {args.runs} run(s) (target <= {bound:g}): "
              f"{verdict}")  # fmt: skip
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
