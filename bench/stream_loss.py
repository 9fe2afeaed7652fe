"""Streams on a lossy or narrow path: our stream service next to plain aiortc.

Each arm's viewer (an aiortc client that decodes every frame, tests/encoder/streamclient.py)
reaches its service through a UDP relay of the bench's own (tests/encoder/udprelay.py) that
drops media datagrams at random (--loss, e.g. 1 % and 5 %) or holds them to a bottleneck
(--rate-kbps, default 3000, with a --queue-ms drop-tail queue); NACKs, PLIs and receiver reports
go back unharmed. Per session: --warmup seconds clean, --window seconds impaired, --recovery
seconds clean again. The source is the test pattern (the service stamps each frame with its
capture time), so latency = decoded-frame arrival minus capture.

Figures per arm and condition (median over --runs with [min..max], arms alternating):
- longest freeze: the longest time without a decoded frame inside the impaired window, ms;
- p95 latency inside the window, and its ratio to the same arm's p95 on the clean path;
- after recovery: the p95 latency of the last half of the recovery window over the clean p95
  ("current" when <= 2x), and how many frames came then.

Targets: longest freeze <= 200 ms, p95 <= 2x the clean p95, every frame after recovery current.
A verdict needs the viewer to have received frames in every window (else: "no verdict").

    python bench/stream_loss.py [--size 1280x720] [--fps 30] [--loss 0.01,0.05]
        [--rate-kbps 3000] [--queue-ms 100] [--warmup 4] [--window 8] [--recovery 4]
        [--runs 3] [--arms ours,plain]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.streambench import add_arm_options, arm_services, run_bench, spread  # noqa: E402
from tests.encoder.streamclient import ReceivedFrame, StreamClient, read_stamp  # noqa: E402
from tests.encoder.tokens import operator_headers  # noqa: E402
from tests.encoder.udprelay import (  # noqa: E402
    Path as NetPath,
)
from tests.encoder.udprelay import (  # noqa: E402
    UdpRelay,
    rewrite_candidates,
    service_candidate,
)

FREEZE_TARGET_MS = 200.0
P95_RATIO_TARGET = 2.0


@dataclass
class Options:
    width: int
    height: int
    fps: int
    warmup_s: float
    window_s: float
    recovery_s: float


@dataclass
class Result:
    """One session: the frames (arrival s, latency ms) and the windows' bounds."""

    records: list[tuple[float, float]] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    end_s: float = 0.0
    dropped: int = 0
    queue_drops: int = 0
    #: what the service says of the session (None where it does not: plain aiortc): keyframes
    #: sent, and the viewer's catch-ups (frames dropped to a fresh keyframe)
    keyframes: int | None = None
    catch_ups: int | None = None

    def _between(self, start_s: float, end_s: float) -> list[tuple[float, float]]:
        return [r for r in self.records if start_s <= r[0] <= end_s]

    @property
    def freeze_ms(self) -> float:
        """The longest time without a frame inside the impaired window."""
        start, end = self.window
        times = [start] + [t for t, _ in self._between(start, end)] + [end]
        return 1000 * max(b - a for a, b in itertools.pairwise(times))

    @property
    def p95_ms(self) -> float:
        lat = [lat for _, lat in self._between(*self.window)]
        return float(np.percentile(lat, 95)) if lat else float("inf")

    @property
    def after(self) -> list[float]:
        """Latencies of the last half of the recovery window."""
        start = self.end_s - (self.end_s - self.window[1]) / 2
        return [lat for _, lat in self._between(start, self.end_s)]

    @property
    def after_p95_ms(self) -> float:
        return float(np.percentile(self.after, 95)) if self.after else float("inf")


async def measure(client: StreamClient, opts: Options, impaired: NetPath) -> Result:
    result = Result()
    created = await client.create_session("testpattern", opts.width, opts.height, opts.fps)
    sid = str(created["session_id"])
    relays: list[UdpRelay] = []

    async def through_relay(sdp: str) -> str:
        relay = UdpRelay(service_candidate(sdp), NetPath())
        await relay.start()
        relays.append(relay)
        return rewrite_candidates(sdp, relay.address)

    def on_frame(received: ReceivedFrame) -> None:
        stamp = read_stamp(received.frame)
        result.records.append((received.arrival_s, (received.arrival_s - stamp.capture_s) * 1000))

    try:
        viewer = await client.join(sid, on_frame=on_frame, rewrite_answer=through_relay)
        try:
            await viewer.next_frame(30.0)
            await asyncio.sleep(opts.warmup_s)
            relay = relays[0]
            start = time.time()
            relay.path = impaired
            await asyncio.sleep(opts.window_s)
            relay.path = NetPath()
            result.window = (start, time.time())
            await asyncio.sleep(opts.recovery_s)
            result.end_s = time.time()
            result.dropped, result.queue_drops = relay.dropped, relay.queue_drops
            info = await client.session(sid)
            result.keyframes = info.get("stats", {}).get("keyframes")
            result.catch_ups = sum(v.get("catch_ups", 0) for v in info.get("viewers", []))
        finally:
            await client.leave(sid, viewer)
    finally:
        for relay in relays:
            relay.close()
        await client.delete_session(sid)
    return result


def conditions(args: argparse.Namespace) -> dict[str, NetPath]:
    found = {"clean": NetPath()}
    for loss in (float(v) for v in args.loss.split(",") if v):
        found[f"loss{loss * 100:g}pct"] = NetPath(loss=loss)
    if args.rate_kbps:
        found[f"rate{args.rate_kbps}kbps"] = NetPath(
            rate_bps=args.rate_kbps * 1000, queue_ms=args.queue_ms
        )
    return found


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    width, height = (int(v) for v in args.size.lower().split("x"))
    opts = Options(width, height, args.fps, args.warmup, args.window, args.recovery)
    figures: dict[str, Any] = {
        "bench": "stream_loss",
        "size": args.size,
        "fps": args.fps,
        "runs": args.runs,
        "cores": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    arms = args.arms.split(",")
    paths = conditions(args)
    with arm_services(arms, args.plain_source, 4, "stream-loss-") as services:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            clients = {arm: StreamClient(s.url, http) for arm, s in services.items()}
            results: dict[str, dict[str, list[Result]]] = {
                name: {arm: [] for arm in clients} for name in paths
            }
            for index in range(args.runs):
                order = list(clients) if index % 2 == 0 else list(reversed(clients))
                for name, path in paths.items():
                    for arm in order:
                        impaired = NetPath(path.loss, path.rate_bps, path.queue_ms, seed=index + 1)
                        res = await measure(clients[arm], opts, impaired)
                        results[name][arm].append(res)
                        print(
                            f"  run {index + 1} {name:14} {arm:5}: freeze {res.freeze_ms:7.1f} ms"
                            f"  p95 {res.p95_ms:7.1f} ms  after p95 {res.after_p95_ms:7.1f} ms"
                            f" ({len(res.after)} frames)  relay dropped {res.dropped}"
                            f" queue-dropped {res.queue_drops}"
                            + (
                                f"  keyframes {res.keyframes} catch-ups {res.catch_ups}"
                                if res.keyframes is not None
                                else ""
                            ),
                            flush=True,
                        )
    summarize(results, figures)
    figures["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    return figures


def summarize(results: dict[str, dict[str, list[Result]]], figures: dict[str, Any]) -> None:
    clean = results["clean"]
    print("\nper condition: median [min..max] over runs")
    for name, by_arm in results.items():
        for arm, runs in by_arm.items():
            freeze = [r.freeze_ms for r in runs]
            p95 = [r.p95_ms for r in runs]
            ratio = [r.p95_ms / c.p95_ms for r, c in zip(runs, clean[arm], strict=True)]
            after = [r.after_p95_ms / c.p95_ms for r, c in zip(runs, clean[arm], strict=True)]
            key = f"{name}_{arm}"
            figures[f"{key}_freeze_ms"] = round(statistics.median(freeze), 1)
            figures[f"{key}_p95_ms"] = round(statistics.median(p95), 1)
            figures[f"{key}_p95_to_clean"] = round(statistics.median(ratio), 3)
            figures[f"{key}_after_p95_to_clean"] = round(statistics.median(after), 3)
            print(
                f"  {name:14} {arm:5} freeze {spread(freeze)} ms  p95 {spread(p95)} ms"
                f"  p95/clean {spread(ratio)}  after/clean {spread(after)}"
            )
            if name == "clean":
                continue
            received = all(r.after and r.p95_ms != float("inf") for r in runs)
            met = (
                max(freeze) <= FREEZE_TARGET_MS
                and max(ratio) <= P95_RATIO_TARGET
                and max(after) <= P95_RATIO_TARGET
            )
            verdict = ("met" if met else "NOT met") if received else "no verdict"
            figures[f"{key}_verdict"] = verdict
            print(f"    targets (worst run: freeze <= {FREEZE_TARGET_MS:g} ms, p95 and after "
                  f"<= {P95_RATIO_TARGET:g}x clean): {verdict}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--loss", default="0.01,0.05", help="loss shares, comma-separated")
    parser.add_argument("--rate-kbps", type=int, default=3000, help="bottleneck (0: none)")
    parser.add_argument("--queue-ms", type=float, default=100.0)
    parser.add_argument("--warmup", type=float, default=4.0, help="clean seconds first")
    parser.add_argument("--window", type=float, default=8.0, help="impaired seconds")
    parser.add_argument("--recovery", type=float, default=4.0, help="clean seconds after")
    parser.add_argument("--runs", type=int, default=3)
    add_arm_options(parser)
    run_bench(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
