"""The allocator's time inside Redis, this tree's code against an earlier commit's, paired.

On a shared machine the time a call takes inside redis-server moves by a factor of two with
the load, so two runs taken minutes apart compare the machine, not the code. Here both
versions run against one redis-server (each in its own database) in alternating blocks of
acquire + renew + release cycles, and each block's SLOWLOG median of every call is paired with
the other version's next to it: the ratio new/old (median and range over the rounds) is what
the change did.

Each version runs in its own client process with its own tree first on ``sys.path`` (the
earlier one from ``git archive``), on a pool of 8 devices (bench/allocator.py's) or of
``--devices`` devices over hosts of 8 cycling through the fake NVML's classes (as
bench/scale.py), every other device holding a render and a stream.

    python bench/allocator_paired.py [--against REV] [--devices 8] [--rounds 6] [--block 100]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KINDS = ("render_pinned", "render_placed", "stream_placed")
CALLS = ("acquire", "renew", "release")


# --- one side: a client process of one version ------------------------------------------------


def side_main(url: str, db: int, devices: int) -> None:
    """Register the pool, say how SLOWLOG names this version's calls, then run the cycles
    each line of stdin asks for (``KIND COUNT``) and answer ``done``."""
    import redis

    from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator
    from farm.errors import NeverFits
    from farm.gpu.fake import FAKE_MODELS

    conn = redis.Redis.from_url(url, db=db)
    alloc = SlotAllocator(conn, ttl_s=3600)
    if devices <= 8:
        sys.path.insert(1, str(REPO))
        from bench.allocator import POOL

        for agent, host, budget, offers in POOL:
            alloc.register(agent, host, offers, ttl_s=3600, host_encoder_budget=budget)
        pinned = "gpu-b-l4-0"
    else:
        classes = sorted(FAKE_MODELS)
        for h in range(devices // 8):
            model = FAKE_MODELS[classes[h % len(classes)]]
            offers = [
                DeviceOffer(f"GPU-sim-{h}-{i}", classes[h % len(classes)], model.name,
                            model.memory_total_mib, model.encoder_engines * 8, 1)
                for i in range(8)
            ]  # fmt: skip
            budget = 8 if model.consumer else None
            alloc.register(f"agent-{h}", f"host-{h}", offers, 3600, host_encoder_budget=budget)
            for i in range(0, 8, 2):
                mine = (f"GPU-sim-{h}-{i}",)
                alloc.try_acquire("busy", Request("render", 4096, render_slots=1, device_ids=mine))
                with contextlib.suppress(NeverFits):  # a class without encoders
                    alloc.try_acquire("busy", Request("stream", 1536, 1, device_ids=mine))
        pinned = "GPU-sim-1-1"
    requests = {
        "render_pinned": Request("render", 4096, render_slots=1, device_ids=(pinned,)),
        "render_placed": Request("render", 4096, render_slots=1),
        "stream_placed": Request("stream", 1536, encoder_sessions=1),
    }

    def name(call: Any) -> str:
        # a script is logged by its sha1 (EVALSHA), a library function by its name (FCALL)
        return str(getattr(call, "sha", None) or call.name)

    calls = {"acquire": alloc._acquire, "renew": alloc._renew, "release": alloc._release}
    print(json.dumps({call: name(fn) for call, fn in calls.items()}), flush=True)
    for line in sys.stdin:
        kind, count = line.split()
        for _ in range(int(count)):
            lease = alloc.try_acquire("paired", requests[kind])
            if lease is None:
                raise SystemExit(f"no room for {kind} in the pool")
            alloc.release(alloc.renew(lease))
        print("done", flush=True)


# --- the parent -----------------------------------------------------------------------------


def _export(rev: str, into: Path) -> Path:
    """The farm package of commit ``rev``, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", rev, "farm"],
        check=True,
        capture_output=True,
    ).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _start(
    tree: Path, url: str, db: int, devices: int
) -> tuple[subprocess.Popen[str], dict[str, str]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--side", url, str(db), str(devices)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        side_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="HEAD", help="the earlier commit (git revision)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block", type=int, default=100, help="cycles per block")
    args = ap.parse_args()

    import redis

    sys.path.insert(0, str(REPO))
    from farm.redisserver import RedisServer

    with tempfile.TemporaryDirectory(prefix="bench-paired-") as d:
        old_tree = _export(args.against, Path(d) / "old")
        with RedisServer(Path(d), unix_socket=True) as server:
            probe = redis.Redis.from_url(server.url)
            probe.config_set("slowlog-log-slower-than", 0)
            probe.config_set("slowlog-max-len", 1_000_000)
            sides = {
                "old": _start(old_tree, server.url, 0, args.devices),
                "new": _start(REPO, server.url, 1, args.devices),
            }
            medians: dict[tuple[str, str, str], list[float]] = {}
            for r in range(args.rounds):
                for kind in KINDS:
                    # who goes first alternates, so a drift of the machine hits both alike
                    for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                        proc, names = sides[side]
                        assert proc.stdin is not None and proc.stdout is not None
                        probe.slowlog_reset()
                        proc.stdin.write(f"{kind} {args.block}\n")
                        proc.stdin.flush()
                        if proc.stdout.readline().strip() != "done":
                            raise SystemExit(f"the {side} side stopped")
                        entries = probe.slowlog_get(1_000_000)
                        logged = [e["command"].split() for e in entries]
                        durations = [e["duration"] for e in entries]
                        for call, ident in names.items():
                            mine = [
                                t
                                for words, t in zip(logged, durations, strict=True)
                                if len(words) > 1 and words[1].decode() == ident
                            ]
                            if mine:
                                medians.setdefault((kind, call, side), []).append(
                                    float(statistics.median(mine))
                                )
            for proc, _ in sides.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()
            probe.close()
    print(
        f"{args.devices} devices, {args.rounds} rounds of {args.block} cycles; time inside "
        f"redis-server per call (SLOWLOG), old = {args.against}, new = this tree"
    )
    rows = []
    for kind in KINDS:
        for call in CALLS:
            old, new = medians[(kind, call, "old")], medians[(kind, call, "new")]
            ratios = [b / a for a, b in zip(old, new, strict=True)]
            row = {
                "kind": kind, "call": call, "old_us": statistics.median(old),
                "new_us": statistics.median(new), "ratio": statistics.median(ratios),
                "ratio_min": min(ratios), "ratio_max": max(ratios),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{kind:14} {call:8} old {row['old_us']:6.1f} us  new {row['new_us']:6.1f} us"
                f"  new/old {row['ratio']:.2f} [{row['ratio_min']:.2f} .. {row['ratio_max']:.2f}]"
            )
    print(json.dumps({"bench": "allocator_paired", "against": args.against,
                      "devices": args.devices, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
