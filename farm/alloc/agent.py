"""A device agent: offers this host's devices to the slot allocator, keeps them alive with
heartbeats, marks faulty GPUs unavailable, and reconciles leases with what NVML sees."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from farm import metrics
from farm.alloc.allocator import DeviceOffer, SlotAllocator
from farm.alloc.devices import Device, host_devices, host_encoder_budget
from farm.alloc.reconcile import Drift, LeaseView, reconcile
from farm.errors import FarmError, NvmlError
from farm.gpu.types import GpuInfo, Nvml
from farm.redisclient import guard
from farm.settings import Settings

log = logging.getLogger("tessera.agent")

#: queues writes on a pipeline; the function it returns reads their replies
Beside = Callable[[Any], Callable[[Sequence[Any]], None]]

#: NVML's reading of an agent's GPUs: those it read, and those it could not (why)
Reading = tuple[list[GpuInfo], dict[str, str]]

#: how long a heartbeat waits for NVML's reading. A driver that stops answering (a wedged GPU)
#: must not hold the beat: its round trip keeps the devices alive and carries the stream
#: service's renewals, which would otherwise lapse under sessions still streaming.
NVML_WAIT_S = 2.0


def together(*besides: Beside) -> Beside:
    """Several processes' writes on one pipeline, each reading its own replies (in order)."""

    def queue(pipe: Any) -> Callable[[Sequence[Any]], None]:
        base = len(pipe)
        spans: list[tuple[int, int, Callable[[Sequence[Any]], None]]] = []
        for beside in besides:
            start = len(pipe) - base
            read = beside(pipe)
            spans.append((start, len(pipe) - base, read))

        def read_all(replies: Sequence[Any]) -> None:
            for start, end, read in spans:
                read(replies[start:end])

        return read_all

    return queue


def heartbeat(
    allocator: SlotAllocator, agent: str, host: str, offers: Sequence[DeviceOffer], ttl_s: float,
    host_encoder_budget: int | None, beside: Beside | None = None,
) -> dict[str, LeaseView]:  # fmt: skip
    """An agent's registration (its heartbeat) and ``beside``'s writes, in one round trip;
    returns what ``SlotAllocator.register`` does. A registration Redis refuses raises
    (``FarmError``), as ``register`` does; ``beside`` reads its own replies."""
    pipe = allocator.conn.pipeline(transaction=False)
    registered = allocator.register_in(pipe, agent, host, offers, ttl_s, host_encoder_budget)
    read_beside = beside(pipe) if beside is not None else None
    replies = guard(pipe.execute, raise_on_error=False)
    if read_beside is not None:
        read_beside(replies[1:])
    return registered(replies[0])


class NvmlReader:
    """NVML's readings for an agent's beats, each made on a thread of its own and waited for at
    most ``wait_s``. A reading not back by then is late: the beat goes without it, and the next
    beat waits for that same reading (one in flight at most), never starting another on a driver
    that is not answering."""

    def __init__(self, read: Callable[[], Reading], wait_s: float) -> None:
        self._read, self.wait_s = read, wait_s
        self._pending: Future[Reading] | None = None
        self._started_s = 0.0

    def read(self) -> Reading | None:
        """The reading, or None where it is late (``late_s`` says since when); raises what the
        read raised (``NvmlError``: NVML failing as a whole)."""
        if self._pending is None:
            self._pending = Future()
            self._started_s = time.monotonic()
            threading.Thread(target=self._run, args=(self._pending,), name="nvml-read",
                             daemon=True).start()  # fmt: skip
        pending = self._pending
        try:
            return pending.result(timeout=self.wait_s)
        except TimeoutError:
            return None
        finally:
            if pending.done():
                self._pending = None

    @property
    def late_s(self) -> float:
        """How long the reading in flight has been waited for (0: none is)."""
        return 0.0 if self._pending is None else time.monotonic() - self._started_s

    def _run(self, pending: Future[Reading]) -> None:
        try:
            pending.set_result(self._read())
        except BaseException as exc:
            pending.set_exception(exc)


class DeviceAgent:
    """One process's claim on some of the host's devices (a render worker: its one device)."""

    def __init__(
        self,
        settings: Settings,
        allocator: SlotAllocator,
        name: str,
        *,
        nvml: Nvml | None,
        select: Callable[[Device], bool] = lambda _d: True,
        farm_pids: Callable[[], set[int]] = set,
        hostname: str | None = None,
        nvml_wait_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.allocator = allocator
        self.name = name
        self.nvml = nvml
        self.farm_pids = farm_pids
        self.devices = [d for d in host_devices(settings, nvml, hostname) if select(d)]
        self.budget = host_encoder_budget(settings, self.devices)
        self.drifts: list[Drift] = []
        #: this beat's reading of each GPU, by NVML index (none while NVML is late)
        self.gpus: dict[int, GpuInfo] = {}
        wait_s = NVML_WAIT_S if nvml_wait_s is None else nvml_wait_s
        self._reader = NvmlReader(self.read_gpus, wait_s)
        #: writes sent with each heartbeat, in its round trip (the process's entry on the
        #: workers page, ``Beacon.beat_in``; a stream service's registration for the web)
        self.beside: Beside | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval_s(self) -> float:
        # three beats per timeout: one lost beat never drops the devices
        return self.settings.agent_timeout_s / 3

    def offers(self, gpus: Sequence[GpuInfo], faults: dict[str, str]) -> list[DeviceOffer]:
        """The devices as they are now: a GPU NVML cannot read (``faults``) is offered as
        unavailable; one it read (``gpus``) with the memory and the encoder sessions it sees in
        use, from which the registration works out, against the leases at that instant, what
        no lease explains. This agent knows only its own pids (a stream service's process
        beside a render worker would look foreign), so only use beyond every lease is held
        back."""
        seen = {gpu.uuid: gpu for gpu in gpus}
        offers = []
        for device in self.devices:
            gpu = seen.get(device.id)
            offers.append(
                DeviceOffer(
                    id=device.id,
                    device_class=device.device_class,
                    model=device.model,
                    vram_mib=device.vram_mib,
                    encoder_sessions=device.encoder_sessions,
                    render_slots=device.render_slots,
                    available=device.id not in faults,
                    unavailable_reason=faults.get(device.id, ""),
                    energy_j=None if gpu is None else gpu.energy_j,
                    observed_vram_mib=None if gpu is None else gpu.memory_used_mib,
                    observed_encoder_sessions=None if gpu is None else gpu.encoder_sessions,
                )
            )
        return offers

    def read_gpus(self) -> Reading:
        """NVML's reading of this agent's GPUs now, and the devices it could not read (why)."""
        gpus: list[GpuInfo] = []
        faults: dict[str, str] = {}
        for device in self.devices:
            if device.index is None or self.nvml is None:
                continue
            try:
                gpus.append(self.nvml.device(device.index))
            except NvmlError as exc:
                faults[device.id] = exc.message
        return gpus, faults

    def beat(self, extra: Beside | None = None) -> None:
        """Register (again): capacities, availability and unexplained use, alive for a timeout;
        with ``beside``'s writes, and ``extra``'s, in the same round trip. Then the drift
        between the leases, as the registration saw them, and NVML's reading is logged
        (``drifts``). NVML's reading is waited for ``nvml_wait_s`` at most (``NvmlReader``):
        without it the devices are offered with nothing observed, and as unavailable once NVML
        has not answered for the agent timeout (their leases stay; no new one is placed)."""
        reading = self._reader.read() if self.nvml is not None else ([], {})
        gpus, faults = reading if reading is not None else ([], self._silent())
        self.gpus = {gpu.index: gpu for gpu in gpus}
        if reading is None:
            metrics.forget_gpus(self.devices)
        metrics.observe_gpus(self.devices, gpus)
        writes = [b for b in (self.beside, extra) if b is not None]
        leases = heartbeat(self.allocator, self.name, self.devices[0].host,
                           self.offers(gpus, faults), self.settings.agent_timeout_s, self.budget,
                           together(*writes) if writes else None)  # fmt: skip
        self.drifts = self._reconcile(gpus, leases) if gpus else []

    def gauges(self) -> dict[str, Any]:
        """The workers page's gauges of this agent's process (a render worker's, a stream
        service's): its device's utilisation in this beat's reading, never a query of its
        own. None without one (a CPU, NVML late) clears the figure shown, not leaves the last."""
        device = self.devices[0]
        gpu = self.gpus.get(device.index) if device.index is not None else None
        return {"utilization_pct": None if gpu is None else gpu.utilization_pct}

    def _silent(self) -> dict[str, str]:
        """The faults to offer while NVML's reading is late: none until it has been late for
        the agent timeout, then every GPU of this agent's."""
        late_s = self._reader.late_s
        log.warning("event=nvml_late agent=%s waited_s=%.1f", self.name, late_s)
        if late_s < self.settings.agent_timeout_s:
            return {}
        why = f"NVML has not answered for {late_s:.0f} s (a hung driver or a wedged GPU)"
        return {d.id: why for d in self.devices if d.index is not None}

    def _reconcile(self, gpus: list[GpuInfo], leases: dict[str, LeaseView]) -> list[Drift]:
        # only this agent's GPUs: another agent's devices are not ours to judge
        mine = [d for d in self.devices if d.index is not None]
        drifts = reconcile(mine, leases, gpus, self.farm_pids())
        for drift in drifts:
            log.warning("event=drift agent=%s device=%s kind=%s expected=%d observed=%d msg=%r",
                        self.name, drift.device_id, drift.kind, drift.expected, drift.observed,
                        drift.message)  # fmt: skip
        return drifts

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="device-agent", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except FarmError as exc:
                # Redis away or NVML failing as a whole: keep trying; the pool drops our devices
                # if this lasts past the timeout, which is what should happen
                log.warning("event=heartbeat_failed agent=%s error=%r", self.name, exc.message)
            except Exception:
                log.exception("event=heartbeat_failed agent=%s", self.name)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
