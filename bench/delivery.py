"""Delivery throughput to S3: the farm's storage layer against plain boto3, in one run.

A job of --frames frames of --mib MiB each is delivered to a local S3 endpoint (moto's server
mode in its own process on 127.0.0.1) two ways, alternating which goes first:

(a) baseline: plain boto3 ``upload_file`` of the same files, one after another;
(b) the farm: ``farm.delivery.deliver_frame`` per frame, as an assembler does it (commit-once
    PUT with the sha256 recorded and a CRC32, checked against the store's answer, or its ETag
    against our MD5 where it answers no CRC32, as moto does; the record in Redis), then the
    job's manifest with presigned URLs.

The two take turns frame by frame, so both see the same machine.

Prints each run, medians and [min..max] of both throughputs (MiB/s) and of the ratio farm/boto3
(target >= 0.8), then one JSON line with every figure.

    python bench/delivery.py [--frames 100] [--mib 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import boto3  # noqa: E402

from farm import delivery, jobstore  # noqa: E402
from farm.models import BlendSource, JobSpec  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402
from farm.settings import Settings  # noqa: E402
from tests.s3server import CREDENTIALS, MotoServer  # noqa: E402

BUCKET = "bench-delivery"


def make_frames(folder: Path, count: int, mib: float) -> list[Path]:
    paths = []
    for frame in range(1, count + 1):
        path = folder / f"frame_{frame:04d}.exr"
        path.write_bytes(os.urandom(int(mib * (1 << 20))))
        paths.append(path)
    return paths


def run_both(
    endpoint: str, settings: Settings, redis_url: str, frames: list[Path], run: int
) -> dict[str, float]:
    """Seconds each way spent on the whole job. The two ways take turns frame by frame (who
    goes first alternates), so a noisy machine slows both alike."""
    client = boto3.client("s3", endpoint_url=endpoint)
    spec = JobSpec(
        source=BlendSource("path", "/dev/null", "0" * 64, "bench.blend"),
        frames=tuple(range(1, len(frames) + 1)),
        tiles="1x1",
        width=1,
        height=1,
        output=f"s3://{BUCKET}/run{run}-farm",
        formats=("exr",),
    )
    conn = jobstore.connect(redis_url)
    delivery.open_output(spec.output, settings)  # the client is built once per worker
    took = {"boto3": 0.0, "farm": 0.0}
    for frame, path in enumerate(frames, start=1):
        ways = ["boto3", "farm"] if (frame + run) % 2 else ["farm", "boto3"]
        for way in ways:
            t0 = time.perf_counter()
            if way == "boto3":
                client.upload_file(str(path), BUCKET, f"run{run}-boto3/{path.name}")
            else:
                # the last frame also writes the job's manifest (presigned URLs)
                delivery.deliver_frame(conn, settings, spec, f"job{run}", frame, [path])
            took[way] += time.perf_counter() - t0
    conn.close()
    client.close()
    return took


def empty(endpoint: str, prefix: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    for page in pages:
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    client.close()


def spread(values: list[float], digits: int = 1) -> str:
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} [{lo:.{digits}f}..{hi:.{digits}f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=100)
    ap.add_argument("--mib", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    os.environ.update(CREDENTIALS)
    total_mib = args.frames * args.mib
    farm_mibps: list[float] = []
    boto_mibps: list[float] = []
    ratios: list[float] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-delivery-") as tmp,
        MotoServer() as s3,
        RedisServer(Path(tmp) / "redis") as redis_server,
    ):
        boto3.client("s3", endpoint_url=s3.endpoint).create_bucket(Bucket=BUCKET)
        frames = make_frames(Path(tmp), args.frames, args.mib)
        settings = Settings().with_(s3_endpoint_url=s3.endpoint, s3_addressing_style="path")
        for run in range(args.runs):
            took = run_both(s3.endpoint, settings, redis_server.url, frames, run)
            empty(s3.endpoint, f"run{run}-")
            farm_mibps.append(total_mib / took["farm"])
            boto_mibps.append(total_mib / took["boto3"])
            ratios.append(farm_mibps[-1] / boto_mibps[-1])
            print(
                f"run {run + 1}: farm {farm_mibps[-1]:.1f} MiB/s ({took['farm']:.2f} s), "
                f"boto3 upload_file {boto_mibps[-1]:.1f} MiB/s ({took['boto3']:.2f} s), "
                f"ratio {ratios[-1]:.2f}"
            )
    print(f"job: {args.frames} frames x {args.mib:g} MiB = {total_mib:g} MiB, {args.runs} run(s)")
    print(f"farm storage layer  MiB/s: {spread(farm_mibps)}")
    print(f"boto3 upload_file   MiB/s: {spread(boto_mibps)}  (baseline)")
    print(f"ratio farm/boto3         : {spread(ratios, 3)}  (target >= 0.8)")
    figures = {
        "bench": "delivery",
        "frames": args.frames,
        "frame_mib": args.mib,
        "runs": args.runs,
        "farm_mibps_median": round(statistics.median(farm_mibps), 2),
        "farm_mibps_min": round(min(farm_mibps), 2),
        "farm_mibps_max": round(max(farm_mibps), 2),
        "boto3_mibps_median": round(statistics.median(boto_mibps), 2),
        "boto3_mibps_min": round(min(boto_mibps), 2),
        "boto3_mibps_max": round(max(boto_mibps), 2),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
