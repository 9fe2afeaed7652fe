"""The faults the chaos suite injects into a running farm, one function per kind; each returns
what it did and to whom, and waits out its own window (a pause, a partition, a full disk)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.chaos.farm import ChaosFarm, Worker, alive, cpu_ticks, start_time
from tests.faultproxy import Request

KINDS = (
    "worker_sigkill",
    "blender_sigkill",
    "sigstop",
    "sigterm",
    "redis_sigkill",
    "disk_full",
    "s3_5xx",
    "s3_timeout",
    "partition",
)


#: what a worker may take past its SIGTERM grace to stop: killing its child, releasing its
#: lease, leaving rq (a loaded machine); a tile's 30 s wait for a device must not count
STOP_SLACK_S = 15.0


@dataclass
class Timing:
    """How long windows last, from the farm's lease (a pause or partition outlives it)."""

    lease_ttl_s: float
    s3_timeout_s: float
    stop_grace_s: float

    @property
    def window_s(self) -> float:
        return self.lease_ttl_s * 2.5


@dataclass
class Injected:
    kind: str
    at: float  # epoch s
    target: str
    mid_tile: bool
    detail: str
    problem: str = ""  # a promise broken while injecting (a child left alive, a bad exit)


def _worker_fault(
    farm: ChaosFarm, pick: float, kind: str, act: Callable[[Worker], tuple[str, str]]
) -> Injected:
    w = farm.busy_worker(pick)
    if w is None:
        return Injected(kind, time.time(), "-", False, "no live worker")
    mid_tile = bool(w.blender_pids()) and _busy(w)
    at = time.time()
    detail, problem = act(w)
    return Injected(kind, at, w.name, mid_tile, detail, problem)


def _busy(w: Worker) -> bool:
    before = sum(cpu_ticks(p) for p in w.blender_pids())
    time.sleep(0.1)
    return sum(cpu_ticks(p) for p in w.blender_pids()) > before


def _outliving(kids: list[tuple[int, int | None]], timeout_s: float) -> list[int]:
    """Of these processes (pid, start time), those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [p for p, started in kids if started is not None and alive(p, started)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def worker_sigkill(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    def act(w: Worker) -> tuple[str, str]:
        kids = [(p, start_time(p)) for p in w.blender_pids()]
        os.kill(w.proc.pid, signal.SIGKILL)
        farm.stop_worker(w, signal.SIGKILL)
        left = _outliving(kids, 10)
        replacement = farm.start_worker(w.slot)
        problem = f"Blender child {left} outlived its SIGKILLed worker by 10 s" if left else ""
        return f"replaced by {replacement.name}", problem

    return _worker_fault(farm, pick, "worker_sigkill", act)


def blender_sigkill(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    def act(w: Worker) -> tuple[str, str]:
        kids = w.blender_pids()
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        return f"killed {len(kids)} child(ren)", ""

    return _worker_fault(farm, pick, "blender_sigkill", act)


def sigstop(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    def act(w: Worker) -> tuple[str, str]:
        group = [w.proc.pid, *w.blender_pids()]
        for pid in group:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(t.window_s)
        for pid in group:
            os.kill(pid, signal.SIGCONT)
        return f"paused {t.window_s:.1f} s", ""

    return _worker_fault(farm, pick, "sigstop", act)


def sigterm(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    def act(w: Worker) -> tuple[str, str]:
        t0 = time.monotonic()
        problems = farm.stop_worker(w, signal.SIGTERM, timeout_s=60)
        took_s = time.monotonic() - t0
        if took_s > t.stop_grace_s + STOP_SLACK_S:
            problems.append(f"{w.name} took {took_s:.1f} s to stop (grace {t.stop_grace_s} s)")
        replacement = farm.start_worker(w.slot)
        return (f"exit {w.proc.returncode} in {took_s:.1f} s, replaced by {replacement.name}",
                "; ".join(problems))  # fmt: skip

    return _worker_fault(farm, pick, "sigterm", act)


def partition(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    def act(w: Worker) -> tuple[str, str]:
        ns = farm.namespace(w)
        assert ns is not None
        farm.net.partition(ns, up=False)
        time.sleep(t.window_s)
        farm.net.partition(ns, up=True)
        return f"link down {t.window_s:.1f} s", ""

    return _worker_fault(farm, pick, "partition", act)


def redis_sigkill(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    at = time.time()
    assert farm.redis.pid is not None
    os.kill(farm.redis.pid, signal.SIGKILL)
    time.sleep(0.5 + pick)
    t0 = time.monotonic()
    farm.redis.restart(timeout_s=60)
    farm._track(farm.redis.pid, "redis-server")
    took = time.monotonic() - t0
    return Injected("redis_sigkill", at, "redis", False, f"down {0.5 + pick:.1f} s, AOF "
                    f"replayed in {took:.2f} s")  # fmt: skip


def disk_full(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    at = time.time()
    filler = farm.disk / ".filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    time.sleep(t.window_s)
    filler.unlink()
    return Injected("disk_full", at, "storage", False, f"ENOSPC {t.window_s:.1f} s")


def _is_put(r: Request) -> bool:
    return r.method == "PUT"


def s3_5xx(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    # more 503s than a request's attempts: the farm's storage retry has to wait them out
    count = 3 + int(pick * 3)
    farm.proxy.inject("503", count=count, match=_is_put)
    return Injected("s3_5xx", time.time(), "s3", False, f"next {count} PUTs answer 503")


def s3_timeout(farm: ChaosFarm, pick: float, t: Timing) -> Injected:
    count = 2 + int(pick * 2)
    farm.proxy.inject("delay", count=count, match=_is_put, delay_s=t.s3_timeout_s + 1)
    return Injected("s3_timeout", time.time(), "s3", False,
                    f"next {count} PUTs past the {t.s3_timeout_s} s timeout")  # fmt: skip


INJECT: dict[str, Callable[[ChaosFarm, float, Timing], Injected]] = {
    "worker_sigkill": worker_sigkill,
    "blender_sigkill": blender_sigkill,
    "sigstop": sigstop,
    "sigterm": sigterm,
    "redis_sigkill": redis_sigkill,
    "disk_full": disk_full,
    "s3_5xx": s3_5xx,
    "s3_timeout": s3_timeout,
    "partition": partition,
}
