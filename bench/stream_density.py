"""Stream density: how many 1280x720@30 sessions this machine sustains, and what a spectator costs.

Both arms serve the test pattern, or with --app game the built-in game in an Xvfb of each
session's own, from a child process on this machine (see bench/stream_latency.py): ``ours`` is
`farm stream` (one capture and one encode per session, whatever the number of viewers; the game
sandboxed, captured on X damage); ``plain`` is plain aiortc with its built-in encoder, one
encoder per viewer (tests/encoder/plainservice.py; the game captured by MediaPlayer's x11grab).
Viewers are aiortc clients in this process that receive every packet and count complete frames
(RTP marker bit) without decoding them, so the cores go to the services being measured.

- ``sessions``: sessions are added one at a time, each with one viewer; after --settle seconds
  every session's delivered frame rate is measured over --window seconds. The figure is the most
  sessions for which every session delivered >= --min-fps (the ramp stops at the first failure
  or at --max-sessions): the count is gated on every viewer receiving, as a viewer without a
  frame or below --min-fps ends the ramp.
- ``spectators``: one session with its player; the service's CPU time (process and children,
  from /proc) over --window seconds, then again with --spectators more viewers. Cost per
  spectator = the difference / spectators, in % of one core. Arms alternate within each run;
  figures are medians over --runs with [min..max]. Every viewer's delivered frame rate is
  counted over the same windows: a spectator that receives nothing costs nothing, so a verdict
  needs every viewer of the arms it compares, in every run, at >= 90 % of --fps.

Targets: ours <= 3 % of a core per spectator and <= 0.1x plain aiortc's per-viewer cost.

    python bench/stream_density.py [--size 1280x720] [--fps 30] [--max-sessions 16]
        [--spectators 4] [--window 5] [--settle 2] [--runs 3] [--parts sessions,spectators]
        [--plain-source live|pull] [--arms ours,plain] [--app testpattern|game]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.streambench import add_arm_options, arm_services, run_bench, spread  # noqa: E402
from tests.encoder.serviceprocess import ServiceProcess  # noqa: E402
from tests.encoder.streamclient import StreamClient, Viewer  # noqa: E402
from tests.encoder.tokens import operator_headers  # noqa: E402

TARGET_CORE_PCT = 3.0
TARGET_RATIO = 0.1
#: a spectator-cost verdict needs every viewer at this share of the session's rate or more
MIN_DELIVERED_SHARE = 0.9


@dataclass
class Options:
    width: int
    height: int
    fps: int
    window_s: float
    settle_s: float
    app: str = "testpattern"


@dataclass
class Watched:
    sid: str
    viewers: list[Viewer]


async def open_session(client: StreamClient, opts: Options) -> Watched:
    created = await client.create_session(opts.app, opts.width, opts.height, opts.fps)
    sid = str(created["session_id"])
    return Watched(sid, [await client.join(sid, decode=False)])


async def close_session(client: StreamClient, watched: Watched) -> None:
    for viewer in watched.viewers:
        await client.leave(watched.sid, viewer)
    await client.delete_session(watched.sid)


async def first_frames(viewers: list[Viewer], timeout_s: float = 30.0) -> None:
    """Wait until every viewer has a frame (connected, keyframe in)."""
    deadline = time.monotonic() + timeout_s
    while any(v.frames_received == 0 for v in viewers):
        if time.monotonic() > deadline:
            raise TimeoutError("a viewer got no frame")
        await asyncio.sleep(0.05)


async def delivered_fps(viewers: list[Viewer], window_s: float) -> list[float]:
    before = [v.frames_received for v in viewers]
    started = time.monotonic()
    await asyncio.sleep(window_s)
    elapsed = time.monotonic() - started
    return [(v.frames_received - b) / elapsed for v, b in zip(viewers, before, strict=True)]


async def ramp(client: StreamClient, opts: Options, max_sessions: int, min_fps: float) -> int:
    """The most sessions that all delivered >= min_fps."""
    sessions: list[Watched] = []
    sustained = 0
    try:
        for count in range(1, max_sessions + 1):
            try:
                sessions.append(await open_session(client, opts))
                await first_frames([w.viewers[0] for w in sessions])
            except Exception as exc:  # refused (no capacity) or no picture: the ramp ends
                print(f"    {count} sessions: stopped ({exc})", flush=True)
                break
            await asyncio.sleep(opts.settle_s)
            rates = await delivered_fps([w.viewers[0] for w in sessions], opts.window_s)
            ok = min(rates) >= min_fps
            print(
                f"    {count:2} sessions: fps min {min(rates):5.1f} median "
                f"{statistics.median(rates):5.1f}  {'ok' if ok else 'BELOW ' + str(min_fps)}",
                flush=True,
            )
            if not ok:
                break
            sustained = count
    finally:
        for watched in sessions:
            await close_session(client, watched)
    return sustained


@dataclass
class SpectatorRun:
    session_core_pct: float  # the service with the player alone
    per_viewer_core_pct: float  # added per spectator
    min_viewer_fps: float  # the slowest viewer (player or spectator) in either window


async def spectator_cost(
    client: StreamClient, service: ServiceProcess, opts: Options, spectators: int
) -> SpectatorRun:
    """The service's CPU with the player alone and with the spectators added, and what the
    viewers received while it was measured."""
    watched = await open_session(client, opts)
    try:
        await first_frames(watched.viewers)
        await asyncio.sleep(opts.settle_s)
        base, alone = await cpu_pct(service, watched.viewers, opts.window_s)
        for _ in range(spectators):
            watched.viewers.append(await client.join(watched.sid, role="spectator", decode=False))
        await first_frames(watched.viewers)
        await asyncio.sleep(opts.settle_s)
        loaded, rates = await cpu_pct(service, watched.viewers, opts.window_s)
    finally:
        await close_session(client, watched)
    return SpectatorRun(base, (loaded - base) / spectators, min(alone + rates))


async def cpu_pct(
    service: ServiceProcess, viewers: list[Viewer], window_s: float
) -> tuple[float, list[float]]:
    """The service's CPU in % of one core over ``window_s``, and each viewer's delivered frame
    rate over the same window."""
    frames = [v.frames_received for v in viewers]
    before, started = service.cpu_s(), time.monotonic()
    await asyncio.sleep(window_s)
    elapsed = time.monotonic() - started
    rates = [(v.frames_received - f) / elapsed for v, f in zip(viewers, frames, strict=True)]
    return 100 * (service.cpu_s() - before) / elapsed, rates


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    width, height = (int(v) for v in args.size.lower().split("x"))
    opts = Options(width, height, args.fps, args.window, args.settle, args.app)
    parts = args.parts.split(",")
    arms = args.arms.split(",")
    figures: dict[str, Any] = {
        "bench": "stream_density",
        "size": args.size,
        "fps": args.fps,
        "runs": args.runs,
        "spectators": args.spectators,
        "cores": os.cpu_count(),
        "plain_source": args.plain_source,
        "app": args.app,
        "sandbox": os.environ.get("FARM_SANDBOX", "bwrap"),
        # the game plays sound (a pulse server and an Opus encode per session) only in its
        # sandbox: compare the sandbox's cost with FARM_STREAM_AUDIO=0, like for like
        "audio": _game_has_sound(args.app),
    }
    cpu_sessions = args.max_sessions + 1
    with arm_services(arms, args.plain_source, cpu_sessions, "stream-density-") as services:
        async with aiohttp.ClientSession(headers=operator_headers()) as http:
            clients = {arm: StreamClient(s.url, http) for arm, s in services.items()}
            if "sessions" in parts:
                await run_sessions(args, opts, clients, figures)
            if "spectators" in parts:
                await run_spectators(args, opts, clients, services, figures)
    return figures


def _game_has_sound(app: str) -> bool:
    """Whether the sessions carry sound: the sandboxed game's, unless FARM_STREAM_AUDIO=0."""
    sandboxed = os.environ.get("FARM_SANDBOX", "bwrap") != "none"
    return app == "game" and sandboxed and os.environ.get("FARM_STREAM_AUDIO", "1") != "0"


async def run_sessions(
    args: argparse.Namespace,
    opts: Options,
    clients: dict[str, StreamClient],
    figures: dict[str, Any],
) -> None:
    sound = ", with sound" if _game_has_sound(opts.app) else ""
    print(f"\n== sessions: {opts.width}x{opts.height}@{opts.fps}{sound}, every one >= "
          f"{args.min_fps} fps")  # fmt: skip
    counts: dict[str, list[int]] = {arm: [] for arm in clients}
    for index in range(args.runs):
        order = list(clients) if index % 2 == 0 else list(reversed(clients))
        for arm in order:
            print(f"  run {index + 1} {arm}", flush=True)
            counts[arm].append(await ramp(clients[arm], opts, args.max_sessions, args.min_fps))
    for arm, values in counts.items():
        figures[f"{arm}_max_sessions"] = statistics.median(values)
        print(f"  {arm:5} sustained sessions: {statistics.median(values)} {values}")
    if "ours" in counts and "plain" in counts and statistics.median(counts["plain"]) > 0:
        ratio = statistics.median(counts["ours"]) / statistics.median(counts["plain"])
        figures["max_sessions_ratio_ours_to_plain"] = round(ratio, 3)
        print(f"  ours / plain: {ratio:.2f}")


async def run_spectators(
    args: argparse.Namespace,
    opts: Options,
    clients: dict[str, StreamClient],
    services: dict[str, ServiceProcess],
    figures: dict[str, Any],
) -> None:
    print(f"\n== spectators: one {opts.width}x{opts.height}@{opts.fps} session, "
          f"+{args.spectators} viewers (CPU of the service, % of one core)")  # fmt: skip
    base: dict[str, list[float]] = {arm: [] for arm in clients}
    each: dict[str, list[float]] = {arm: [] for arm in clients}
    slowest: dict[str, list[float]] = {arm: [] for arm in clients}
    for index in range(args.runs):
        order = list(clients) if index % 2 == 0 else list(reversed(clients))
        for arm in order:
            run = await spectator_cost(clients[arm], services[arm], opts, args.spectators)
            base[arm].append(run.session_core_pct)
            each[arm].append(run.per_viewer_core_pct)
            slowest[arm].append(run.min_viewer_fps)
            print(f"  run {index + 1} {arm:5}: session {run.session_core_pct:6.1f} %   per added "
                  f"viewer {run.per_viewer_core_pct:6.2f} %   slowest viewer "
                  f"{run.min_viewer_fps:5.1f} fps", flush=True)  # fmt: skip
    for arm in clients:
        figures[f"{arm}_session_core_pct"] = round(statistics.median(base[arm]), 2)
        figures[f"{arm}_per_viewer_core_pct"] = round(statistics.median(each[arm]), 3)
        figures[f"{arm}_viewer_min_fps"] = round(min(slowest[arm]), 2)
        print(f"  {arm:5} session {spread(base[arm])} %   per viewer {spread(each[arm])} %   "
              f"slowest viewer {min(slowest[arm]):.1f} fps")  # fmt: skip
    if "ours" in each and "plain" in each:
        ratios = [o / p for o, p in zip(each["ours"], each["plain"], strict=True) if p > 0]
        if ratios:
            figures["per_viewer_ratio_ours_to_plain"] = round(statistics.median(ratios), 3)
            print(f"  ours / plain per viewer: {spread(ratios)}")
    # each target: its figure, its bound, and the arms whose viewers must all have received
    targets = {
        "ours_per_viewer_core_pct": (TARGET_CORE_PCT, ["ours"]),
        "per_viewer_ratio_ours_to_plain": (TARGET_RATIO, ["ours", "plain"]),
    }
    floor_fps = MIN_DELIVERED_SHARE * opts.fps
    print("\ntargets")
    for name, (bound, arms) in targets.items():
        if name not in figures:
            continue
        short = [
            f"{arm} {min(slowest[arm]):.1f} fps" for arm in arms if min(slowest[arm]) < floor_fps
        ]
        if short:
            verdict = f"no verdict (slowest viewer {', '.join(short)} < {floor_fps:g})"
        else:
            verdict = "met" if figures[name] <= bound else "NOT met"
        figures[f"{name}_verdict"] = verdict.split(" (")[0]
        print(f"  {name} = {figures[name]} (target <= {bound}): {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1280x720")
    parser.add_argument("--fps", type=int, default=30)
    parser.add_argument("--min-fps", type=float, default=29.0)
    parser.add_argument("--max-sessions", type=int, default=16)
    parser.add_argument("--spectators", type=int, default=4)
    parser.add_argument("--window", type=float, default=5.0, help="measuring window, s")
    parser.add_argument("--settle", type=float, default=2.0, help="wait before measuring, s")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--parts", default="sessions,spectators")
    parser.add_argument(
        "--app", default="testpattern",
        help="catalog app of each session (game: a sandboxed app in its Xvfb; FARM_SANDBOX=none "
        "in the environment runs it unsandboxed, the figure before, and without sound: "
        "FARM_STREAM_AUDIO=0 takes the sandboxed game's sound away too, like for like)",
    )  # fmt: skip
    add_arm_options(parser)
    run_bench(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
