"""The front door's cost: the same requests to a cell's web directly and through `farm frontdoor`.

Starts a private redis-server (two databases for two cells, a third for the control Redis),
each cell's `farm web` and `farm frontdoor` as processes of their own, makes project B in cell
c2 with one upload and one job, then, in alternating blocks (direct, door, direct, ...):

- GET /api/jobs/<id> of B's job (routed by the id's prefix);
- GET /api/jobs?project=B (routed by the project's pin);
- PUT of a --upload-mib .blend to /api/uploads?project=B (streamed through the door).

Every answer is checked (the job's id, the list holding it, the stored upload's size) before
its time counts. Prints each kind's median latency (or throughput) direct and through the door,
their ratio per block pair (median [min..max]) and the added milliseconds; then one JSON line.

    .venv/bin/python bench/frontdoor.py [--requests 200] [--blocks 5] [--upload-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.upload import blend_pieces  # noqa: E402
from farm import jobstore, keys  # noqa: E402
from farm.accounts import Accounts  # noqa: E402
from farm.models import InspectionReport  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402

MIB = 1 << 20


def report() -> dict[str, Any]:
    """A plain Cycles scene's inspection, cached so that a job submits without a worker."""
    return InspectionReport(
        path="/uploads/b.blend", version="5.0.1", scene="Scene", engine="CYCLES",
        frame_start=1, frame_end=1, frame_step=1, fps=24.0, width=64, height=32, samples=16,
        adaptive_sampling=False, denoising=False, cameras=["Camera"], camera="Camera",
        missing_files=[], libraries=[], autoexec_fail=False, autoexec_fail_message="",
        wants_scripts=False, scripts=[],
    ).to_dict()  # fmt: skip


def start(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm", *args], env={**os.environ, **env},
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())["url"]


async def timed_gets(client: aiohttp.ClientSession, url: str, n: int, check: Any) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with client.get(url) as resp:
            data = await resp.json()
        out.append((time.perf_counter() - t0) * 1000)
        assert resp.status == 200 and check(data), data
    return out


async def timed_upload(client: aiohttp.ClientSession, url: str, pieces: list[bytes]) -> float:
    async def body() -> Any:
        for p in pieces:
            yield p

    t0 = time.perf_counter()
    async with client.put(url, data=body()) as resp:
        data = await resp.json()
    seconds = time.perf_counter() - t0
    assert resp.status == 201, data
    assert data["size"] == sum(len(p) for p in pieces), data
    return seconds


def spread(values: list[float], digits: int = 2) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"[{min(values):.{digits}f}..{max(values):.{digits}f}]"
    )


async def measure(
    direct: str, door: str, token: str, job_id: str, args: argparse.Namespace
) -> dict[str, dict[str, list[float]]]:
    headers = {"Authorization": f"Bearer {token}"}
    kinds: dict[str, dict[str, list[float]]] = {
        k: {"direct": [], "door": []} for k in ("job", "list", "upload")
    }
    size = args.upload_mib * MIB
    async with aiohttp.ClientSession(headers=headers) as client:
        for block in range(args.blocks):
            order = ("direct", "door") if block % 2 == 0 else ("door", "direct")
            for side in order:
                base = direct if side == "direct" else door
                job = await timed_gets(
                    client, f"{base}/api/jobs/{job_id}", args.requests,
                    lambda d: d["job_id"] == job_id,
                )  # fmt: skip
                listed = await timed_gets(
                    client, f"{base}/api/jobs?project=B", args.requests,
                    lambda d: [j["job_id"] for j in d["jobs"]] == [job_id],
                )  # fmt: skip
                kinds["job"][side].append(statistics.median(job))
                kinds["list"][side].append(statistics.median(listed))
                if size:
                    pieces = blend_pieces(size, block * 2 + (side == "door"))
                    seconds = await timed_upload(
                        client, f"{base}/api/uploads/big.blend?project=B", pieces
                    )
                    kinds["upload"][side].append(size / seconds / 1e6)
            print(
                f"block {block + 1}: job {kinds['job']['direct'][-1]:.2f} / "
                f"{kinds['job']['door'][-1]:.2f} ms, list {kinds['list']['direct'][-1]:.2f} / "
                f"{kinds['list']['door'][-1]:.2f} ms (direct / door, medians)",
                flush=True,
            )
    return kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200, help="of each kind per block")
    parser.add_argument("--blocks", type=int, default=5, help="per side, alternating")
    parser.add_argument("--upload-mib", type=int, default=64, help="0: no upload")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tessera-bench-frontdoor-"))
    procs: list[subprocess.Popen[str]] = []
    with RedisServer(root / "redis", unix_socket=False) as server:
        base = server.url.rsplit("/", 1)[0]
        urls = {"c1": f"{base}/0", "c2": f"{base}/1", "control": f"{base}/2"}
        control = jobstore.connect(urls["control"])
        try:
            Accounts(control, cell="c2").set_role("bench", "B", "member")
            token = Accounts(control).create_token("bench").token
            webs = {}
            for cell in ("c1", "c2"):
                proc, url = start(["web"], {
                    "FARM_REDIS_URL": urls[cell], "FARM_CONTROL_REDIS_URL": urls["control"],
                    "FARM_CELL": cell, "FARM_STORAGE_DIR": str(root / cell / "storage"),
                    "FARM_WORK_DIR": str(root / cell / "work"), "FARM_WEB_PORT": "0",
                    "FARM_UPLOAD_MAX_BYTES": str((args.upload_mib + 1) * MIB),
                    "FARM_UNPACK_MAX_BYTES": str((args.upload_mib + 1) * MIB),
                    "FARM_LOG_LEVEL": "WARNING",
                })  # fmt: skip
                procs.append(proc)
                webs[cell] = url
            proc, door = start(["frontdoor"], {
                "FARM_CELLS": ",".join(f"{c}={u}" for c, u in webs.items()),
                "FARM_CONTROL_REDIS_URL": urls["control"], "FARM_WEB_PORT": "0",
                "FARM_LOG_LEVEL": "WARNING",
            })  # fmt: skip
            procs.append(proc)
            job_id = asyncio.run(_one_job(door, token, urls["c2"]))
            kinds = asyncio.run(measure(webs["c2"], door, token, job_id, args))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)
            control.close()
    figures: dict[str, Any] = {"requests_per_block": args.requests, "blocks": args.blocks}
    for kind, unit, lower_is_better in (("job", "ms", True), ("list", "ms", True),
                                        ("upload", "mb_s", False)):  # fmt: skip
        direct, door_ = kinds[kind]["direct"], kinds[kind]["door"]
        if not direct:
            continue
        ratios = [d / b for d, b in zip(door_, direct, strict=True)]
        name = {"job": "GET /api/jobs/<id>", "list": "GET /api/jobs?project=",
                "upload": f"PUT {args.upload_mib} MiB upload"}[kind]  # fmt: skip
        shown = "ms, median of medians" if lower_is_better else "MB/s"
        print(f"{name}: direct {spread(direct)}, door {spread(door_)} {shown}; "
              f"door / direct {spread(ratios)}")  # fmt: skip
        figures[f"{kind}_direct_{unit}"] = round(statistics.median(direct), 3)
        figures[f"{kind}_door_{unit}"] = round(statistics.median(door_), 3)
        figures[f"{kind}_door_over_direct"] = round(statistics.median(ratios), 3)
        figures[f"{kind}_door_over_direct_min"] = round(min(ratios), 3)
        figures[f"{kind}_door_over_direct_max"] = round(max(ratios), 3)
        if lower_is_better:
            added = [d - b for d, b in zip(door_, direct, strict=True)]
            figures[f"{kind}_added_ms"] = round(statistics.median(added), 3)
    print(json.dumps(figures))
    import shutil

    shutil.rmtree(root, ignore_errors=True)


async def _one_job(door: str, token: str, cell_redis: str) -> str:
    """B's one job, made through the door: an upload, its cached inspection, the submission."""
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as client:
        blend = b"".join(blend_pieces(64 << 10, 99))
        async with client.put(f"{door}/api/uploads/b.blend?project=B", data=blend) as resp:
            assert resp.status == 201, await resp.text()
            sha = (await resp.json())["upload_id"]
        conn = jobstore.connect(cell_redis)
        try:
            conn.set(keys.inspection(sha), json.dumps(report()))
        finally:
            conn.close()
        body = {"project": "B", "upload_id": sha, "frames": "1"}
        async with client.post(f"{door}/api/jobs", json=body) as resp:
            assert resp.status == 201, await resp.text()
            job_id: str = (await resp.json())["job_id"]
    assert job_id.startswith("c2-"), job_id
    return job_id


if __name__ == "__main__":
    main()
