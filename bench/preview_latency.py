"""Live preview's two figures, each against a baseline measured in the same run.

(1) Latency: from a pass landing (the worker's publish, ``TilePass.ts``) to its pixels on the
job page's canvas in headless Chromium (JPEG over SSE: Redis stream, web, EventSource, JPEG
decode, drawImage). Baseline: a plain job event (``JobStore.warn``) from Redis to the same page
over the job's event stream (the transport alone, no image). Passes are published one at a
time, each a tile JPEG the size a 2x2 tile of --resolution makes, each waited for before the
next; only passes the page drew count. Then the same over WebRTC (a second page, in its own
window, watching the job's video: web/livewebrtc.py composes the frame, aiortc encodes it):
from a pass landing to the first video frame the page presents (requestVideoFrameCallback's
presentationTime) whose pixels in that tile show the pass (its passes alternate red and blue
tints, noisy like the others).

(2) Cost, in one Blender child: the first tile of the grid rendered plain, then through the
worker's live-preview path (workers.progressive: passes, merges, tone-mapped JPEGs, publishing
to Redis, with the default FARM_LIVE_PREVIEW_BUDGET), alternating, a warm-up pair first; the
ratio pair by pair. Back to back in one process, this is the figure least moved by other load.

(3) Cost, whole jobs: the same scene rendered by one worker as a plain job and a live-preview job,
alternating (a warm-up plain job first, not counted): job wall time from accept to done, and
the tiles' task time summed (started to ended on the worker, i.e. passes, merges, tone-mapping
and publishing included). Only jobs that ended done count; a live job counts only if every
tile published its last pass. Also the ratio pair by pair (the two jobs of a pair run back to
back, in turns plain first and live first), since load on a shared machine drifts.

Prints medians and spreads, then one JSON line whose names carry units.

    python bench/preview_latency.py [--passes 40] [--runs 3] [--samples 256]
        [--resolution 320x180] [--tiles 2x2] [--skip-cost] [--skip-jobs]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402
from playwright.sync_api import Page, sync_playwright  # noqa: E402

from farm import jobstore, livepreview, queue, submission  # noqa: E402
from farm.accept import accept  # noqa: E402
from farm.models import BlendSource, JobSpec, TileTask  # noqa: E402
from farm.passschedule import fit_cost, pass_schedule  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402
from farm.settings import Settings  # noqa: E402
from farm.taskrecords import TaskRecords  # noqa: E402
from tests.encoder.chromium import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from tests.farmprocs import WorkerProcess, submit, wait_for  # noqa: E402
from tests.web.conftest import scene_report, wait_for_worker  # noqa: E402
from tests.web.test_addon_client import LiveWeb, member_token  # noqa: E402
from workers import progressive, stillmodes  # noqa: E402
from workers.child import BlenderChild  # noqa: E402

PROJECT = "bench"
TIMEOUT_MS = 30_000


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {"median": statistics.median(values), "min": min(values), "p90": p90,
            "max": max(values)}  # fmt: skip


def shown(label: str, values: list[float], unit: str, digits: int = 1) -> str:
    s = spread(values)
    d = digits
    return (f"{label}: median {s['median']:.{d}f} {unit} (min {s['min']:.{d}f}, "
            f"p90 {s['p90']:.{d}f}, max {s['max']:.{d}f}; n={len(values)})")  # fmt: skip


def tile_jpeg(width: int, height: int, seed: int, tint: float = 0.0) -> bytes:
    """A render-like tile: a gradient with noise (noise makes a JPEG as big as an early pass);
    ``tint`` > 0 adds that much red and takes as much blue (< 0: the other way)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(40, 200, width, dtype=np.float32)[None, :, None]
    pixels = ramp + rng.normal(0, 25, (height, width, 3))
    pixels += np.array([tint, 0, -tint], np.float32)
    pixels = np.clip(pixels, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=85)
    return out.getvalue()


def latency(settings: Settings, tmp: Path, passes: int, width: int, height: int) -> dict[str, Any]:
    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    rq = queue.connect(settings.redis_url)
    source = BlendSource("upload", "uploads/x/upload.blend", "cd" * 32, "bench.blend")
    req = submission.RenderRequest(output=str(tmp / "o"), frames="1", tiles="2x2",
                                   project=PROJECT, live_preview=True)  # fmt: skip
    report = scene_report(width, height)
    job_id = accept(
        settings, store, queue.RenderQueue(rq, "cpu"), req, source, report=report
    ).job_id
    live = LiveWeb(settings)
    token = member_token(settings.redis_url, "bencher", PROJECT)
    tw, th = width // 2, height // 2
    jpegs = [livepreview.encode_jpeg(tile_jpeg(tw, th, i)) for i in range(8)]
    live_ms: list[float] = []
    base_ms: list[float] = []
    video_ms: list[float] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1000, "height": 800}).new_page()
            page.goto(live.url + "/login")
            page.fill("#token", token)
            page.click("#signin")
            page.wait_for_url(live.url + "/")
            state = page.context.storage_state()
            page.goto(f"{live.url}/jobs/{job_id}?live=sse")
            page.wait_for_selector("#live-link.on", timeout=TIMEOUT_MS)
            _baseline_listener(page, job_id)
            schedule = pass_schedule(256)
            for i in range(passes):
                tile, number = i % 4, i // 4 % len(schedule) + 1
                sent = livepreview.publish(store.conn, job_id, livepreview.TilePass(
                    frame=1, tile=tile, attempt=1, x=(tile % 2) * tw, y=(1 - tile // 2) * th,
                    w=tw, h=th, frame_w=width, frame_h=height, index=number,
                    passes=len(schedule), samples=4 ** (number - 1), total_samples=256,
                    jpeg=jpegs[i % len(jpegs)]), settings.live_preview_ttl_s)  # fmt: skip
                page.wait_for_function(f"() => window.__livePasses.length > {i}",
                                       timeout=TIMEOUT_MS)  # fmt: skip
                store.warn(job_id, f"bench event {i} ({sent})")
                page.wait_for_function(f"() => window.__base.length > {i}", timeout=TIMEOUT_MS)
            drawn = page.evaluate("window.__livePasses")
            base = page.evaluate("window.__base")
            live_ms = [p["shown_ms"] - p["ts"] * 1000 for p in drawn]
            base_ms = [b["shown_ms"] - b["ts"] * 1000 for b in base]
            video = browser.new_context(viewport={"width": 1000, "height": 800},
                                        storage_state=state).new_page()  # fmt: skip
            video.goto(f"{live.url}/jobs/{job_id}")
            video.wait_for_selector("#live-view[data-path=webrtc]", timeout=TIMEOUT_MS)
            video.evaluate(WATCH_VIDEO, [tw // 4, th + th // 4, tw // 2, th // 2])
            tints = [livepreview.encode_jpeg(tile_jpeg(tw, th, i, tint=(-1) ** i * 60))
                     for i in range(2)]  # fmt: skip
            for i in range(passes):
                red = i % 2 == 0
                sent_ts = time.time()
                livepreview.publish(store.conn, job_id, livepreview.TilePass(
                    frame=1, tile=0, attempt=1, x=0, y=th, w=tw, h=th, frame_w=width,
                    frame_h=height, index=1, passes=len(schedule), samples=1,
                    total_samples=256, jpeg=tints[i % 2], ts=sent_ts),
                    settings.live_preview_ttl_s)  # fmt: skip
                shown_at = video.wait_for_function(
                    f"() => window.__video.find((f) => f.t >= {sent_ts * 1000} && "
                    f"(f.r - f.b) {'> 40' if red else '< -40'}) || null",
                    timeout=TIMEOUT_MS,
                ).json_value()
                video_ms.append(shown_at["t"] - sent_ts * 1000)
            browser.close()
    finally:
        live.close()
        store.conn.close()
        rq.close()
    return {"live_ms": live_ms, "base_ms": base_ms, "video_ms": video_ms, "tile": f"{tw}x{th}",
            "jpeg_bytes": statistics.median(len(j) * 3 // 4 for j in jpegs)}  # fmt: skip


#: in the page: each frame the live <video> presents, when (epoch ms: presentationTime) and
#: the mean red and blue of a region (x, y, w, h in video pixels)
WATCH_VIDEO = """([x, y, w, h]) => {
  const video = document.querySelector('#live-video');
  const canvas = document.createElement('canvas');
  const ctx = canvas.getContext('2d', { willReadFrequently: true });
  window.__video = [];
  const seen = (now, meta) => {
    canvas.width = video.videoWidth;
    canvas.height = video.videoHeight;
    ctx.drawImage(video, 0, 0);
    const px = ctx.getImageData(x, y, w, h).data;
    let r = 0, b = 0;
    for (let i = 0; i < px.length; i += 4) { r += px[i]; b += px[i + 2]; }
    const n = px.length / 4;
    window.__video.push({ t: performance.timeOrigin + meta.presentationTime, r: r / n, b: b / n });
    video.requestVideoFrameCallback(seen);
  };
  video.requestVideoFrameCallback(seen);
}"""


def _baseline_listener(page: Page, job_id: str) -> None:
    """A second EventSource in the same page, on the job's own event stream."""
    page.evaluate(
        """(jobId) => {
          window.__base = [];
          const es = new EventSource(`/api/jobs/${jobId}/events`, { withCredentials: true });
          es.onmessage = (ev) => {
            const d = JSON.parse(ev.data);
            if (d.type === "warning" && d.message.startsWith("bench event")) {
              const at = performance.timeOrigin + performance.now();
              window.__base.push({ ts: d.ts, shown_ms: at });
            }
          };
        }""",
        job_id,
    )


def cost(
    redis_url: str, tmp: Path, scene: Path, runs: int, samples: int, resolution: str, tiles: str
) -> dict[str, list[float]]:
    worker = WorkerProcess(redis_url, tmp)
    out: dict[str, list[float]] = {"plain_s": [], "live_s": [], "plain_task_s": [],
                                   "live_task_s": [], "pair_ratio": []}  # fmt: skip
    try:
        wait_for_worker(redis_url)
        # plain-live, then live-plain, ...: a load drifting one way over the run (other work on
        # a shared machine starting or ending) favours neither kind
        kinds = [False] + [
            live for i in range(runs) for live in ((False, True), (True, False))[i % 2]
        ]
        pair: dict[bool, float] = {}
        for n, live in enumerate(kinds):
            store, job_id = submit(worker.settings, scene, tmp / f"job{n}", tiles=tiles,
                                   samples=samples, resolution=resolution, project=PROJECT,
                                   frames="1", live_preview=live)  # fmt: skip
            t0 = time.monotonic()
            wait_for(store, job_id, lambda e: e.type == "job_state" and e.state in
                     ("done", "failed", "canceled"), timeout_s=1800)  # fmt: skip
            wall = time.monotonic() - t0
            status = store.status(job_id)
            rows = TaskRecords(store.conn).rows(job_id)
            task_s = sum((r.last.ended_s or 0) - r.last.started_s for r in rows if r.last)
            finished = status.state == "done"
            current: list[livepreview.TilePass] = []
            if live:
                _, current = livepreview.snapshot(store.conn, job_id)
                finished = finished and len(current) == len(rows) and all(p.done for p in current)
            store.conn.close()
            if n == 0 or not finished:
                why = "warm-up" if n == 0 else f"NOT COUNTED: {status.state}, {len(rows)} tiles"
                if live:
                    why += f", last passes published: {sum(p.done for p in current)}"
                print(f"  job {n} ({'live' if live else 'plain'}): {wall:.2f} s {why}")
                continue
            kind = "live" if live else "plain"
            out[f"{kind}_s"].append(wall)
            out[f"{kind}_task_s"].append(task_s)
            attempts = sum(len(r.attempts) for r in rows)
            extra = f", passes a tile {[p.index for p in current]}" if live else ""
            print(f"  job {n} ({kind}): wall {wall:.2f} s, tile tasks {task_s:.2f} s, "
                  f"{attempts} tile attempts{extra}")  # fmt: skip
            pair[live] = task_s
            if len(pair) == 2:  # the pair's two jobs ran back to back
                out["pair_ratio"].append(pair[True] / pair[False])
                pair = {}
    finally:
        worker.stop()
    return out


def child_cost(
    redis_url: str, tmp: Path, scene: Path, runs: int, samples: int, resolution: str, tiles: str
) -> dict[str, list[float]]:
    """One tile (the first of the grid) in one Blender child, back to back: a plain render
    against the worker's live-preview path (workers.progressive: passes, merges, tone-mapped
    JPEGs, publishing), alternating; the child's start and scene load are paid once before."""
    width, height = (int(v) for v in resolution.lower().split("x"))
    spec = JobSpec(source=BlendSource("path", str(scene), "", scene.name), frames=(1,),
                   tiles=tiles, width=width, height=height, output=str(tmp / "o"),
                   samples=samples, live_preview=True)  # fmt: skip
    task = TileTask("bench-child", 1, 0, 1)
    conn = jobstore.connect(redis_url)
    out: dict[str, list[float]] = {"plain_s": [], "live_s": [], "pair_ratio": [],
                                   "passes": [], "fixed_s": [], "modelled": []}  # fmt: skip
    options = {**stillmodes.task_options(spec, 0), "adaptive": False}
    try:
        with BlenderChild(python=sys.executable, work_dir=tmp / "child", name="bench") as child:
            for n in range(runs + 1):
                t0 = time.monotonic()
                child.render(scene, frame=1, width=width, height=height,
                             rect=stillmodes.task_rect(spec, 0), samples=samples,
                             out_path=tmp / "plain.exr", timeout_s=1800,
                             options=options)  # fmt: skip
                plain = time.monotonic() - t0
                t0 = time.monotonic()
                result = progressive.render_in_passes(child, conn, scene, spec, task,
                                                      tmp / "live.exr", 600, lambda: None,
                                                      Settings.live_preview_budget)  # fmt: skip
                live = time.monotonic() - t0
                if n == 0:  # warm-up: the first renders sync the scene
                    continue
                out["plain_s"].append(plain)
                out["live_s"].append(live)
                out["pair_ratio"].append(live / plain)
                out["passes"].append(float(result["passes"]))
                # the passes' own fit: what each render call costs besides its samples, and so
                # what the passes cost over one call (less moved by load than the wall times)
                fixed, per_sample = fit_cost([(n, t) for n, t in result["pass_samples_s"]])
                modelled = 1 + (result["passes"] - 1) * fixed / (fixed + per_sample * samples)
                out["fixed_s"].append(fixed)
                out["modelled"].append(modelled)
                print(f"  pair {n}: plain {plain:.3f} s, live {live:.3f} s "
                      f"({result['passes']} passes), {live / plain:.3f}x; fitted call cost "
                      f"{fixed * 1000:.0f} ms, modelled {modelled:.3f}x")  # fmt: skip
    finally:
        conn.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=40, help="passes timed to the browser")
    ap.add_argument("--runs", type=int, default=3, help="plain/live job pairs")
    ap.add_argument("--scene", type=Path, default=REPO / "farm" / "examples" / "example.blend")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--resolution", default="320x180")
    ap.add_argument("--tiles", default="2x2")
    ap.add_argument("--skip-cost", action="store_true", help="the latency only")
    ap.add_argument("--skip-jobs", action="store_true", help="no whole jobs, only the child")
    args = ap.parse_args()
    width, height = (int(v) for v in args.resolution.lower().split("x"))
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tessera-preview-bench-") as scratch:
        tmp = Path(scratch)
        with RedisServer(tmp / "redis", unix_socket=False) as server:
            settings = Settings().with_(redis_url=server.url, storage_dir=tmp / "storage",
                                        work_dir=tmp / "work")  # fmt: skip
            lat = latency(settings, tmp, args.passes, width, height)
            print(f"latency, {len(lat['live_ms'])} passes of a {lat['tile']} tile "
                  f"(JPEG ~{lat['jpeg_bytes']:.0f} B):")  # fmt: skip
            print("  " + shown("pass landed -> pixels on the canvas", lat["live_ms"], "ms"))
            print("  " + shown("baseline: job event -> page", lat["base_ms"], "ms"))
            print("  " + shown("WebRTC: pass landed -> pixels in the video", lat["video_ms"],
                               "ms"))  # fmt: skip
            live_p50 = statistics.median(lat["live_ms"])
            base_p50 = statistics.median(lat["base_ms"])
            figures.update({
                "passes_timed": len(lat["live_ms"]),
                "pass_to_pixels_p50_ms": round(live_p50, 1),
                "pass_to_pixels_p90_ms": round(spread(lat["live_ms"])["p90"], 1),
                "pass_to_pixels_max_ms": round(max(lat["live_ms"]), 1),
                "baseline_event_p50_ms": round(base_p50, 1),
                "pass_vs_event_p50_ratio": round(live_p50 / base_p50, 2) if base_p50 > 0 else None,
                "webrtc_passes_timed": len(lat["video_ms"]),
                "webrtc_pass_to_video_p50_ms": round(statistics.median(lat["video_ms"]), 1),
                "webrtc_pass_to_video_p90_ms": round(spread(lat["video_ms"])["p90"], 1),
                "webrtc_pass_to_video_max_ms": round(max(lat["video_ms"]), 1),
                "webrtc_vs_sse_p50_ratio": round(statistics.median(lat["video_ms"]) / live_p50,
                                                 2) if live_p50 > 0 else None,
            })  # fmt: skip
            if not args.skip_cost:
                print(f"cost in one Blender child, tile 0 of {args.tiles} at {args.resolution}, "
                      f"{args.samples} samples:")  # fmt: skip
                cc = child_cost(server.url, tmp, args.scene, max(args.runs, 5), args.samples,
                                args.resolution, args.tiles)  # fmt: skip
                print("  " + shown("plain render", cc["plain_s"], "s"))
                print("  " + shown("live-preview passes", cc["live_s"], "s"))
                print("  " + shown("live / plain, pair by pair", cc["pair_ratio"], "x", 3))
                print("  " + shown("fitted fixed cost of a pass's call", [f * 1000 for f in
                                   cc["fixed_s"]], "ms"))  # fmt: skip
                print("  " + shown("modelled live / plain (passes x call cost)", cc["modelled"],
                                   "x", 3))  # fmt: skip
                figures.update({
                    "child_pairs": len(cc["pair_ratio"]),
                    "child_plain_tile_median_s": round(statistics.median(cc["plain_s"]), 3),
                    "child_live_tile_median_s": round(statistics.median(cc["live_s"]), 3),
                    "child_live_vs_plain_ratio_median": round(
                        statistics.median(cc["pair_ratio"]), 3),
                    "child_live_vs_plain_ratio_max": round(max(cc["pair_ratio"]), 3),
                    "child_passes_median": statistics.median(cc["passes"]),
                    "child_call_fixed_median_ms": round(statistics.median(cc["fixed_s"]) * 1000,
                                                        1),
                    "child_modelled_ratio_median": round(statistics.median(cc["modelled"]), 3),
                })  # fmt: skip
            if not args.skip_cost and not args.skip_jobs:
                passes = len(pass_schedule(args.samples))
                print(f"cost, {args.scene.name} at {args.resolution}, {args.samples} samples, "
                      f"{args.tiles} tiles, {passes} passes a tile:")  # fmt: skip
                c = cost(server.url, tmp, args.scene, args.runs, args.samples, args.resolution,
                         args.tiles)  # fmt: skip
                for kind in ("plain", "live"):
                    if c[f"{kind}_s"]:
                        print("  " + shown(f"{kind} job wall", c[f"{kind}_s"], "s"))
                        print("  " + shown(f"{kind} tile tasks summed", c[f"{kind}_task_s"], "s"))
                if c["plain_s"] and c["live_s"]:
                    wall = statistics.median(c["live_s"]) / statistics.median(c["plain_s"])
                    tasks = statistics.median(c["live_task_s"]) / statistics.median(
                        c["plain_task_s"]
                    )
                    print(f"  live / plain: wall {wall:.3f}x, tile tasks {tasks:.3f}x (medians)")
                    print("  " + shown("live / plain tile tasks, pair by pair", c["pair_ratio"],
                                       "x", 3))  # fmt: skip
                    figures.update({
                        "jobs_counted": len(c["plain_s"]) + len(c["live_s"]),
                        "plain_job_median_s": round(statistics.median(c["plain_s"]), 3),
                        "live_job_median_s": round(statistics.median(c["live_s"]), 3),
                        "live_vs_plain_wall_ratio": round(wall, 3),
                        "plain_tasks_median_s": round(statistics.median(c["plain_task_s"]), 3),
                        "live_tasks_median_s": round(statistics.median(c["live_task_s"]), 3),
                        "live_vs_plain_tasks_ratio": round(tasks, 3),
                        "live_vs_plain_pair_ratio_median": round(
                            statistics.median(c["pair_ratio"]), 3),
                    })  # fmt: skip
    print(json.dumps(figures, separators=(",", ":")))


if __name__ == "__main__":
    main()
