"""The chaos suite's farm: a private Redis with AOF, moto's S3 behind the fault proxy, a tmpfs
for the farm's storage and output folders, and real `farm worker` processes, each in its own
network namespace. Every process it starts is tracked by pid (with its start time), and so is
every process the workers start, so that none can be left behind unseen."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from redis import Redis

from farm.redisserver import RedisServer, _free_port
from tests.chaos.network import Network
from tests.farmprocs import _is_blender_child, descendants
from tests.faultproxy import FaultProxy
from tests.s3server import CREDENTIALS, MotoServer

#: marks the environment of every process of one run (found again by /proc/PID/environ)
MARKER = "TESSERA_CHAOS_RUN"


class BridgedRedis(RedisServer):
    """The test's redis-server with AOF, also listening on the bridge the namespaces reach."""

    def __init__(self, work_dir: Path, also_bind: str) -> None:
        super().__init__(work_dir, unix_socket=False, port=_free_port(), appendonly=True)
        self.also_bind = also_bind

    def _command(self) -> list[str]:
        command = super()._command()
        at = command.index("--bind") + 1
        if self.also_bind != "127.0.0.1":  # loopback only where no namespaces could be made
            command[at : at + 1] = ["127.0.0.1", self.also_bind]
        # no password on a private bridge: protected mode would refuse the namespaces
        command[command.index("--protected-mode") + 1] = "no"
        return command


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), to tell it from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, started: int) -> bool:
    """The process is there and not a zombie (a zombie is gone but for its exit status)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and int(fields[19]) == started


def cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


@dataclass
class Worker:
    name: str
    slot: int  # which namespace
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: object

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready(self) -> bool:
        return "event=worker_ready" in self.log_text()

    def blender_pids(self) -> list[int]:
        out = []
        for pid in descendants(self.proc.pid):
            try:
                if _is_blender_child(Path(f"/proc/{pid}/cmdline").read_bytes()):
                    out.append(pid)
            except OSError:
                continue
        return out


@dataclass
class ChaosFarm:
    root: Path
    run_id: str
    workers_per_run: int
    env: dict[str, str]
    net: Network = field(init=False)
    redis: BridgedRedis = field(init=False)
    moto: MotoServer = field(init=False)
    proxy: FaultProxy = field(init=False)
    disk: Path = field(init=False)
    workers: list[Worker] = field(default_factory=list)
    ended: list[Worker] = field(default_factory=list)
    #: every pid this run started or saw a worker start: pid -> (start time, what)
    seen: dict[int, tuple[int, str]] = field(default_factory=dict)
    _slots: list[str | None] = field(default_factory=list)
    mounted: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _monitor: threading.Thread | None = None
    _started: Counter[int] = field(default_factory=Counter)
    #: what a namespace could reach when the farm started (empty without namespaces)
    reach: dict[str, bool] = field(default_factory=dict)

    # --- life cycle ---------------------------------------------------------------------------

    def start(self, disk_mib: int) -> None:
        self.disk = self.root / "disk"
        self.disk.mkdir(parents=True)
        if os.geteuid() == 0:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_mib}m", "tmpfs",
                            str(self.disk)], check=True)  # fmt: skip
            self.mounted = True
        self.net = Network(self.run_id).create()
        self.redis = BridgedRedis(self.root / "redis", self.net.host_ip)
        self.redis.start()
        self._track(self.redis.pid, "redis-server")
        self.moto = MotoServer().start()
        assert self.moto.proc is not None
        self._track(self.moto.proc.pid, "moto")
        self.proxy = FaultProxy(self.moto.endpoint, listen=self.net.host_ip).__enter__()
        assert self.redis.port is not None
        self.net.allow_only(self.redis.port, int(self.proxy.url.rsplit(":", 1)[1]))
        self._slots = [self.net.add(i) for i in range(self.workers_per_run)]
        self.reach = self._probe_reach()
        for slot in range(self.workers_per_run):
            self.start_worker(slot)
        self._monitor = threading.Thread(target=self._watch, name="pid-monitor", daemon=True)
        self._monitor.start()

    def stop(self) -> list[str]:
        """End every process started (by pid), unmount, remove the network; what went wrong."""
        problems = []
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(5)
        for w in list(self.workers):
            problems += self.stop_worker(w, signal.SIGTERM, timeout_s=60)
        with contextlib.suppress(Exception):
            self.proxy.__exit__(None, None, None)
        with contextlib.suppress(Exception):
            self.moto.stop()
        with contextlib.suppress(Exception):
            self.redis.stop()
        problems += self.net.remove()
        if self.mounted:
            done = subprocess.run(["umount", "-l", str(self.disk)], capture_output=True, text=True)
            if done.returncode:
                problems.append(f"umount {self.disk}: {done.stderr.strip()}")
            self.mounted = False
        return problems

    def _probe_reach(self) -> dict[str, bool]:
        """From the first namespace: Redis, S3, and a port the host listens on for anyone (that
        one must not answer)."""
        ns = self._slots[0] if self._slots else None
        if ns is None:
            return {}
        host = self.net.host_ip
        with socket.socket() as decoy:
            decoy.bind(("0.0.0.0", 0))
            decoy.listen()
            return {
                "redis": self.net.reachable(ns, host, self.redis.port or 0),
                "s3": self.net.reachable(ns, host, int(self.proxy.url.rsplit(":", 1)[1])),
                "other_port": self.net.reachable(ns, host, decoy.getsockname()[1]),
            }

    # --- workers ------------------------------------------------------------------------------

    def worker_env(self, name: str) -> dict[str, str]:
        host = self.net.host_ip
        return {
            **os.environ,
            **CREDENTIALS,
            "FARM_REDIS_URL": f"redis://{host}:{self.redis.port}/0",
            "FARM_STORAGE_DIR": str(self.disk / "storage"),
            "FARM_WORK_DIR": str(self.root / f"work-{name}"),
            "FARM_S3_ENDPOINT_URL": self.proxy.url,
            "FARM_S3_ADDRESSING_STYLE": "path",
            MARKER: self.run_id,
            **self.env,
        }

    def start_worker(self, slot: int) -> Worker:
        started = self._started[slot]
        self._started[slot] += 1
        name = f"w{slot}r{started}" if started else f"w{slot}"
        log_path = self.root / f"{name}.log"
        log = log_path.open("wb")
        proc = subprocess.Popen(
            [*self.net.prefix(self._slots[slot]), sys.executable, "-m", "farm", "worker",
             "--name", name],
            env=self.worker_env(name), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self._track(proc.pid, f"worker {name}")
        worker = Worker(name, slot, proc, log_path, log)
        self.workers.append(worker)
        return worker

    def stop_worker(self, w: Worker, sig: int, timeout_s: float = 30) -> list[str]:
        """Send ``sig`` to the worker, wait for its exit; the problems seen."""
        problems = []
        if w.proc.poll() is None:
            os.kill(w.proc.pid, sig)
            try:
                w.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                problems.append(f"worker {w.name} ignored signal {sig} for {timeout_s} s")
                os.kill(w.proc.pid, signal.SIGKILL)
                w.proc.wait(10)
        # before it is ready a worker has taken no work and handles no signal: SIGTERM's
        # default action ends it (what matters then is that its Blender child goes too)
        if (
            sig == signal.SIGTERM
            and w.proc.returncode not in (0, None)
            and (w.proc.returncode != -signal.SIGTERM or w.ready())
        ):
            problems.append(f"worker {w.name} exited {w.proc.returncode} on SIGTERM")
        with contextlib.suppress(Exception):
            w.log.close()  # type: ignore[attr-defined]
        if w in self.workers:
            self.workers.remove(w)
            self.ended.append(w)
        return problems

    def busy_worker(self, pick: float) -> Worker | None:
        """A live worker whose Blender child is using the CPU (rendering), else any live one;
        ``pick`` in [0, 1) chooses among them (the run's seeded draw)."""
        everyone = [w for w in self.workers if w.proc.poll() is None]
        # a worker still starting has no tile to lose: prefer those at work
        live = [w for w in everyone if w.ready()] or everyone
        if not live:
            return None
        before = {w.name: sum(cpu_ticks(p) for p in w.blender_pids()) for w in live}
        time.sleep(0.3)
        busy = [w for w in live if sum(cpu_ticks(p) for p in w.blender_pids()) > before[w.name]]
        among = busy or live
        return among[int(pick * len(among))]

    def namespace(self, w: Worker) -> str | None:
        return self._slots[w.slot]

    # --- process tracking ---------------------------------------------------------------------

    def _track(self, pid: int | None, what: str) -> None:
        if pid is None:
            return
        started = start_time(pid)
        if started is not None:
            self.seen.setdefault(pid, (started, what))

    def _watch(self) -> None:
        while not self._stop.wait(0.3):
            for w in list(self.workers):
                for pid in descendants(w.proc.pid):
                    self._track(pid, f"child of worker {w.name}")

    def left_running(self) -> list[str]:
        """Processes of this run still alive: tracked pids, and any process whose environment
        carries the run's marker (the test process itself aside)."""
        found = [f"{what} (pid {pid})" for pid, (started, what) in self.seen.items()
                 if alive(pid, started)]  # fmt: skip
        needle = f"{MARKER}={self.run_id}".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0") and alive(
                int(entry.name), start_time(int(entry.name)) or -1
            ):
                found.append(f"marked process (pid {entry.name})")
        return sorted(set(found))

    def rconn(self) -> Redis:
        return Redis(port=self.redis.port or 0, decode_responses=True)
