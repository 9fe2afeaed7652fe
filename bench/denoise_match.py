"""Does the farm's denoised frame equal Blender's? A plain bpy render with Cycles' in-render
denoiser on (the file's own denoise settings) against the farm's path, per scene and samples.

For each scene and sample count, in one run:
(a) Blender: one plain bpy process renders the frame with denoising on, the reference;
(b) farm: a complete embedded-farm job (`farm render --tiles 2x2 --denoise`, 2 workers): tiles
    rendered with the denoising passes, stitched, denoised once on the whole frame;
(c) baseline: the farm's denoise as it was before (the stitched frame handed to the standalone
    denoiser top row first), from one full-frame render of the same passes.

Prints the largest and the mean absolute difference of (b) and (c) to (a), RGBA, then one JSON
line with every figure. Target: (b) max |d| <= 1e-3 in every case; no verdict for a case whose
(a) is blank or not the size asked (an empty frame equals an empty frame).

    python bench/denoise_match.py [--samples 8,64,128] [--resolution 192x108]
"""

from __future__ import annotations

import argparse
import io
import json
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
from tests.blendscenes import make_scene  # noqa: E402
from tests.workers.inrender import render_denoised  # noqa: E402
from workers import exr  # noqa: E402
from workers.child import BlenderChild  # noqa: E402
from workers.denoise import prepare  # noqa: E402

TARGET_MAX_ABS = 1e-3
TIMEOUT_S = 600.0


def farm(blend: Path, width: int, height: int, samples: int, tmp: Path) -> npt.NDArray[Any]:
    settings = Settings().with_(storage_dir=tmp / "storage", work_dir=tmp / "work")
    req = submission.RenderRequest(
        output=tmp / "o", frames="1", samples=samples, resolution=f"{width}x{height}",
        tiles="2x2", formats="exr", denoise=True,
    )  # fmt: skip
    outcome = embedded.render(settings, blend, req, 2, io.StringIO())
    if outcome.job.state != "done":
        raise SystemExit(f"farm job ended {outcome.job.state}: {outcome.job.reason}")
    return exr.read_rgba(tmp / "o" / "frame_0001.exr")


def top_down(blend: Path, width: int, height: int, samples: int, tmp: Path) -> npt.NDArray[Any]:
    """The farm's denoise before the fix: the frame handed over top row first."""
    with BlenderChild(python=sys.executable, work_dir=tmp, name="baseline") as child:
        noisy = tmp / "noisy.exr"
        child.render(blend, frame=1, width=width, height=height, rect=None, samples=samples,
                     out_path=noisy, timeout_s=TIMEOUT_S,
                     options={"layers": True, "denoise_data": True})  # fmt: skip
        prepared, _ = prepare(exr.read_layers(noisy))
        src, out = tmp / "td-in.exr", tmp / "td-out.exr"
        exr.write_layers(src, prepared)
        child.denoise(blend, src, out, TIMEOUT_S)
        layers = exr.read_layers(out)
    return layers.rgba(f"{next(iter(layers.passes())).rsplit('.', 1)[0]}.Combined")


def diff(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> dict[str, float]:
    d = np.abs(got.astype(np.float64) - want)
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=str(REPO / "farm/examples/example.blend"))
    parser.add_argument("--resolution", default="192x108", help="both scenes' frame, WxH px")
    parser.add_argument("--samples", default="8,64,128")
    args = parser.parse_args()
    width, height = (int(v) for v in args.resolution.split("x"))
    counts = [int(v) for v in args.samples.split(",")]
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="denoise-match-") as tmp_name:
        tmp = Path(tmp_name)
        scenes = {
            "example": Path(args.example),
            "test_scene": make_scene(tmp / "test_scene.blend", width=width, height=height),
        }
        for name, blend in scenes.items():
            for samples in counts:
                case = tmp / f"{name}-{samples}"
                case.mkdir()
                t0 = time.perf_counter()
                reference = render_denoised(
                    blend, case / "blender.exr", width=width, height=height, samples=samples
                )
                want = exr.read_rgba(reference)
                got = farm(blend, width, height, samples, case / "farm")
                before = top_down(blend, width, height, samples, case / "before")
                row: dict[str, Any] = {
                    "scene": name,
                    "samples": samples,
                    "resolution": f"{width}x{height}",
                    "farm": diff(got, want),
                    "baseline_top_down": diff(before, want),
                    "case_s": round(time.perf_counter() - t0, 1),
                }
                delivered = want.shape == (height, width, 4) and float(np.abs(want).max()) > 0
                if delivered:
                    row["target_met"] = row["farm"]["max_abs"] <= TARGET_MAX_ABS
                cases.append(row)
                f, b = row["farm"], row["baseline_top_down"]
                print(
                    f"{name:10s} {samples:4d} spp  farm: max {f['max_abs']:.3g} mean "
                    f"{f['mean_abs']:.3g}   before: max {b['max_abs']:.3g} mean "
                    f"{b['mean_abs']:.3g}   verdict: "
                    f"{row.get('target_met', 'none (blank frame)')}",
                    flush=True,
                )
    print(json.dumps({"bench": "denoise_match", "target_max_abs": TARGET_MAX_ABS,
                      "metric": "abs difference of linear RGBA to Blender's denoised frame",
                      "cases": cases}))  # fmt: skip


if __name__ == "__main__":
    main()
