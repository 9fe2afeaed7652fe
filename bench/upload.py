"""Upload throughput through the web API against a plain durable write of the same bytes.

Starts a private redis-server and `farm web` (a separate process, so its memory is its own),
then per run: writes SIZE bytes with write + fsync (the baseline), and PUTs the same bytes (a
valid uncompressed .blend, different per run so nothing is deduplicated) to /api/uploads on
loopback. The server hashes, fsyncs and stores them. Prints throughputs, their ratio (target
>= 0.6) and the server's peak memory growth during an upload (target < 64 MiB): each run's own
peak, the server's high-water mark being reset before each upload. Every run checks the stored
file is complete before its figures count. Then one JSON line.

    .venv/bin/python bench/upload.py                 # 1 GiB, 3 runs
    .venv/bin/python bench/upload.py --size-mib 64 --runs 1   # a quick smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from farm import jobstore  # noqa: E402
from farm.accounts import Accounts  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402

CHUNK = 16 << 20
MIB = 1 << 20


def blend_pieces(size: int, run: int) -> list[bytes]:
    """A .blend of ``size`` bytes: the header, one DATA block filling it, ENDB; ``run`` makes
    the bytes differ between runs."""
    header = b"BLENDER-v279"
    end = b"ENDB" + struct.pack("<i", 0) + bytes(16)
    data_len = size - len(header) - 24 - len(end)
    block = b"DATA" + struct.pack("<i", data_len) + struct.pack("<Q", run + 1) + bytes(8)
    pattern = os.urandom(CHUNK)
    pieces = [header + block]
    left = data_len
    while left > 0:
        n = min(CHUNK, left)
        pieces.append(pattern[:n])
        left -= n
    pieces.append(end)
    return pieces


def durable_write(path: Path, pieces: list[bytes]) -> float:
    """Seconds to write the pieces to ``path`` and fsync it."""
    t0 = time.perf_counter()
    with path.open("wb", buffering=0) as fh:
        for piece in pieces:
            fh.write(piece)
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def reset_peak_rss(pid: int) -> None:
    """Start ``pid``'s peak resident set (VmHWM) afresh at its current size (Linux: 5 to
    clear_refs), so the next reading is the peak since now, not since the process started."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    peak, now = rss_kib(pid, "VmHWM"), rss_kib(pid, "VmRSS")
    if peak > now + 1024:  # it grows between the two reads, but not by a MiB
        raise RuntimeError(f"the peak RSS of {pid} did not reset: {peak} KiB, now {now} KiB")


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


async def body(pieces: list[bytes]) -> AsyncIterator[memoryview]:
    for piece in pieces:
        for i in range(0, len(piece), MIB):
            yield memoryview(piece)[i : i + MIB]


async def upload(url: str, token: str, pieces: list[bytes]) -> tuple[float, str]:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        async with session.put(
            f"{url}/api/uploads/bench.blend?project=bench",
            data=body(pieces),
            headers={"Authorization": f"Bearer {token}"},
        ) as resp:
            text = await resp.text()
            if resp.status != 201:
                raise RuntimeError(f"upload failed: {resp.status} {text}")
        return time.perf_counter() - t0, json.loads(text)["upload_id"]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}..{max(values):.1f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    size = args.size_mib * MIB
    root = Path(tempfile.mkdtemp(prefix="tessera-bench-upload-", dir=args.dir))
    base_mbs: list[float] = []
    api_mbs: list[float] = []
    growth_mib: list[float] = []
    with RedisServer(root / "redis") as redis_server:
        conn = jobstore.connect(redis_server.url)
        accounts = Accounts(conn)
        accounts.set_role("bench", "bench", "member")
        token = accounts.create_token("bench").token
        env = {
            **os.environ,
            "FARM_REDIS_URL": redis_server.url,
            "FARM_STORAGE_DIR": str(root / "storage"),
            "FARM_WORK_DIR": str(root / "work"),
            "FARM_WEB_PORT": "0",
            "FARM_UPLOAD_MAX_BYTES": str(size + MIB),
            "FARM_UNPACK_MAX_BYTES": str(size + MIB),
            "FARM_LOG_LEVEL": "WARNING",
        }
        server = subprocess.Popen(
            [sys.executable, "-m", "farm", "web"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert server.stdout is not None
            url = json.loads(server.stdout.readline())["url"]
            for run in range(args.runs):
                pieces = blend_pieces(size, run)

                def baseline(pieces: list[bytes] = pieces) -> None:
                    seconds = durable_write(root / "baseline.bin", pieces)
                    (root / "baseline.bin").unlink()
                    base_mbs.append(size / seconds / 1e6)

                def api(pieces: list[bytes] = pieces) -> None:
                    reset_peak_rss(server.pid)
                    before = rss_kib(server.pid, "VmRSS")
                    seconds, sha = asyncio.run(upload(url, token, pieces))
                    peak = rss_kib(server.pid, "VmHWM")
                    api_mbs.append(size / seconds / 1e6)
                    growth_mib.append(max(0, peak - before) / 1024)
                    stored = root / "storage" / "uploads" / sha / "upload.blend"
                    assert stored.stat().st_size == size
                    stored.unlink()

                # who goes first alternates: the writeback the first leaves behind (1 GiB of
                # freshly freed pages) must not always land on the same side
                for step in (baseline, api) if run % 2 == 0 else (api, baseline):
                    step()
                print(
                    f"run {run + 1}: write+fsync {base_mbs[-1]:.1f} MB/s, API upload "
                    f"{api_mbs[-1]:.1f} MB/s, server peak growth {growth_mib[-1]:.1f} MiB",
                    flush=True,
                )
        finally:
            server.terminate()
            server.wait(30)
            conn.close()
    ratios = [a / b for a, b in zip(api_mbs, base_mbs, strict=True)]
    print(f"write + fsync (baseline): {spread(base_mbs)} MB/s")
    print(f"API upload (PUT, sha256, fsync, stored): {spread(api_mbs)} MB/s")
    print(f"ratio API / baseline: {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}..{max(ratios):.2f}] (target >= 0.6)")  # fmt: skip
    print(f"server peak memory growth, the largest run's: {max(growth_mib):.1f} MiB "
          f"{[round(g, 1) for g in growth_mib]} (target < 64 MiB)")  # fmt: skip
    # every run's upload was stored whole (checked in the run), so the figures stand for it
    ratio_verdict = "met" if statistics.median(ratios) >= 0.6 else "NOT met"
    memory_verdict = "met" if max(growth_mib) < 64 else "NOT met"
    print(f"targets: ratio {ratio_verdict}; memory {memory_verdict}")
    print(
        json.dumps(
            {
                "size_mib": args.size_mib,
                "runs": args.runs,
                "baseline_write_fsync_mb_s": round(statistics.median(base_mbs), 1),
                "api_upload_mb_s": round(statistics.median(api_mbs), 1),
                "ratio": round(statistics.median(ratios), 3),
                "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3),
                "server_peak_growth_mib": round(max(growth_mib), 1),
                "server_peak_growth_mib_per_run": [round(g, 1) for g in growth_mib],
                "ratio_verdict": ratio_verdict,
                "memory_verdict": memory_verdict,
            }
        )
    )
    import shutil

    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
