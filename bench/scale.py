"""One Redis for a whole farm: what N devices at a steady load cost it, for N = 8 ... 10,000.

A discrete-event simulation drives the farm's real Redis code against one private redis-server:
the allocator's scripts (``farm.alloc.allocator``), the job store (``farm.jobstore``), rq queues
through ``farm.queue`` and ``farm.submission``, and the recovery sweep. Only the devices and the
work are simulated:

- **devices**: N GPUs over N/8 hosts, one class per host, cycling through every class of the
  fake NVML (``farm.gpu.fake.FAKE_MODELS``: memory, NVENC engines, consumer session caps),
  registered once per host; the agents of each device's render worker and stream service keep
  them alive (below).
- **render workers**: one per device, no Blender: each is the farm's rq worker
  (``farm.queue.build_worker``), driven through rq's own steps around a task (the take with
  its beats and rq's registry maintenance every 10 s, the operator's disabled flag read by the
  pick (``--disabled-read apart``: in a round trip of its own before each take, as the worker
  did before), the execution's records before the task, the success's after it); the task's
  own work is the simulation's. A worker starts the tile with the attempt's start record (one
  step of the job store's) and reads the disabled flag, in one round trip
  (``workers.tasks.begin_writes``), leases its device (a pinned request) and shows the tile
  on the workers page in the grant's round trip (``--tile-writes one-by-one``: each of those
  in its own), "renders" for a time drawn from an exponential distribution (mean
  ``--tile-s``, at least 1 s) while renewing the lease and the tile every lease period / 3,
  commits the tile (fenced), then ends it (its end record, the worker idle with the tile
  counted, the lease's release: ``workers.tasks.end_writes``; ``--tile-writes one-by-one``
  sends those writes one by one, as the worker did before); a frame's last tile queues its
  assembly (claim, then finish). Every worker runs the recovery sweep every lease period, and
  beats as a real one does: its device agent's heartbeat (a GPU's, with NVML's memory in use,
  for the registration to work out what no lease explains) with its entry on the workers page,
  in one round trip every ``agent_timeout / 3`` (``--beats apart`` sends them one by one, as
  the worker did before: the agent's read of its device's leases, its heartbeat, its page
  entry).
- **streams**: sessions arrive (Poisson) and last an exponential time (mean ``--stream-s``),
  placed by the allocator (an unpinned request over every class); the stream service of each
  device beats as a real one does: its agent's heartbeat, its registration for the web, its
  entry on the workers page and its sessions' renewals (``renew_many``) in one round trip,
  every ``agent_timeout / 3`` (``--stream-renewals apart``: the renewals in a call of their
  own every lease period / 3, as before; ``--beats apart``: that, and the rest one by one);
  the
  farm starts with the steady-state population (``--streams-per-device``).
- **jobs** are submitted (10 frames of 2x2 tiles) whenever fewer tiles wait than there are
  devices, so workers are never starved; ``--priority-share`` of them have a priority.

Time is simulated: events run in order of a virtual clock (which every script is given, far
ahead of the wall clock so that Redis-side fences compare alike), as fast as one client can make
the calls; wall time is what the calls take. Redis's CPU (``INFO cpu`` deltas over the
measurement window) divided by the simulated seconds is the share of one core the farm needs in
real time. Latencies are client round trips of single sequential calls (no queueing behind
other clients: the server is mostly idle between calls).

Prints one table row per N and, last, one JSON line with every figure,
``cost_ratio_10000_vs_8`` (Redis CPU per operation at the largest N / at the smallest) and
``redis_cpu_at_10000`` (cores at the largest N).

    python bench/scale.py [--devices 8,100,1000,10000] [--measure-s 30] [--warmup-s 10]
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import redis
import redis.connection
import rq.worker.base
from rq.job import Job
from rq.queue import Queue
from rq.worker import WorkerStatus

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.rq_task import _counted, _RqBookkeeping, _RqFetch, _sent  # noqa: E402
from encoder.service import registration_writes  # noqa: E402
from farm import jobstore, keys, queue, workerstate  # noqa: E402
from farm.alloc.agent import Beside, heartbeat, together  # noqa: E402
from farm.alloc.allocator import (  # noqa: E402
    DeviceOffer,
    Lease,
    LeaseBeside,
    Request,
    SlotAllocator,
)
from farm.gpu.fake import FAKE_MODELS  # noqa: E402
from farm.models import BlendSource, JobSpec, TileTask  # noqa: E402
from farm.redisserver import RedisServer  # noqa: E402
from farm.submission import submit  # noqa: E402
from farm.taskrecords import Attempt, TaskRecords  # noqa: E402
from workers.tasks import (  # noqa: E402
    AttemptEnd,
    begin_writes,
    end_writes,
    rendering_shown,
    renew_leases_in,
)

LEASE_TTL_S = 15.0
AGENT_TIMEOUT_S = 15.0
#: memory NVML sees in use on an idle simulated GPU (the driver's), MiB
DRIVER_MIB = 300
#: NVENC sessions per engine on data-centre cards; consumer hosts are capped per system
SESSIONS_PER_ENGINE = 8
CONSUMER_HOST_SESSIONS = 8
RENDER_VRAM_MIB = 4096
STREAM_VRAM_MIB = 1536
FRAMES_PER_JOB = 10
TILES = "2x2"
#: an idle worker's next look at the queue (a real one blocks on it, costing Redis nothing)
IDLE_POLL_S = 1.0
#: the virtual clock starts this far past the wall clock (ms)
CLOCK_AHEAD_MS = 10**12
MEASURED = ("acquire", "release", "renew", "commit", "dequeue")


@dataclass
class Figures:
    """Latencies (ns) per operation and the count of every Redis-bound call."""

    latency_ns: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recording: bool = False

    def timed(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        if self.recording:
            self.latency_ns[name].append(time.perf_counter_ns() - t0)
            self.calls[name] += 1
        return out


def _rq_start(worker: queue._FarmWorker, job: Job) -> Any:
    """SimpleWorker.execute_job and perform_job up to the task's function: its execution."""
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    job.started_at = rq.worker.base.now()  # type: ignore[attr-defined]
    return execution


def _rq_finish(worker: queue._FarmWorker, job: Job, q: Queue, execution: Any) -> None:
    """The rest of perform_job once the task returned, of execute_job, and Worker.work's beat
    after each task."""
    worker._finalize_success(job, q, execution, None)
    worker.set_state(WorkerStatus.IDLE)
    worker.heartbeat()


class Farm:
    """The simulated farm: one virtual clock, an event heap, the real Redis clients."""

    def __init__(self, url: str, devices: int, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.now_ms = int(time.time() * 1000) + CLOCK_AHEAD_MS
        self.events: list[tuple[int, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.fig = Figures()
        self.conn = jobstore.connect(url)
        self.rq_conn = queue.connect(url)
        self.alloc = SlotAllocator(self.conn, ttl_s=LEASE_TTL_S, clock_ms=lambda: self.now_ms)
        self.store = jobstore.JobStore(
            self.conn, tile_lease_s=LEASE_TTL_S, clock=lambda: self.now_ms / 1000
        )
        self.queue = queue.RenderQueue(self.rq_conn, "gpu")
        self.hosts = self._hosts(devices)
        self.devices = [d for _, _, offers in self.hosts for d in offers]
        self.specs: dict[str, JobSpec] = {}
        self.streams = 0
        # the sessions each device's stream service holds: lease id -> lease
        self.sessions: dict[str, dict[str, Lease]] = defaultdict(dict)
        # the devices whose stream service's renewal tick is scheduled
        self.ticking: set[str] = set()
        # each device's rq worker, and the execution and queue of the task it runs
        self.workers: dict[str, queue._FarmWorker] = {}
        self.running: dict[str, tuple[Any, Queue]] = {}
        # what the workers write about their tiles (the task records, the workers page)
        self.records = TaskRecords(self.conn)
        self.registry = workerstate.WorkerRegistry(
            self.conn, silent_s=AGENT_TIMEOUT_S, retention_s=3600
        )
        self.reporters: dict[str, workerstate.Reporter] = {}
        self.beacons: dict[str, workerstate.Beacon] = {}
        # the start record each device's worker wrote last (the end builds on it)
        self.kept: dict[str, Attempt | None] = {}
        # the tile rendering on each device now and its lease, renewed by the worker's beat
        self.rendering: dict[str, tuple[TileTask, Lease]] = {}

        # rq's worker (and the farm's, its maintenance) reads the time from the virtual clock
        def clock() -> datetime:
            return datetime.fromtimestamp(self.now_ms / 1000, tz=UTC)

        rq.worker.base.now = clock  # type: ignore[attr-defined]
        queue.now = clock  # type: ignore[attr-defined]

    # --- the pool --------------------------------------------------------------------------

    def _hosts(self, n: int) -> list[tuple[str, int | None, list[DeviceOffer]]]:
        classes = sorted(FAKE_MODELS)
        hosts = []
        for h in range(max(1, (n + 7) // 8)):
            name = classes[h % len(classes)]
            model = FAKE_MODELS[name]
            count = min(8, n - 8 * h)
            offers = [
                DeviceOffer(
                    f"GPU-sim-{h}-{i}",
                    name,
                    model.name,
                    model.memory_total_mib,
                    model.encoder_engines * SESSIONS_PER_ENGINE,
                    1,
                )
                for i in range(count)
            ]
            budget = CONSUMER_HOST_SESSIONS if model.consumer else None
            hosts.append((f"host-{h}", budget, offers))
        return hosts

    def register(self, host: str, budget: int | None, offers: list[DeviceOffer]) -> None:
        """The host's devices' first registration (their processes' agents keep them alive)."""
        self.fig.timed(
            "heartbeat", self.alloc.register, f"agent-{host}", host, offers,
            ttl_s=AGENT_TIMEOUT_S, host_encoder_budget=budget,
        )  # fmt: skip

    def device_beat(self, kind: str, host: str, budget: int | None, offer: DeviceOffer) -> None:
        """A process's beats on a device, as the real one's (render: ``workers.worker``, stream:
        ``encoder.service``): its device agent's heartbeat for its one device with its entry on
        the workers page and, for a stream service, its registration (where the web finds it),
        in one round trip (``farm.alloc.agent.heartbeat``). ``--beats apart`` sends them one
        by one, as before (the worker's two threads; the service's agent thread, then its
        event loop's registration and page entry)."""
        name = f"{'w' if kind == 'render' else 'stream'}-{offer.id}"
        beacon = self.beacons.get(name)
        if beacon is None:
            identity = {"kind": kind, "host": host, "device_id": offer.id, "queue": "gpu",
                        "device_class": offer.device_class, "model": offer.model}  # fmt: skip
            beacon = self.beacons[name] = workerstate.Beacon(self.registry, name, identity)
        entry = None
        if kind == "stream":  # StreamService.registration's shape and size
            entry = {"url": f"http://{host}:8701", "device_id": offer.id,
                     "device_class": offer.device_class, "model": offer.model, "host": host,
                     "pid": 4321, "started": 1.7e9, "encoder_sessions": offer.encoder_sessions,
                     "encode_mpx_s": 512.0,
                     "alive_until": self.now_ms / 1000 + AGENT_TIMEOUT_S}  # fmt: skip
        if self.args.beats == "together":
            beside: Beside = beacon.beat_in
            if kind == "render" and self._tile_renewals_carried:
                # the worker's beat carries its rendering tile's renewal (workers.tasks)
                beside = together(beside, partial(self._tile_renewal_in, offer.id))
            if entry is not None:
                beside = partial(registration_writes, device_id=offer.id, entry=entry,
                                 beacon=beacon)  # fmt: skip
                if self._renewals_carried:
                    # the service's beat carries its sessions' renewals (farm.alloc.renewals)
                    beside = together(beside, partial(self._stream_renewals_in, offer.id))
            # a GPU agent's offer carries NVML's reading: the memory in use (the driver's own
            # here) and the encoder sessions open (the device's streams')
            read = replace(offer, observed_vram_mib=DRIVER_MIB,
                           observed_encoder_sessions=len(self.sessions[offer.id]))  # fmt: skip
            # a beat that carries a tile's renewal is when that renewal comes back: its latency
            # is the renewal's as the worker sees it
            carrying = (
                kind == "render" and self._tile_renewals_carried and offer.id in self.rendering
            )
            self.fig.timed("renew" if carrying else f"{kind}_heartbeat", heartbeat, self.alloc,
                           f"agent-{name}", host, [read], AGENT_TIMEOUT_S, budget,
                           beside)  # fmt: skip
        else:
            # a GPU agent read its devices' leases to reconcile them with NVML before each beat
            # (the registration now works that out and returns them); every device here is a GPU
            self.fig.timed("lease_snapshot", self.alloc.devices, [offer.id])
            self.fig.timed(
                f"{kind}_heartbeat", self.alloc.register, f"agent-{name}", host, [offer],
                ttl_s=AGENT_TIMEOUT_S, host_encoder_budget=budget,
            )  # fmt: skip
            if entry is not None:
                self.fig.timed("stream_registration", self.conn.hset, keys.STREAM_SERVICES,
                               offer.id, json.dumps(entry))  # fmt: skip
            self.fig.timed(f"{kind}_beacon", self.registry.beat, name, beacon.identity)
        self.at(AGENT_TIMEOUT_S / 3, lambda: self.device_beat(kind, host, budget, offer))

    def _reporter(self, device_id: str) -> workerstate.Reporter:
        reporter = self.reporters.get(device_id)
        if reporter is None:
            reporter = self.reporters[device_id] = workerstate.Reporter(
                self.registry, f"w-{device_id}"
            )
        return reporter

    # --- events ---------------------------------------------------------------------------

    def at(self, delay_s: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.events, (self.now_ms + int(delay_s * 1000), next(self.seq), action))

    def run_until(self, until_ms: int) -> None:
        while self.events and self.events[0][0] <= until_ms:
            when, _, action = heapq.heappop(self.events)
            self.now_ms = when
            action()
        self.now_ms = until_ms

    # --- jobs ------------------------------------------------------------------------------

    def top_up(self) -> None:
        """Keep more tiles waiting than there are devices (workers never starve)."""
        depth = self.fig.timed("depth", self.queue.depth)
        per_job = FRAMES_PER_JOB * 4
        for _ in range(max(0, (2 * len(self.devices) - depth + per_job - 1) // per_job)):
            priority = 5 if self.rng.random() < self.args.priority_share else 0
            source = BlendSource("path", "/sim/scene.blend", "0" * 64, "scene.blend")
            spec = JobSpec(
                source, tuple(range(1, FRAMES_PER_JOB + 1)), TILES, 640, 360, "/sim/out",
                device="gpu", priority=priority, vram_mib=RENDER_VRAM_MIB,
            )  # fmt: skip
            job_id = self.fig.timed("submit", submit, self.rq_conn, self.store, self.queue,
                                    spec, [], False)  # fmt: skip
            self.specs[job_id] = spec
        self.at(1.0, self.top_up)

    # --- render workers ---------------------------------------------------------------------

    def worker_idle(self, device: DeviceOffer) -> None:
        got = self.fig.timed("dequeue", self._dequeue, device.id)
        if got is None:
            self.at(IDLE_POLL_S, lambda: self.worker_idle(device))
            return
        job, args = got
        if job.func_name == queue.ASSEMBLE_TASK:
            job_id, frame, attempt = args
            if self.fig.timed("claim_frame", self.store.claim_frame, job_id, frame, attempt):
                self.at(2.0, lambda: self._assembled(device, job, job_id, frame, attempt))
            else:
                self._task_done(device, job)
            return
        task = TileTask(*args)
        if not self._tile_begins(device, task):
            self._task_done(device, job)
            return
        request = Request(
            "render", vram_mib=RENDER_VRAM_MIB, render_slots=1, device_ids=(device.id,),
            job=task.job_id,
        )  # fmt: skip
        shown: LeaseBeside | None = None
        if self.args.tile_writes == "batched":
            # the tile on the workers page, written with the lease's grant
            shown = rendering_shown(self._reporter(device.id), task, "")
        lease = self.fig.timed("acquire", self.alloc.try_acquire, f"w-{device.id}", request,
                               shown)  # fmt: skip
        if lease is None:  # a stream holds the device's memory: hand the tile back
            self.fig.timed("record", self.records.ended, task, self.now_ms / 1000, "requeued",
                           started=self.kept.pop(device.id, None), cause="no room")  # fmt: skip
            outcome, attempt = self.fig.timed("fail_tile", self.store.fail_tile, task,
                                              "no room", 3, False)  # fmt: skip
            if outcome == "retry":
                retry = TileTask(task.job_id, task.frame, task.index, attempt)
                self.fig.timed("requeue", self.queue.stage_tiles, [retry], 60)
            self._task_done(device, job)
            return
        if shown is None:
            self.fig.timed("activity", self.registry.start_task, f"w-{device.id}", "rendering",
                           task="tile", job=task.job_id, frame=task.frame, tile=task.index,
                           lease=lease.id)  # fmt: skip
        duration = max(1.0, self.rng.expovariate(1 / self.args.tile_s))
        end_ms = self.now_ms + int(duration * 1000)
        self._renew_tile(device, job, task, lease, end_ms)

    def _tile_begins(self, device: DeviceOffer, task: TileTask) -> bool:
        """The worker's writes as a tile starts: the tile's start with its start record, the
        disabled flag; False where the tile is not this attempt's to start."""
        name, label, now_s = f"w-{device.id}", f"GPU ({device.model})", self.now_ms / 1000
        record: Attempt | None
        if self.args.tile_writes == "batched":
            started, record, _ = self.fig.timed(
                "tile_begin", begin_writes, self.conn, self.store, self.records,
                self._reporter(device.id), task, name, label, device.device_class, now_s,
            )  # fmt: skip
            if started != "ok":
                return False
        else:
            if self.fig.timed("start_tile", self.store.start_tile, task) != "ok":
                return False
            record = self.fig.timed("record", self.records.started, task, name, label, now_s,
                                    device.device_class)  # fmt: skip
            self.fig.timed("disabled", self.registry.is_disabled, name)
        self.kept[device.id] = record
        return True

    def _tile_leaves(self, device: DeviceOffer, task: TileTask, lease: Lease) -> None:
        """The worker's writes as a tile leaves its device: its end record, the worker idle
        with the tile counted, the lease's release."""
        name, now_s, started = f"w-{device.id}", self.now_ms / 1000, self.kept.pop(device.id)
        if self.args.tile_writes == "batched":
            reporter = self._reporter(device.id)
            reporter.count("done")
            end = AttemptEnd("done", now_s, started, {})
            # timed as the release: the release's round trip, which carries the other two
            self.fig.timed("release", end_writes, self.conn, self.records, reporter, self.alloc,
                           lease, task, end)  # fmt: skip
            return
        self.fig.timed("record", self.records.ended, task, now_s, "done", started=started)
        self.fig.timed("activity_end", self.registry.end_task, name, ["done"])
        self.fig.timed("release", self.alloc.release, lease)

    def _worker(self, device_id: str) -> queue._FarmWorker:
        worker = self.workers.get(device_id)
        if worker is None:
            # the task's function never runs (the simulation does its work); with ``--rq rq``
            # rq's own Job deletes it after its success
            if self.args.rq == "rq":
                worker = queue.build_worker(self.rq_conn, "gpu", f"w-{device_id}", None,
                                            _RqBookkeeping, Job, _RqFetch)  # fmt: skip
            else:
                worker = queue.build_worker(self.rq_conn, "gpu", f"w-{device_id}")
            worker.register_birth()  # type: ignore[no-untyped-call]
            self.workers[device_id] = worker
        return worker

    def _dequeue(self, device_id: str) -> tuple[Job, tuple[Any, ...]] | None:
        # rq's Worker.work around a task: the take (with its beats, and rq's maintenance when
        # due), then SimpleWorker.execute_job and perform_job up to the task's function
        worker = self._worker(device_id)
        if self.args.disabled_read == "apart":
            # the worker's read of its disabled flag before each take, as it was before the
            # pick read it in the take's own round trip
            self.fig.timed("disabled", self.registry.is_disabled, f"w-{device_id}")
        got = worker.dequeue_job_and_maintain_ttl(None)
        if got is None:
            return None
        job, q = got
        self.running[device_id] = (self.fig.timed("rq_start", _rq_start, worker, job), q)
        return job, tuple(job.args)

    def _task_done(self, device: DeviceOffer, job: Job) -> None:
        # the rest of perform_job (the task returned), execute_job and the loop's beat
        worker = self.workers[device.id]
        execution, q = self.running.pop(device.id)
        self.fig.timed("rq_finish", _rq_finish, worker, job, q, execution)
        self.at(0.0, lambda: self.worker_idle(device))

    @property
    def _tile_renewals_carried(self) -> bool:
        return bool(self.args.beats == "together" and self.args.tile_renewals == "carried")

    def _tile_renewal_in(self, device_id: str, pipe: Any) -> Callable[[Sequence[Any]], None]:
        """The device's rendering tile's renewal, on its worker's heartbeat's pipeline
        (``workers.tasks.CarriedRenewal``)."""
        held = self.rendering.get(device_id)
        if held is None:
            return lambda _replies: None
        task, lease = held
        read = self._renewal_in(pipe, lease, task)

        def done(replies: Sequence[Any]) -> None:
            self.rendering[device_id] = (task, read(replies))

        return done

    def _renewal_in(self, pipe: Any, lease: Lease, task: TileTask) -> Callable[[Any], Lease]:
        """A render worker's renewal on ``pipe``: the device's lease and the tile's
        (``workers.tasks.renew_leases_in``); the function returned gives the renewed lease."""
        read = renew_leases_in(pipe, self.alloc, self.store, lease, task)

        def renewed(replies: Sequence[Any]) -> Lease:
            lease, ours = read(replies)
            if not ours:
                raise SystemExit(f"a tile was taken over in a farm where nothing dies: {task}")
            return lease

        return renewed

    def _finish_carried(self, device: DeviceOffer, job: Job) -> None:
        task, lease = self.rendering.pop(device.id)
        self._finish_tile(device, job, task, lease)

    def _renew_both(self, lease: Lease, task: TileTask) -> Lease:
        """A render worker's renewal in a round trip of its own (``--tile-renewals apart``)."""
        pipe = self.conn.pipeline(transaction=False)
        read = self._renewal_in(pipe, lease, task)
        return read(pipe.execute(raise_on_error=False))

    def _renew_tile(
        self, device: DeviceOffer, job: Job, task: TileTask, lease: Lease, end_ms: int
    ) -> None:
        every_ms = int(LEASE_TTL_S / 3 * 1000)
        if self._tile_renewals_carried:
            # renewed by the worker's beats (every third of the agent timeout, no longer than
            # a third of the lease's) until it finishes
            self.rendering[device.id] = (task, lease)
            self.at((end_ms - self.now_ms) / 1000, lambda: self._finish_carried(device, job))
            return
        if self.now_ms + every_ms < end_ms:

            def renew() -> None:
                renewed = self.fig.timed("renew", self._renew_both, lease, task)
                self._renew_tile(device, job, task, renewed, end_ms)

            self.at(every_ms / 1000, renew)
            return

        self.at(max(0, end_ms - self.now_ms) / 1000,
                lambda: self._finish_tile(device, job, task, lease))  # fmt: skip

    def _finish_tile(self, device: DeviceOffer, job: Job, task: TileTask, lease: Lease) -> None:
        """The tile rendered: its commit (fenced), its writes as it leaves the device."""
        spec = self.specs[task.job_id]
        outcome = self.fig.timed("commit", self.store.finish_tile, task,
                                 spec.tasks_per_frame, lease.id, lease.token)  # fmt: skip
        self._tile_leaves(device, task, lease)
        if outcome == "frame_ready":
            self.fig.timed("enqueue_assembly", self.queue.enqueue_assembly, task.job_id,
                           task.frame, 60)  # fmt: skip
        self._task_done(device, job)

    def _assembled(
        self, device: DeviceOffer, job: Job, job_id: str, frame: int, attempt: int
    ) -> None:
        self.fig.timed("finish_frame", self.store.finish_frame, job_id, frame, attempt)
        self._task_done(device, job)

    def sweep(self, device: DeviceOffer) -> None:
        found = self.fig.timed("sweep", self.store.sweep, f"w-{device.id}", LEASE_TTL_S)
        if found.tiles or found.frames or found.unconfirmed:
            raise SystemExit(f"the sweep found lost work in a farm where nothing dies: {found}")
        self.at(LEASE_TTL_S, lambda: self.sweep(device))

    # --- streams ------------------------------------------------------------------------------

    def stream_arrives(self, lifetime_s: float | None = None) -> None:
        life = (
            lifetime_s if lifetime_s is not None else self.rng.expovariate(1 / self.args.stream_s)
        )
        request = Request("stream", vram_mib=STREAM_VRAM_MIB, encoder_sessions=1)
        lease = self.fig.timed("acquire", self.alloc.try_acquire, "stream", request)
        if lease is None:
            return
        self.streams += 1
        sessions = self.sessions[lease.device]
        if not self._renewals_carried and lease.device not in self.ticking:
            # the device's stream service renews its sessions' leases together, at its own tick
            # (farm.alloc.renewals), out of phase with the other services' (``--beats
            # together``: its heartbeat carries them)
            self.ticking.add(lease.device)
            every_s = LEASE_TTL_S / 3
            self.at(self.rng.uniform(0, every_s), lambda: self._renew_streams(lease.device))
        sessions[lease.id] = lease

        def end() -> None:
            self.fig.timed("release", self.alloc.release, sessions.pop(lease.id))
            self.streams -= 1

        self.at(life, end)

    @property
    def _renewals_carried(self) -> bool:
        return bool(self.args.beats == "together" and self.args.stream_renewals == "carried")

    def _stream_renewals_in(self, device: str, pipe: Any) -> Callable[[Sequence[Any]], None]:
        """A stream service's sessions' renewals, carried by its heartbeat's round trip."""
        sessions = self.sessions[device]
        read = self.alloc.renew_many_in(pipe, list(sessions.values()))

        def renewed(replies: Sequence[Any]) -> None:
            for lease in read(replies):
                if not isinstance(lease, Lease):
                    raise SystemExit(
                        f"a stream lost its lease in a farm where nothing dies: {lease}"
                    )
                sessions[lease.id] = lease

        return renewed

    def _renew_streams(self, device: str) -> None:
        """One tick of a stream service: its sessions' leases in one call (none: it stops)."""
        sessions = self.sessions[device]
        if not sessions:
            self.ticking.discard(device)
            return
        renewed = self.fig.timed("renew", self.alloc.renew_many, list(sessions.values()))
        for lease in renewed:
            if not isinstance(lease, Lease):
                raise SystemExit(f"a stream lost its lease in a farm where nothing dies: {lease}")
            sessions[lease.id] = lease
        self.at(LEASE_TTL_S / 3, lambda: self._renew_streams(device))

    def stream_arrivals(self, rate_per_s: float) -> None:
        self.stream_arrives()
        self.at(self.rng.expovariate(rate_per_s), lambda: self.stream_arrivals(rate_per_s))

    # --- start --------------------------------------------------------------------------------

    def start(self) -> None:
        for host, budget, offers in self.hosts:
            self.register(host, budget, offers)
        # the steady state from the first second: queued work, sessions already running
        # (residual lifetimes of exponential sessions are exponential), workers out of phase
        self.top_up()
        n = len(self.devices)
        target = self.args.streams_per_device * n
        for _ in range(int(target)):
            self.stream_arrives(self.rng.expovariate(1 / self.args.stream_s))
        self.at(0.0, lambda: self.stream_arrivals(target / self.args.stream_s))
        for host, budget, offers in self.hosts:
            for device in offers:
                self.at(self.rng.uniform(0, self.args.tile_s), self._idle_action(device))
                self.at(self.rng.uniform(0, LEASE_TTL_S), self._sweep_action(device))
                for kind in ("render", "stream"):
                    self.at(self.rng.uniform(0, AGENT_TIMEOUT_S / 3),
                            self._beat_action(kind, host, budget, device))  # fmt: skip

    def _idle_action(self, device: DeviceOffer) -> Callable[[], None]:
        return lambda: self.worker_idle(device)

    def _sweep_action(self, device: DeviceOffer) -> Callable[[], None]:
        return lambda: self.sweep(device)

    def _beat_action(
        self, kind: str, host: str, budget: int | None, device: DeviceOffer
    ) -> Callable[[], None]:
        return lambda: self.device_beat(kind, host, budget, device)


def redis_cpu_s(conn: redis.Redis) -> float:
    info = conn.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def command_usec(conn: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, usec) per command, scripts by name (INFO commandstats; EVALSHA as one)."""
    out = {}
    for name, stats in conn.info("commandstats").items():
        out[name.removeprefix("cmdstat_")] = (int(stats["calls"]), int(stats["usec"]))
    return out


def script_names() -> dict[str, str]:
    """sha1 -> name of every Lua script the farm sends by EVALSHA (to read SLOWLOG by script);
    the function libraries' calls name themselves (FCALL name)."""
    out = {}
    for name, value in vars(queue).items():
        if isinstance(value, str) and name.isupper() and "redis.call" in value:
            out[hashlib.sha1(value.encode()).hexdigest()] = name.lower().lstrip("_")
    return out


def _function_name(words: list[bytes]) -> str:
    """A library function's short name (``alloc_acquire_<digest>`` -> ``acquire``); an acquire
    also says its kind and whether it was pinned to devices or placed."""
    name = words[1].decode().rsplit("_", 1)[0].split("_", 1)[-1]
    if name == "acquire" and len(words) > 12:
        # FCALL name numkeys now kind ... device ids (the tenth argument)
        name += f":{words[4].decode()}:{'pinned' if words[12] else 'placed'}"
    return name


def profile(conn: redis.Redis, entries: int) -> dict[str, list[float]]:
    """Per command or script: [calls, median us, total ms] inside redis-server (SLOWLOG: the
    commands a script runs are listed too, and counted in its own time)."""
    names = script_names()
    spent: dict[str, list[int]] = defaultdict(list)
    for entry in conn.slowlog_get(entries):
        words = entry["command"].split()
        name = words[0].decode().lower()
        if name == "evalsha" and len(words) > 1:
            name = names.get(words[1].decode(), "script?")
        elif name == "fcall" and len(words) > 1:
            name = _function_name(words)
        spent[name].append(int(entry["duration"]))
    rows = {
        name: [len(v), float(statistics.median(v)), round(sum(v) / 1000, 1)]
        for name, v in spent.items()
    }
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][2])[:16])


def idle_cpu_rate(conn: redis.Redis, seconds: float = 2.0) -> float:
    """Redis's own CPU while nobody calls it (its timers), in cores: subtracted from windows."""
    cpu0 = redis_cpu_s(conn)
    time.sleep(seconds)  # a measurement window, not a synchronisation
    return (redis_cpu_s(conn) - cpu0) / seconds


def measure_s_for(devices: int, args: argparse.Namespace) -> float:
    """Simulated seconds to measure: ``--measure-s``, shortened for big farms so that the
    run keeps to about ``--ops-budget`` calls, and lengthened for small ones so that it makes
    at least ``--min-ops`` (a few hundred calls are a few hundredths of a second of Redis's
    CPU, which the kernel accounts in ticks); the load per simulated second is never cut."""
    per_s = 1.3 * devices  # calls per simulated second per device, about
    wanted = max(args.measure_s, args.min_ops / per_s)
    return float(max(args.min_measure_s, min(wanted, args.ops_budget / per_s)))


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


def simulate(devices: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as d:
        server = RedisServer(Path(d), unix_socket=True)
        with server:
            farm = Farm(server.url, devices, args)
            probe = redis.Redis.from_url(server.url)
            for setting in filter(None, args.redis_config.split(",")):
                probe.config_set(*setting.split("=", 1))
            idle = idle_cpu_rate(probe)
            measure_s = measure_s_for(devices, args)
            wall0 = time.monotonic()
            farm.start()
            farm.run_until(farm.now_ms + int(args.warmup_s * 1000))
            farm.fig.recording = True
            if args.profile:
                probe.config_set("slowlog-log-slower-than", 0)
                probe.config_set("slowlog-max-len", 1_000_000)
                probe.slowlog_reset()
            stats0 = command_usec(probe)
            cpu0, wall1 = redis_cpu_s(probe), time.monotonic()
            trips0 = sum(_sent.values())
            farm.run_until(farm.now_ms + int(measure_s * 1000))
            trips = sum(_sent.values()) - trips0
            cpu1, wall2 = redis_cpu_s(probe), time.monotonic()
            stats1 = command_usec(probe)
            memory = int(probe.info("memory")["used_memory"])
            spent = profile(probe, 1_000_000) if args.profile else {}
            probe.close()
            streams = farm.streams
    fig = farm.fig
    ops = sum(fig.calls.values())
    # the server's idle timers ran for the window's wall time; the farm's work is the rest
    cpu = max(0.0, cpu1 - cpu0 - idle * (wall2 - wall1))
    usec = {
        name: (calls - stats0.get(name, (0, 0))[0], us - stats0.get(name, (0, 0))[1])
        for name, (calls, us) in stats1.items()
    }
    top = sorted(usec.items(), key=lambda kv: -kv[1][1])[:6]
    row: dict[str, Any] = {
        "devices": devices,
        "hosts": len(farm.hosts),
        "streams": streams,
        "sim_s": measure_s,
        "wall_s": round(wall2 - wall1, 1),
        "total_wall_s": round(wall2 - wall0, 1),
        "ops_per_s": round(ops / measure_s, 1),
        "redis_cpu_cores": round(cpu / measure_s, 4),
        "redis_cpu_us_per_op": round(cpu / max(1, ops) * 1e6, 2),
        # client round trips (a command, a pipeline, a script) of every call in the window
        "round_trips_per_s": round(trips / measure_s, 1),
        "redis_cpu_us_per_round_trip": round(cpu / max(1, trips) * 1e6, 2),
        "redis_idle_cores": round(idle, 4),
        "redis_memory_mib": round(memory / 2**20, 1),
        "calls_per_s": {k: round(v / measure_s, 1) for k, v in sorted(fig.calls.items())},
        # where the server's time went in the window (commandstats: calls, us per call)
        "top_commands": {name: [calls, round(us / max(1, calls), 1)] for name, (calls, us) in top},
    }
    if spent:
        row["slowlog"] = spent
    for name in MEASURED:
        values = fig.latency_ns.get(name, [])
        if values:
            row[f"{name}_p50_ms"] = round(percentile(values, 0.5), 3)
            row[f"{name}_p99_ms"] = round(percentile(values, 0.99), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", default="8,100,1000,10000")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="simulated seconds")
    ap.add_argument("--measure-s", type=float, default=60.0, help="simulated seconds, at most")
    ap.add_argument("--min-measure-s", type=float, default=10.0, help="simulated seconds, least")
    ap.add_argument(
        "--ops-budget",
        type=float,
        default=200_000,
        help="calls to measure per N (shortens the window for big N)",
    )
    ap.add_argument(
        "--min-ops",
        type=float,
        default=5_000,
        help="calls to measure per N at least (lengthens the window for small N)",
    )
    ap.add_argument("--tile-s", type=float, default=10.0, help="mean tile render time")
    ap.add_argument("--stream-s", type=float, default=1200.0, help="mean stream session")
    ap.add_argument("--streams-per-device", type=float, default=1.0)
    ap.add_argument("--priority-share", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument(
        "--rq",
        choices=("farm", "rq"),
        default="farm",
        help="the workers' rq bookkeeping: the farm's (farm.queue) or rq's own (bench/rq_task.py)",
    )
    ap.add_argument(
        "--tile-writes",
        choices=("batched", "one-by-one"),
        default="batched",
        help="a worker's writes as a tile starts and leaves its device: in one round trip "
        "each (workers.tasks), or one by one as before",
    )
    ap.add_argument(
        "--beats",
        choices=("together", "apart"),
        default="together",
        help="each render worker's and stream service's agent heartbeat, workers-page entry "
        "and (a service) registration and sessions' renewals: in one round trip "
        "(farm.alloc.agent.heartbeat), or one by one as before",
    )
    ap.add_argument(
        "--disabled-read",
        choices=("pick", "apart"),
        default="pick",
        help="a worker's disabled flag before each take: read by the pick (farm.queue), or "
        "in a round trip of its own as before",
    )
    ap.add_argument(
        "--stream-renewals",
        choices=("carried", "apart"),
        default="carried",
        help="a stream service's sessions' renewals: carried by its heartbeat's round trip "
        "(encoder.service), or in a call of their own every lease period / 3 as before "
        "(always so with --beats apart)",
    )
    ap.add_argument(
        "--tile-renewals",
        choices=("carried", "apart"),
        default="carried",
        help="a rendering tile's renewal: carried by its worker's heartbeat's round trip "
        "(workers.tasks.CarriedRenewal), or in a round trip of its own every lease period / 3 "
        "as before (always so with --beats apart)",
    )
    ap.add_argument(
        "--redis-config",
        default="",
        help="CONFIG SET name=value,... on the server before the run (to compare settings)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="log every command (SLOWLOG) and show where the server's time went",
    )
    args = ap.parse_args()
    counts = [int(n) for n in args.devices.split(",")]
    redis.connection.AbstractConnection.send_packed_command = _counted  # type: ignore[method-assign]
    print(
        f"{os.cpu_count()} CPUs; lease TTL {LEASE_TTL_S:g} s, tiles {args.tile_s:g} s mean, "
        f"streams {args.stream_s:g} s mean ({args.streams_per_device:g}/device), "
        f"{args.warmup_s:g} s warm-up + {args.measure_s:g} s measured (simulated; fewer for "
        f"big farms, at most {args.ops_budget:g} calls; more for small ones, at least "
        f"{args.min_ops:g} calls)",
        flush=True,
    )
    header = (
        f"{'devices':>7} {'ops/s':>8} {'redisCPU':>8} {'us/op':>6} "
        + " ".join(f"{name + ' p50/p99 ms':>22}" for name in MEASURED)
        + f" {'wall s':>7}"
    )
    print(header, flush=True)
    rows = []
    for n in counts:
        row = simulate(n, args)
        rows.append(row)
        lat = " ".join(
            f"{row.get(f'{m}_p50_ms', 0):>10.3f}/{row.get(f'{m}_p99_ms', 0):<11.3f}"
            for m in MEASURED
        )
        print(
            f"{n:>7} {row['ops_per_s']:>8.0f} {row['redis_cpu_cores']:>8.3f} "
            f"{row['redis_cpu_us_per_op']:>6.1f} {lat} {row['total_wall_s']:>7.1f}",
            flush=True,
        )
    first, last = rows[0], rows[-1]
    ratio = last["redis_cpu_us_per_op"] / max(1e-9, first["redis_cpu_us_per_op"])
    print(
        f"Redis CPU per operation at {last['devices']} devices / at {first['devices']}: "
        f"{ratio:.2f} (target <= 1.5); Redis CPU at {last['devices']}: "
        f"{last['redis_cpu_cores']:.3f} cores (target <= 0.3); p99 acquire "
        f"{last.get('acquire_p99_ms', 0):.2f} ms (target <= 5)",
        flush=True,
    )
    print(
        json.dumps(
            {
                "bench": "scale",
                "cpus": os.cpu_count(),
                "args": vars(args),
                "rows": rows,
                "cost_ratio_10000_vs_8": round(ratio, 3),
                "redis_cpu_at_10000": last["redis_cpu_cores"],
                "median_us_per_op": statistics.median(r["redis_cpu_us_per_op"] for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
