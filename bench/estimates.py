"""How good the farm's estimates are: estimate, then render, a set of scenes on a private farm.

Scenes: the bundled ones (farm/examples/example.blend, tests/data/blend) and ones this
benchmark builds with bpy to vary the cost: heavy geometry, many samples, a large frame, a
volume, adaptive sampling, a longer animation, denoising. Each is estimated through the same
path as `farm submit --estimate` (an inspection with the probe on one CPU worker), then
submitted with that report and rendered; the farm checks the estimate against the tasks' render
times when the job is done (farm.estimaterecords). Only jobs that rendered count.

Prints, per scene, the estimate and the actual render device-seconds, the error (and the same
in CPU time, which the host's other load changes far less: nearer the model's own error on a
shared machine), what the probe cost (its render time, and the estimate's wall time with the
inspection) against the job's render time; then the median and 90th percentile of the absolute
error (target: median <= 15 %, p90 <= 35 %) and the estimating cost (target: <= 5 % of the
render time or <= 10 s, whichever is larger), and ends with one JSON line.

    python bench/estimates.py [--short] [--runs 1] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from farm import estimaterecords, jobstore, queue, submission  # noqa: E402
from farm.accept import accept, estimate_job  # noqa: E402
from farm.alloc.allocator import SlotAllocator  # noqa: E402
from farm.models import BlendSource  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402
from farm.settings import Settings  # noqa: E402
from farm.storage.base import sha256_file  # noqa: E402
from farm.taskrecords import TaskRecords  # noqa: E402

#: builds one scene: argv = out path, then a JSON spec (kind, width, height, samples, frames)
BUILD = r"""
import json, math, sys, bpy
out, spec = sys.argv[-2], json.loads(sys.argv[-1])
bpy.ops.wm.read_factory_settings(use_empty=True)
bpy.context.preferences.filepaths.save_version = 0
scene = bpy.context.scene
scene.render.engine = "CYCLES"
scene.cycles.device = "CPU"
scene.render.resolution_x, scene.render.resolution_y = spec["width"], spec["height"]
scene.render.resolution_percentage = 100
scene.cycles.samples = spec["samples"]
scene.cycles.use_adaptive_sampling = spec.get("adaptive", False)
scene.cycles.adaptive_threshold = spec.get("threshold", 0.01)
scene.cycles.use_denoising = False
scene.frame_start, scene.frame_end = 1, spec["frames"]

def material(name, color, **inputs):
    mat = bpy.data.materials.new(name)
    mat.use_nodes = True
    bsdf = mat.node_tree.nodes["Principled BSDF"]
    bsdf.inputs["Base Color"].default_value = (*color, 1.0)
    for key, value in inputs.items():
        bsdf.inputs[key].default_value = value
    return mat

bpy.ops.mesh.primitive_plane_add(size=20)
bpy.context.object.data.materials.append(material("floor", (0.6, 0.6, 0.6)))
bpy.ops.mesh.primitive_cube_add(location=(-1.5, 0, 1))
cube = bpy.context.object
cube.data.materials.append(material("metal", (0.9, 0.6, 0.2), Metallic=1.0, Roughness=0.2))
cube.location = (-2.5, 0, 1)
cube.keyframe_insert("location", frame=1)
cube.location = (1.0, 1.5, 1.5)
cube.keyframe_insert("location", frame=max(2, spec["frames"]))
bpy.ops.mesh.primitive_uv_sphere_add(location=(1.5, 0, 1))
bpy.context.object.data.materials.append(
    material("glass", (0.9, 0.9, 1.0), Roughness=0.05, **{"Transmission Weight": 1.0}))
if spec["kind"] == "geometry":
    for i in range(4):
        bpy.ops.mesh.primitive_ico_sphere_add(subdivisions=7, radius=0.7,
                                              location=(-3 + 2 * i, 3, 0.8))
        bpy.context.object.data.materials.append(material(f"g{i}", (0.2, 0.5, 0.8)))
if spec["kind"] == "volume":
    bpy.ops.mesh.primitive_cube_add(size=6, location=(0, 0, 2))
    vol = bpy.data.materials.new("fog")
    vol.use_nodes = True
    nodes = vol.node_tree.nodes
    nodes.remove(nodes["Principled BSDF"])
    pv = nodes.new("ShaderNodeVolumePrincipled")
    pv.inputs["Density"].default_value = 0.4
    vol.node_tree.links.new(pv.outputs[0], nodes["Material Output"].inputs["Volume"])
    bpy.context.object.data.materials.append(vol)
bpy.ops.object.light_add(type="POINT", location=(2, -2, 5))
bpy.context.object.data.energy = 1500
bpy.ops.object.light_add(type="AREA", location=(-3, -1, 4))
bpy.context.object.data.energy = 400
bpy.ops.object.camera_add(location=(0, -9, 4), rotation=(math.radians(72), 0, 0))
scene.camera = bpy.context.object
world = bpy.data.worlds.new("w")
world.use_nodes = True
world.node_tree.nodes["Background"].inputs["Strength"].default_value = 0.4
scene.world = world
bpy.ops.wm.save_as_mainfile(filepath=out, compress=False)
"""


@dataclass(frozen=True)
class Scene:
    name: str
    #: a bundled file, or None: built from ``build``
    path: Path | None
    #: job options (the estimate is asked for the same job that renders)
    options: dict[str, Any]
    build: dict[str, Any] = field(default_factory=dict)


DATA = REPO / "tests" / "data" / "blend"
SCENES = [
    Scene("example", REPO / "farm/examples/example.blend", {"frames": "1-3"}),
    Scene("principled", DATA / "01_principled_material.blend",
          {"frames": "1", "resolution": "320x180", "samples": 48}),
    Scene("anim_driver", DATA / "12_anim_range_driver.blend",
          {"frames": "1-3", "resolution": "240x135", "samples": 48}),
    Scene("geometry", None, {}, {"kind": "geometry", "width": 240, "height": 135,
                                 "samples": 24, "frames": 2}),
    Scene("samples", None, {}, {"kind": "plain", "width": 160, "height": 90,
                                "samples": 384, "frames": 1}),
    Scene("resolution", None, {}, {"kind": "plain", "width": 640, "height": 360,
                                   "samples": 12, "frames": 1}),
    Scene("volume", None, {}, {"kind": "volume", "width": 200, "height": 112,
                               "samples": 48, "frames": 1}),
    Scene("adaptive", None, {}, {"kind": "plain", "width": 240, "height": 135,
                                 "samples": 512, "frames": 1, "adaptive": True,
                                 "threshold": 0.05}),
    Scene("animation", None, {"tiles": "1x1"}, {"kind": "plain", "width": 160,
                                                "height": 90, "samples": 32, "frames": 8}),
    Scene("denoise", None, {"denoise": True}, {"kind": "plain", "width": 320,
                                                "height": 180, "samples": 16, "frames": 1}),
]  # fmt: skip
SHORT = ("example", "volume", "adaptive")


def build(scene: Scene, folder: Path) -> Path:
    if scene.path is not None:
        return scene.path
    out = folder / f"{scene.name}.blend"
    subprocess.run(
        [sys.executable, "-c", BUILD, str(out), json.dumps(scene.build)],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return out


def wait_worker(url: str, timeout_s: float = 120) -> None:
    conn = queue.connect(url)
    deadline = time.monotonic() + timeout_s
    while not queue.live_workers(conn, "cpu"):
        if time.monotonic() > deadline:
            raise SystemExit("no worker came up")
        time.sleep(0.1)
    conn.close()


def wait_done(store: jobstore.JobStore, job_id: str, timeout_s: float = 1800) -> str:
    deadline, after = time.monotonic() + timeout_s, "0"
    while time.monotonic() < deadline:
        for event in store.events(job_id, after, block_ms=500):
            after = event.id
            if event.type == "job_state" and event.state in ("done", "failed", "canceled"):
                return event.state
    return "timeout"


def run_scene(settings: Settings, scene: Scene, blend: Path, out: Path) -> dict[str, Any]:
    store = jobstore.JobStore(jobstore.connect(settings.redis_url), settings.lease_ttl_s)
    q = queue.RenderQueue(queue.connect(settings.redis_url), "cpu")
    allocator = SlotAllocator(store.conn, ttl_s=settings.lease_ttl_s)
    # read where it lies, with the files beside it (the bundled scene's textures), as
    # `farm render` does
    blend = blend.resolve()
    source = BlendSource("path", str(blend), sha256_file(blend), blend.name)
    opts = {"formats": "exr", "tiles": "2x2", **scene.options}
    req = submission.RenderRequest(output=out / "frames", **opts)
    t0 = time.perf_counter()
    quoted = estimate_job(settings, store, q, req, source, allocator)
    estimate_wall_s = time.perf_counter() - t0
    accepted = accept(settings, store, q, req, source, report=quoted.report, allocator=allocator)
    t1 = time.perf_counter()
    state = wait_done(store, accepted.job_id)
    job_wall_s = time.perf_counter() - t1
    check = None
    deadline = time.monotonic() + 10
    while check is None and time.monotonic() < deadline and state == "done":
        _est, check = estimaterecords.of_job(store.conn, accepted.job_id)
        time.sleep(0.05)
    cpu = quoted.estimate.on("cpu")
    assert cpu is not None
    # the same in CPU time: what the renders cost whatever else the machine ran meanwhile
    probe = quoted.report.probe or {}
    busy = probe["cpu_s"] / probe["render_s"] if probe.get("render_s") else 1.0
    done = [estimaterecords.committed(r) for r in TaskRecords(store.conn).rows(accepted.job_id)]
    actual_cpu = sum(a.cpu_s or 0.0 for a in done if a is not None)
    estimated_cpu = cpu.render_s * busy
    return {
        "scene": scene.name,
        "state": state,
        "frames": len(accepted.spec.frames),
        "estimated_s": cpu.render_s,
        "actual_s": check.actual_s if check else None,
        "error": check.error if check else None,
        "probe_s": quoted.estimate.probe_s,
        "estimate_wall_s": round(estimate_wall_s, 3),
        "job_wall_s": round(job_wall_s, 3),
        "denoise_estimate_s": round(cpu.device_s - cpu.render_s, 3),
        "estimated_cpu_s": round(estimated_cpu, 3),
        "actual_cpu_s": round(actual_cpu, 3),
        "cpu_error": round((estimated_cpu - actual_cpu) / actual_cpu, 4) if actual_cpu else None,
        "load": os.getloadavg()[0],
        "probe": quoted.report.probe,
    }


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def line(row: dict[str, Any]) -> str:
    return (
        f"{row['scene']:<12} {row['state']:<6} est {row['estimated_s']:8.2f} s  actual "
        f"{row['actual_s'] or 0:8.2f} s  error {pct(row['error']):>7}  CPU-time error "
        f"{pct(row['cpu_error']):>7}  probe {row['probe_s']:5.2f} s  estimate "
        f"{row['estimate_wall_s']:5.2f} s  load {row['load']:.1f}"
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help=f"only {', '.join(SHORT)}, once")
    parser.add_argument("--runs", type=int, default=1, help="repetitions of every scene")
    parser.add_argument("--only", help="comma-separated scene names")
    parser.add_argument("--keep", type=Path, help="keep the work folder (worker log) here")
    args = parser.parse_args()
    chosen = [s for s in SCENES if not args.short or s.name in SHORT]
    if args.only:
        chosen = [s for s in SCENES if s.name in args.only.split(",")]
    runs = 1 if args.short else args.runs
    tmp = Path(tempfile.mkdtemp(prefix="estimates-"))
    results: list[dict[str, Any]] = []
    try:
        blends = {s.name: build(s, tmp) for s in chosen}
        with RedisServer(tmp / "redis", unix_socket=False) as server:
            env = {**os.environ, "FARM_REDIS_URL": server.url,
                   "FARM_STORAGE_DIR": str(tmp / "storage"), "FARM_WORK_DIR": str(tmp / "work"),
                   "FARM_LOG_LEVEL": "WARNING"}  # fmt: skip
            settings = Settings.from_env(env)
            log = (tmp / "worker.log").open("wb")
            worker = subprocess.Popen([sys.executable, "-m", "farm", "worker", "--name", "bench"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
            try:
                wait_worker(server.url)
                for run in range(runs):
                    for scene in chosen:
                        out = tmp / f"{scene.name}-{run}"
                        out.mkdir()
                        row = run_scene(settings, scene, blends[scene.name], out)
                        results.append(row)
                        print(line(row), flush=True)
            finally:
                worker.terminate()
                worker.wait(60)
                log.close()
    finally:
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rendered = [r for r in results if r["state"] == "done" and r["error"] is not None]
    errors = [abs(r["error"]) for r in rendered]
    costs = [r["probe_s"] / r["actual_s"] for r in rendered]
    within = [r["probe_s"] <= max(0.05 * r["actual_s"], 10.0) for r in rendered]
    if not rendered:
        print("no job rendered")
        return 1
    cpu_errors = [abs(r["cpu_error"]) for r in rendered if r["cpu_error"] is not None]
    summary = {
        "scenes": len({r["scene"] for r in rendered}),
        "jobs_rendered": len(rendered),
        "jobs_not_rendered": len(results) - len(rendered),
        "abs_error_median_pct": round(statistics.median(errors) * 100, 1),
        "abs_error_p90_pct": round(percentile(errors, 0.9) * 100, 1),
        "abs_error_max_pct": round(max(errors) * 100, 1),
        "signed_error_median_pct": round(statistics.median(r["error"] for r in rendered) * 100, 1),
        "cpu_time_abs_error_median_pct": round(statistics.median(cpu_errors) * 100, 1),
        "cpu_time_abs_error_p90_pct": round(percentile(cpu_errors, 0.9) * 100, 1),
        "load_average_median": round(statistics.median(r["load"] for r in rendered), 2),
        "cpus": os.cpu_count(),
        "probe_s_median": round(statistics.median(r["probe_s"] for r in rendered), 3),
        "probe_s_max": round(max(r["probe_s"] for r in rendered), 3),
        "estimate_wall_s_median": round(
            statistics.median(r["estimate_wall_s"] for r in rendered), 3
        ),
        "probe_over_render_median_pct": round(statistics.median(costs) * 100, 1),
        "estimating_cost_within_target": f"{sum(within)}/{len(within)}",
        "render_s_median": round(statistics.median(r["actual_s"] for r in rendered), 3),
    }
    print(
        f"|error| median {summary['abs_error_median_pct']} % (target <= 15), p90 "
        f"{summary['abs_error_p90_pct']} % (target <= 35), max {summary['abs_error_max_pct']} %"
    )
    print(
        f"in CPU time: median {summary['cpu_time_abs_error_median_pct']} %, p90 "
        f"{summary['cpu_time_abs_error_p90_pct']} % (load average "
        f"{summary['load_average_median']} on {summary['cpus']} CPUs)"
    )
    print(
        f"probe median {summary['probe_s_median']} s, max {summary['probe_s_max']} s, "
        f"{summary['probe_over_render_median_pct']} % of the render (median); within "
        f"max(5 %, 10 s): {summary['estimating_cost_within_target']}"
    )
    print(json.dumps({"bench": "estimates", **summary, "rows": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
