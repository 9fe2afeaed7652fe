"""What the farm costs over plain Blender: one multi-frame job rendered three ways in one run.

(a) one plain bpy process rendering the frames in sequence to EXR (the baseline);
(b) the embedded farm (`farm render`): private redis-server, 1 worker, 2x2 tiles, persistent
    Blender child, stitching, delivering the same EXR frames (like for like: without the MP4
    preview of the animation, which plain Blender does not make);
(bp) the same farm job as a user gets it by default, with its MP4 preview (a colour-managed
    8-bit still per frame made by the Blender child, then the MP4): the preview's own cost;
(c) what most farms do: a fresh Blender process per tile, then the same stitching.

The farm's Blender child runs in its sandbox (FARM_SANDBOX, bwrap unless set to none); with
--unsandboxed the run adds (b0), the same farm job with FARM_SANDBOX=none, for the sandbox's
own cost. Then the cost of a child switch between projects: a worker's child serves one
project's file set, and a tile of another project's file starts a fresh sandboxed child; the
first tile after a switch is timed against a tile of a child that already holds its file.

Prints wall times, the ratios b/a and c/a, the Blender children each farm command started (1:
the worker's pre-started child served every task; 2: the first task switched it) and how long
that first task (the inspection) took on the worker, and the per-tile overhead of (b) in ms two
ways:
all-in, (b - a) / tiles, which spreads the farm's fixed start-up (redis-server, worker, Blender
child, inspection) over the tiles; and marginal, (b - b1) / (tiles - frames), where b1 is the
same farm job with 1x1 tiles in the same run, which is what one more tile costs. Medians and
spreads over --runs repetitions, then one JSON line with every figure. A farm run counts only
when every frame reached the output folder (and, for (bp), the MP4).

    python bench/render_overhead.py [--scene farm/examples/example.blend] [--frames 1-4] [--runs 3]
        [--unsandboxed] [--switches 5]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: rq's line for a task done, the first of which is the job's inspection
FIRST_TASK = re.compile(r"Successfully completed job \S+ in (\d+):(\d+):([\d.]+)s")
sys.path.insert(0, str(REPO))

from farm import embedded, submission  # noqa: E402
from farm.frames import parse_frames  # noqa: E402
from farm.settings import Settings  # noqa: E402
from farm.tiling import Rect, TileGrid, border_floats, plan_tiles  # noqa: E402
from workers import exr  # noqa: E402
from workers.child import BlenderChild  # noqa: E402
from workers.stitching import stitch  # noqa: E402

PLAIN = """
import sys, bpy
path, out, frames = sys.argv[1], sys.argv[2], [int(f) for f in sys.argv[3].split(",")]
samples = int(sys.argv[4])
bpy.ops.wm.open_mainfile(filepath=path, load_ui=False, use_scripts=False)
scene = bpy.context.scene
scene.render.engine = "CYCLES"
if samples:
    scene.cycles.samples = samples
scene.render.use_compositing = False
scene.render.use_sequencer = False
s = scene.render.image_settings
s.media_type = "IMAGE"
s.file_format = "OPEN_EXR"
s.color_depth = "32"
s.exr_codec = "ZIP"
for f in frames:
    scene.frame_set(f)
    scene.render.filepath = f"{out}/frame_{f:04d}.exr"
    bpy.ops.render.render(write_still=True)
"""

ONE_TILE = """
import sys, json, bpy
a = json.loads(sys.argv[1])
bpy.ops.wm.open_mainfile(filepath=a["path"], load_ui=False, use_scripts=False)
scene = bpy.context.scene
scene.render.engine = "CYCLES"
if a["samples"]:
    scene.cycles.samples = a["samples"]
scene.render.use_compositing = False
scene.render.use_sequencer = False
r = scene.render
r.use_border = True
r.use_crop_to_border = True
r.border_min_x, r.border_max_x, r.border_min_y, r.border_max_y = a["border"]
s = r.image_settings
s.media_type = "IMAGE"
s.file_format = "OPEN_EXR"
s.color_depth = "32"
s.exr_codec = "ZIP"
scene.frame_set(a["frame"])
r.filepath = a["out"]
bpy.ops.render.render(write_still=True)
"""


def scene_size(scene: Path) -> tuple[int, int]:
    code = (
        "import sys, bpy; bpy.ops.wm.open_mainfile(filepath=sys.argv[1], use_scripts=False);"
        "r = bpy.context.scene.render;"
        "print(r.resolution_x * r.resolution_percentage // 100,"
        " r.resolution_y * r.resolution_percentage // 100)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(scene)], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[-2]), int(out[-1])


def run_plain(scene: Path, frames: list[int], tmp: Path, samples: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            PLAIN,
            str(scene),
            str(tmp),
            ",".join(map(str, frames)),
            str(samples),
        ],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def run_farm(
    scene: Path,
    frames: list[int],
    tmp: Path,
    tiles: str,
    samples: int,
    sandbox: str = "",
    preview: bool = False,
) -> tuple[float, int, float]:
    """Seconds of one `farm render`, the Blender children its worker started, and the seconds
    its first task (the inspection) took on the worker, as rq logs it. Raises unless every
    frame (and with ``preview`` the MP4) was delivered."""
    settings = Settings().with_(storage_dir=tmp / "storage", work_dir=tmp / "work")
    if sandbox:
        settings = settings.with_(sandbox=sandbox)
    req = submission.RenderRequest(
        output=tmp / "out",
        frames=",".join(map(str, frames)),
        tiles=tiles,
        formats="exr",
        samples=samples or None,
        preview=preview,
    )
    t0 = time.perf_counter()
    embedded.render(settings, scene, req, 1, io.StringIO(), keep_dir=tmp / "logs")
    seconds = time.perf_counter() - t0
    wanted = [f"frame_{f:04d}.exr" for f in frames] + (["preview.mp4"] if preview else [])
    missing = [name for name in wanted if not (tmp / "out" / name).is_file()]
    if missing:
        raise SystemExit(f"the farm run delivered no {', '.join(missing)}: it does not count")
    # the worker starts one child; each switch to the job's files starts another
    text = "".join(p.read_text(errors="replace") for p in (tmp / "logs").glob("*.log"))
    first = FIRST_TASK.search(text)
    first_s = float(first[1]) * 3600 + float(first[2]) * 60 + float(first[3]) if first else 0.0
    return seconds, 1 + text.count("event=child_switch"), first_s


def run_process_per_tile(
    scene: Path, frames: list[int], tmp: Path, tiles: str, size: tuple[int, int], samples: int
) -> float:
    width, height = size
    plans = plan_tiles(width, height, TileGrid.parse(tiles))
    t0 = time.perf_counter()
    for f in frames:
        arrays = []
        for p in plans:
            out = tmp / f"t{f}-{p.index}.exr"
            arg = {
                "path": str(scene),
                "frame": f,
                "out": str(out),
                "border": border_floats(p.render, width, height),
                "samples": samples,
            }
            subprocess.run(
                [sys.executable, "-c", ONE_TILE, json.dumps(arg)], check=True, capture_output=True
            )
            arrays.append((p, exr.read_rgba(out)))
        exr.write_rgba(tmp / f"frame_{f:04d}.exr", stitch(width, height, arrays))
    return time.perf_counter() - t0


def run_switches(
    scene: Path, tmp: Path, size: tuple[int, int], samples: int, switches: int
) -> dict[str, list[float]]:
    """One tile of ``scene`` rendered by a sandboxed child, alternating between two projects'
    copies of it: seconds of the first tile after each switch (the old child ended, a fresh
    one started, the file loaded, the tile rendered), of the next tile (the child holds the
    file), and of the child's start alone."""
    width, height = size
    rect = plan_tiles(width, height, TileGrid.parse("2x2"))[0].render
    roots = [tmp / "project-a", tmp / "project-b"]
    for root in roots:
        root.mkdir()
        shutil.copy(scene, root / scene.name)
    settings = Settings().with_(work_dir=tmp / "work")
    out: dict[str, list[float]] = {"switch_s": [], "kept_s": [], "start_s": []}
    with BlenderChild.for_settings(settings, "bench") as child:
        for i in range(switches + 1):
            root = roots[i % 2]
            t0 = time.perf_counter()
            child.use(f"project-{i % 2}", root)
            first = time.perf_counter() - t0
            first += _tile(child, root / scene.name, width, height, rect, samples)
            kept = _tile(child, root / scene.name, width, height, rect, samples)
            if i:  # the first start is the worker's own, not a switch
                out["switch_s"].append(first)
                out["kept_s"].append(kept)
                out["start_s"].append(child.start_s or 0.0)
    return out


def _tile(
    child: BlenderChild, blend: Path, width: int, height: int, rect: Rect, samples: int
) -> float:
    t0 = time.perf_counter()
    child.render(blend, frame=1, width=width, height=height, rect=rect, samples=samples or None,
                 out_path=child.work_dir / "tile.exr", timeout_s=600)  # fmt: skip
    return time.perf_counter() - t0


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scene", type=Path, default=REPO / "farm" / "examples" / "example.blend")
    ap.add_argument("--frames", default="1-6", help="default: the example's whole animation")
    ap.add_argument("--tiles", default="2x2")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=0, help="override the scene's samples")
    ap.add_argument("--unsandboxed", action="store_true",
                    help="also run (b0): the farm job with FARM_SANDBOX=none")  # fmt: skip
    ap.add_argument("--switches", type=int, default=5, help="child switches timed; 0 = none")
    args = ap.parse_args()
    frames = parse_frames(args.frames)
    size = scene_size(args.scene)
    n_tiles = len(frames) * TileGrid.parse(args.tiles).count
    n_frames = len(frames)
    a, b, bp, b0, b1, c, overhead_ms, marginal_ms = [], [], [], [], [], [], [], []
    children: list[float] = []
    first_task: list[float] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            for sub in ("a", "b", "bp", "b0", "b1", "c"):
                (tmp / sub).mkdir()
            n = args.samples
            # plain and farm in turn, the farm first every other run: a machine whose speed
            # drifts within a run moves the ratio both ways, not one
            if run % 2:
                seconds, started, first_s = run_farm(args.scene, frames, tmp / "b", args.tiles, n)
                a.append(run_plain(args.scene, frames, tmp / "a", n))
            else:
                a.append(run_plain(args.scene, frames, tmp / "a", n))
                seconds, started, first_s = run_farm(args.scene, frames, tmp / "b", args.tiles, n)
            b.append(seconds)
            children.append(started)
            first_task.append(first_s)
            bp.append(run_farm(args.scene, frames, tmp / "bp", args.tiles, n, preview=True)[0])
            if args.unsandboxed:
                b0.append(run_farm(args.scene, frames, tmp / "b0", args.tiles, n, "none")[0])
            b1.append(run_farm(args.scene, frames, tmp / "b1", "1x1", n)[0])
            c.append(run_process_per_tile(args.scene, frames, tmp / "c", args.tiles, size, n))
        overhead_ms.append((b[-1] - a[-1]) / n_tiles * 1000)
        marginal_ms.append((b[-1] - b1[-1]) / max(1, n_tiles - n_frames) * 1000)
        print(
            f"run {run + 1}: plain {a[-1]:.2f} s, farm {b[-1]:.2f} s, with the MP4 preview "
            f"{bp[-1]:.2f} s, farm 1x1 {b1[-1]:.2f} s, "
            f"process per tile {c[-1]:.2f} s",
            flush=True,
        )
    ratio_b = [y / x for x, y in zip(a, b, strict=True)]
    ratio_c = [y / x for x, y in zip(a, c, strict=True)]
    print(
        f"scene {args.scene.name} {size[0]}x{size[1]}, frames {args.frames}, "
        f"tiles {args.tiles} ({n_tiles} tiles), samples {args.samples or 'as saved'}, "
        f"{args.runs} runs"
    )
    print(
        f"(a) plain bpy          median {statistics.median(a):7.2f} s  "
        f"[{min(a):.2f} .. {max(a):.2f}]"
    )
    print(
        f"(b) embedded farm      median {statistics.median(b):7.2f} s  "
        f"[{min(b):.2f} .. {max(b):.2f}]  b/a {statistics.median(ratio_b):.3f} "
        f"[{min(ratio_b):.3f} .. {max(ratio_b):.3f}]; Blender children started per command: "
        f"{', '.join(str(int(k)) for k in children)}; first task (inspection) "
        f"{statistics.median(first_task):.3f} s [{min(first_task):.3f} .. {max(first_task):.3f}]"
    )
    preview_s = [y - x for x, y in zip(b, bp, strict=True)]
    print(
        f"(bp) farm + MP4 preview median {statistics.median(bp):6.2f} s  "
        f"[{min(bp):.2f} .. {max(bp):.2f}]  bp/a "
        f"{statistics.median([y / x for x, y in zip(a, bp, strict=True)]):.3f}; the preview "
        f"costs bp-b {statistics.median(preview_s):.2f} s per command "
        f"[{min(preview_s):.2f} .. {max(preview_s):.2f}]"
    )
    print(
        f"(c) process per tile   median {statistics.median(c):7.2f} s  "
        f"[{min(c):.2f} .. {max(c):.2f}]  c/a {statistics.median(ratio_c):.3f}"
    )
    print(
        f"    embedded farm 1x1  median {statistics.median(b1):7.2f} s  "
        f"[{min(b1):.2f} .. {max(b1):.2f}]"
    )
    if b0:
        sandbox_ms = [(y - x) / n_tiles * 1000 for x, y in zip(b0, b, strict=True)]
        print(
            f"(b0) farm, no sandbox  median {statistics.median(b0):7.2f} s  "
            f"[{min(b0):.2f} .. {max(b0):.2f}]  b0/a "
            f"{statistics.median([y / x for x, y in zip(a, b0, strict=True)]):.3f}; "
            f"the sandbox costs (b-b0)/tiles {statistics.median(sandbox_ms):.1f} ms per tile "
            f"[{min(sandbox_ms):.1f} .. {max(sandbox_ms):.1f}]"
        )
    switching: dict[str, list[float]] = {}
    if args.switches:
        with tempfile.TemporaryDirectory() as d:
            switching = run_switches(args.scene, Path(d), size, args.samples, args.switches)
        cost = [s - k for s, k in zip(switching["switch_s"], switching["kept_s"], strict=True)]
        switching["switch_cost_s"] = cost
        print(
            f"child switch between projects ({args.switches}x, one 2x2 tile): first tile "
            f"{statistics.median(switching['switch_s']):.3f} s, next tile "
            f"{statistics.median(switching['kept_s']):.3f} s; a switch costs "
            f"{statistics.median(cost):.3f} s [{min(cost):.3f} .. {max(cost):.3f}], of which "
            f"the sandboxed child's start {statistics.median(switching['start_s']):.3f} s"
        )
    print(
        f"per-tile overhead of (b), all-in (b-a)/tiles: median "
        f"{statistics.median(overhead_ms):.1f} ms "
        f"[{min(overhead_ms):.1f} .. {max(overhead_ms):.1f}]"
    )
    print(
        f"per-tile overhead of (b), marginal (b-b1)/(tiles-frames): median "
        f"{statistics.median(marginal_ms):.1f} ms "
        f"[{min(marginal_ms):.1f} .. {max(marginal_ms):.1f}]"
    )
    print(
        json.dumps(
            {
                "bench": "render_overhead",
                "scene": args.scene.name,
                "width_px": size[0],
                "height_px": size[1],
                "frames": len(frames),
                "tiles": n_tiles,
                "samples": args.samples or None,
                "runs": args.runs,
                "plain_s": spread(a),
                "farm_s": spread(b),
                "farm_with_preview_s": spread(bp),
                "preview_cost_s": spread(preview_s),
                "farm_blender_children": spread(children),
                "farm_first_task_s": spread(first_task),
                "process_per_tile_s": spread(c),
                "farm_over_plain_ratio": spread(ratio_b),
                "process_per_tile_over_plain_ratio": spread(ratio_c),
                "farm_overhead_per_tile_ms": spread(overhead_ms),
                "farm_marginal_cost_per_tile_ms": spread(marginal_ms),
                **({"farm_unsandboxed_s": spread(b0)} if b0 else {}),
                **{f"child_{k}": spread(v) for k, v in switching.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
