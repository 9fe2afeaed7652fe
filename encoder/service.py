"""The stream service of one device (a GPU, or the CPU device): admission of sessions through
the slot allocator, their lives, and the service's registration in Redis.

Its HTTP API is encoder/app.py's (the app opens and closes a StreamService); tests and benches
serve one with ``async with serving(settings) as svc:`` or, from synchronous code,
``with running(settings) as svc:`` (both in encoder/app.py; ``svc.url`` is where it answers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from encoder import capacity
from encoder.catalog import TESTPATTERN, Catalog
from encoder.session import SessionState, StreamSession
from encoder.testpattern import MIN_HEIGHT, MIN_WIDTH, check_size
from encoder.turn import ice_servers
from farm import cells, keys, redisclock, sandbox, workerstate
from farm.alloc.agent import DeviceAgent
from farm.alloc.allocator import Lease, Request, SlotAllocator
from farm.alloc.devices import Device
from farm.alloc.renewals import Renewals
from farm.errors import (
    BadParameter,
    DeviceUnavailable,
    FarmError,
    LeaseLost,
    NeverFits,
    NoCapacity,
    NotFound,
)
from farm.gpu.factory import open_nvml
from farm.gpu.types import Nvml
from farm.redisclient import Redis, connect, guard
from farm.settings import Settings

log = logging.getLogger("tessera.stream")

#: ``nvml`` default: open the NVML that FARM_NVML names, on a GPU service
FROM_SETTINGS: Any = object()
#: ended sessions whose last state (and why they ended) the API still answers with
ENDED_KEPT = 200


def registration_writes(
    pipe: Any, device_id: str, entry: dict[str, Any], beacon: workerstate.Beacon
) -> Callable[[Sequence[Any]], None]:
    """A stream service's registration for ``device_id`` (``entry``: where the web finds it)
    and its entry on the workers page, sent with ``pipe``; the function returned reads their
    replies and logs a write Redis refused."""
    pipe.hset(keys.STREAM_SERVICES, device_id, json.dumps(entry))
    page = beacon.beat_in(pipe)

    def read(replies: Sequence[Any]) -> None:
        if isinstance(replies[0], Exception):
            log.warning("event=registration_failed error=%r", str(replies[0]))
        page(replies[1:])

    return read


class StreamService:
    """Sessions on one device, and a device agent for it (its HTTP API: encoder/app.py)."""

    def __init__(
        self,
        settings: Settings,
        *,
        nvml: Nvml | None = FROM_SETTINGS,
        name: str | None = None,
        hostname: str | None = None,
    ) -> None:
        self.settings = settings
        if nvml is FROM_SETTINGS:
            nvml = open_nvml(settings.nvml) if settings.device == "gpu" else None
        self.nvml = nvml
        self.hostname = hostname or socket.gethostname()
        self.name = name or f"stream-{self.hostname}-{settings.device}-{os.getpid()}"
        self.catalog = Catalog.load(settings.stream_apps)
        self.sessions: dict[str, StreamSession] = {}
        #: the last sessions that ended, as they were at their end (with the reason)
        self.ended: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: where its API answers (set by ``announce``; empty before)
        self.url = ""
        self.started = time.time()
        self.conn: Redis | None = None
        self.allocator: SlotAllocator | None = None
        #: the sessions' lease renewals, carried by the device agent's heartbeat: one round
        #: trip a tick for the service's beat and every session's renewal
        self.renewals: Renewals | None = None
        self.agent: DeviceAgent | None = None
        #: the agent's beats, at the renewals' tick (the agent runs no thread of its own)
        self._beats: asyncio.Task[None] | None = None
        #: its entry on the workers page, written with its agent's heartbeat
        self.beacon: workerstate.Beacon | None = None
        #: megapixels a second the device encodes (configured, or measured at start)
        self.encode_mpx_s = settings.stream_encode_mpx_s

    # --- life ------------------------------------------------------------------------------

    @property
    def device(self) -> Device:
        assert self.agent is not None, "the service is not started"
        return self.agent.devices[0]

    async def start(self) -> None:
        # a sandbox that cannot start here fails the service now, naming the fix
        await asyncio.to_thread(sandbox.check, self.settings)
        self.conn = connect(self.settings.redis_url)
        # on the clock the workers page reads its age with (farm.redisclock)
        self.started = await asyncio.to_thread(redisclock.now, self.conn)
        self.allocator = SlotAllocator(self.conn, ttl_s=self.settings.lease_ttl_s)
        self.agent = self._make_agent(self.allocator)
        every_s = min(self.settings.lease_ttl_s / 3, self.agent.interval_s)
        self.renewals = Renewals(self.allocator, every_s, carrier=self._beat)
        await asyncio.to_thread(self.agent.beat)
        self._beats = asyncio.create_task(self._beat_every_tick(), name="stream-beats")
        if self.encode_mpx_s <= 0:
            self.encode_mpx_s = await asyncio.to_thread(
                capacity.probe_mpx_s, self.settings, self.device.index
            )
            log.info("event=encoder_probed device=%s encode_mpx_s=%.1f", self.device.id,
                     self.encode_mpx_s)  # fmt: skip

    async def announce(self, url: str) -> None:
        """Serving at ``url``: registered in Redis (the web finds the service there) and kept
        registered by its device agent's heartbeat, in the same round trip, until ``stop``."""
        self.url = url
        agent = self.agent
        assert agent is not None, "the service is not started"
        agent.beside = self._registration_in
        await asyncio.to_thread(agent.beat)
        log.info("event=stream_service_ready name=%s device=%s url=%s encode_sessions=%d "
                 "encode_mpx_s=%.1f", self.name, self.device.id, self.url,
                 self.device.encoder_sessions, self.encode_mpx_s)  # fmt: skip

    def _make_agent(self, allocator: SlotAllocator) -> DeviceAgent:
        index = self.settings.gpu_index or 0
        gpu = self.settings.device == "gpu"

        def mine(device: Device) -> bool:
            return device.index == index if gpu else device.index is None

        agent = DeviceAgent(
            self.settings,
            allocator,
            self.name,
            nvml=self.nvml if gpu else None,
            select=mine,
            farm_pids=lambda: {os.getpid(), *self.pids()},
            hostname=self.hostname,
        )
        if not agent.devices:
            raise DeviceUnavailable(f"stream service {self.name}: no GPU {index} on this host")
        return agent

    async def end_sessions(self, reason: str = "the stream service stopped") -> None:
        await asyncio.gather(*(s.end(reason) for s in list(self.sessions.values())))

    async def stop(self) -> None:
        await self.end_sessions()
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats
        if self.renewals is not None:
            # no beat after this: it would register the service again
            await self.renewals.drain()
        if self.url:
            with contextlib.suppress(FarmError):
                await asyncio.to_thread(self._unregister)
        if self.conn is not None:
            self.conn.close()
        log.info("event=stream_service_stopped name=%s", self.name)

    async def __aenter__(self) -> StreamService:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- registration ----------------------------------------------------------------------

    def registration(self, now: float | None = None) -> dict[str, Any]:
        """What the web finds of this service, alive until ``now`` plus its agent's timeout, on
        Redis's clock, which the web reads it with (farm.redisclock); without ``now`` (the
        service's own route, on its event loop) the clock is read without waiting on Redis."""
        device = self.device
        now = redisclock.now_nowait(self._redis()) if now is None else now
        return {
            "url": self.url,
            "device_id": device.id,
            "device_class": device.device_class,
            "model": device.model,
            "host": device.host,
            "pid": os.getpid(),
            "started": self.started,
            "encoder_sessions": device.encoder_sessions,
            "encode_mpx_s": round(self.encode_mpx_s, 1),
            "alive_until": now + self.settings.agent_timeout_s,
        }

    async def _beat_every_tick(self) -> None:
        """The device agent's heartbeat every tick, with the registration and the page entry
        once announced, and the renewals of the sessions' leases asked at the same tick."""
        renewals = self.renewals
        assert renewals is not None
        while True:
            await renewals.next_tick()
            try:
                await renewals.beat()
            except FarmError as exc:
                # Redis away: keep trying; the pool drops the device if this lasts past the
                # agent's timeout, which is what should happen
                log.warning("event=heartbeat_failed agent=%s error=%r", self.name, exc.message)
            except Exception:
                log.exception("event=heartbeat_failed agent=%s", self.name)

    def _beat(self, leases: Sequence[Lease]) -> list[Lease | LeaseLost]:
        """The renewals' carrier (on a thread): the agent's heartbeat with ``leases``' renewals
        in its round trip. A registration Redis refused is logged when the renewals came back
        (the sessions keep them); when they did not, the call's error is every session's."""
        agent = self.agent
        assert agent is not None
        outcomes: list[Lease | LeaseLost] = []

        def renewing(pipe: Any) -> Callable[[Sequence[Any]], None]:
            read = self._allocator().renew_many_in(pipe, leases)
            return lambda replies: outcomes.extend(read(replies))

        try:
            agent.beat(extra=renewing)
        except FarmError as exc:
            if len(outcomes) != len(leases):
                raise
            log.warning("event=heartbeat_failed agent=%s error=%r", self.name, exc.message)
        return outcomes

    def _registration_in(self, pipe: Any) -> Callable[[Sequence[Any]], None]:
        """The service's registration (the web finds it there) and its entry on the workers
        page, sent with ``pipe``: its device agent's heartbeat (``DeviceAgent.beside``). The
        function returned reads their replies and logs a write Redis refused."""
        entry = self.registration(redisclock.now(self._redis()))
        return registration_writes(pipe, self.device.id, entry, self._beacon())

    def _beacon(self) -> workerstate.Beacon:
        """The service on the workers page: its device, its sessions and its GPU's
        utilisation."""
        if self.beacon is None:
            device = self.device
            identity = {"kind": "stream", "host": device.host, "pid": os.getpid(),
                        "queue": self.settings.device, "device_id": device.id,
                        "device_class": device.device_class, "model": device.model,
                        "started": self.started}  # fmt: skip
            registry = workerstate.registry_for(self._redis(), self.settings)
            self.beacon = workerstate.Beacon(registry, self.name, identity, self._gauges)
        return self.beacon

    def _gauges(self) -> dict[str, Any]:
        sessions, agent = len(self.sessions), self.agent
        assert agent is not None, "the service is not started"
        return {
            "activity": "streaming" if sessions else "idle",
            "task": f"{sessions} session{'s' if sessions != 1 else ''}" if sessions else "",
            **agent.gauges(),
        }

    def _unregister(self) -> None:
        conn = self._redis()
        raw = guard(conn.hget, keys.STREAM_SERVICES, self.device.id)
        # only our own entry: a newer service for the device may have replaced it
        if raw is not None and json.loads(raw).get("url") == self.url:
            guard(conn.hdel, keys.STREAM_SERVICES, self.device.id)
        workerstate.registry_for(conn, self.settings).forget(self.name)

    def _redis(self) -> Redis:
        assert self.conn is not None
        return self.conn

    def _allocator(self) -> SlotAllocator:
        assert self.allocator is not None
        return self.allocator

    # --- sessions --------------------------------------------------------------------------

    async def create_session(
        self,
        app_name: str,
        width: int | None = None,
        height: int | None = None,
        fps: int | None = None,
        project: str = "",
        owner: str = "",
        role: str = "",
    ) -> StreamSession:
        """Admit (lease), start and return a session; NoCapacity when the device is full,
        Forbidden when ``project``'s device policy keeps ``role`` (the owner's role there) off
        this device."""
        app = self.catalog.get(app_name).sized(width, height, fps)
        if await asyncio.to_thread(self._drained):
            # 503: the web offers the session to another stream service
            raise NoCapacity(f"stream service {self.name} is disabled (drained) by an operator: "
                             "it starts no new session, its running ones continue",
                             device=self.device.id)  # fmt: skip
        if app.name == TESTPATTERN and not check_size(app.width, app.height):
            raise BadParameter(
                f"the test pattern needs at least {MIN_WIDTH}x{MIN_HEIGHT}, "
                f"not {app.width}x{app.height}"
            )
        running = [
            capacity.Demand(*s._video_size(), s.app.fps)
            for s in self.sessions.values()
            if s.state in (SessionState.STARTING, SessionState.RUNNING)
        ]
        asked = capacity.Demand(app.width, app.height, app.fps)
        capacity.check(self.encode_mpx_s, running, asked, self.device.id)
        lease = await asyncio.to_thread(self._admit, project, role)
        session = StreamSession(
            app, self.device, lease, self._allocator(), self.settings,
            ice_servers=lambda user: ice_servers(self.settings, user),
            on_ended=self._ended, project=project, owner=owner, renewals=self.renewals,
            session_id=cells.new_id(self.settings.cell, 16),
        )  # fmt: skip
        self.sessions[session.id] = session
        await session.start()
        if session.state is not SessionState.RUNNING:
            raise NotFound(f"session {session.id} ended while starting: {session.reason}")
        return session

    def _drained(self) -> bool:
        """An operator disabled this service on the workers page (`farm workers disable`)."""
        return workerstate.registry_for(self._redis(), self.settings).is_disabled(self.name)

    def _admit(self, project: str, role: str) -> Lease:
        device = self.device
        request = Request(
            "stream",
            vram_mib=self.settings.stream_vram_mib,
            encoder_sessions=1,
            device_ids=(device.id,),
            project=project,
            role=role,
            preempt=True,
        )
        allocator = self._allocator()
        try:
            lease = allocator.try_acquire(self.name, request)
        except NeverFits as exc:
            why = (
                "it has no video encoder (NVENC) for stream sessions"
                if device.encoder_sessions == 0
                else exc.message
            )
            raise NeverFits(
                f"device {device.id} ({device.model}) can never hold a stream session: {why}; "
                "use another device (or the CPU device's stream service)",
                device=device.id,
            ) from None
        if lease is None:
            raise NoCapacity(self._full_reason(device), device=device.id)
        return lease

    def _full_reason(self, device: Device) -> str:
        state = next((d for d in self._allocator().devices() if d.id == device.id), None)
        if state is None:
            return f"device {device.id} is not in the pool (its agent is silent)"
        if not state.available:
            return f"device {device.id} is unavailable: {state.unavailable_reason}"
        return (
            f"device {device.id} ({device.model}) is full: "
            f"{state.used_encoder_sessions}/{state.encoder_sessions} encoder sessions, "
            f"{state.used_vram_mib}/{state.vram_mib} MiB in use; "
            "try again later or another device"
        )

    def session(self, session_id: str) -> StreamSession:
        """A live session; NotFound otherwise, saying why when it ended lately (the error's
        fields carry ``state: ended`` and the ``reason``)."""
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        ended = self.ended.get(session_id)
        if ended is not None:
            raise NotFound(
                f"stream session {session_id} has ended: {ended['reason']}",
                session=session_id,
                state="ended",
                reason=ended["reason"],
            )
        raise NotFound(f"no stream session {session_id} on this service", session=session_id)

    def session_json(self, session_id: str) -> dict[str, Any]:
        """A live session, or one that ended lately as it was at its end (state "ended",
        with the reason)."""
        ended = self.ended.get(session_id)
        return ended if ended is not None else self.session(session_id).to_json()

    async def end_session(self, session_id: str, reason: str = "ended by request") -> None:
        if session_id not in self.ended:  # ending twice is no error
            await self.session(session_id).end(reason)

    def _ended(self, session: StreamSession) -> None:
        if self.sessions.get(session.id) is session:
            del self.sessions[session.id]
        self.ended[session.id] = session.to_json()
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def pids(self) -> set[int]:
        # called from the agent's thread: copy the sessions in one step
        return {pid for s in tuple(self.sessions.values()) for pid in s.pids()}
