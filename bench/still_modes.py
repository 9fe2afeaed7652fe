"""One still frame three ways in one run, each denoised: which still mode is fastest, and does
its image match the full frame?

(a) full frame: one worker renders the whole frame (1x1), the baseline;
(b) tiles: 2x2 tiles on 2 workers, stitched, denoised once;
(c) sample split: 2 workers each render the whole frame with half the samples, merged, denoised.

Each is a complete embedded-farm job (`farm render`: private redis-server, workers, inspection,
assembly), so the times include the farm's fixed start-up. Workers share the machine's cores
(--threads per worker, default cores / workers), as they would share a host. Prints medians
and [min..max] over --runs repetitions, the ratio to (a), and each mode's largest absolute
difference and RMS difference from (a)'s image; then one JSON line with every figure.

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

from farm import embedded, submission  # noqa: E402
from farm.settings import Settings  # noqa: E402
from workers import exr  # noqa: E402

MODES: dict[str, tuple[int, dict[str, Any]]] = {
    "full_frame_1_worker": (1, {"tiles": "1x1"}),
    "tiles_2x2_2_workers": (2, {"tiles": "2x2"}),
    "sample_split_2_workers": (2, {"mode": "sample_split", "split_parts": 2}),
}


def run(mode: str, args: argparse.Namespace, tmp: Path) -> tuple[float, np.ndarray]:
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

    times: dict[str, list[float]] = {m: [] for m in MODES}
    diffs: dict[str, tuple[float, float]] = {}
    for _ in range(args.runs):
        images = {}
        for mode in MODES:  # interleaved, so machine noise falls on every mode alike
            with tempfile.TemporaryDirectory(prefix="still-modes-") as tmp:
                took, images[mode] = run(mode, args, Path(tmp))
            times[mode].append(took)
        base = images["full_frame_1_worker"]
        for mode, image in images.items():
            d = np.abs(image[..., :3] - base[..., :3])
            diffs[mode] = (float(d.max()), float(np.sqrt((d**2).mean())))

    base_s = statistics.median(times["full_frame_1_worker"])
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
        print(f"{mode:<26} {spread:>30} {med / base_s:>7.2f} {diffs[mode][0]:>10.2e} "
              f"{diffs[mode][1]:>10.2e}")  # fmt: skip
        figures[f"{mode}_wall_s"] = round(med, 3)
        figures[f"{mode}_ratio_to_full"] = round(med / base_s, 3)
        figures[f"{mode}_max_abs_diff"] = diffs[mode][0]
        figures[f"{mode}_rms_diff"] = diffs[mode][1]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
