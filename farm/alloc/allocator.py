"""The slot allocator: one pool of devices (VRAM, encoder sessions, render slots) shared by
renders and streams through fenced, expiring leases held in Redis."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from farm import keys
from farm.accounts import check_role
from farm.alloc import policy, scripts
from farm.alloc.reconcile import LeaseView, Tolerance
from farm.errors import BadParameter, LeaseLost, NeverFits, NoCapacity
from farm.redisclient import Redis, guard

KINDS = ("render", "stream")


@dataclass(frozen=True)
class Request:
    """What a holder needs on one device; empty constraints mean any."""

    kind: str
    vram_mib: int = 0
    encoder_sessions: int = 0
    render_slots: int = 0
    classes: tuple[str, ...] = ()
    device_ids: tuple[str, ...] = ()
    project: str = ""
    #: the asker's role in ``project``: the acquire script applies the project's device policy
    #: for it; empty for an operator's request (the CLI, an operator's stream token)
    role: str = ""
    #: the job the lease works for (usage accounting); empty for streams
    job: str = ""
    #: a stream may revoke render leases when nothing else has room
    preempt: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise BadParameter(f"lease kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for name in ("vram_mib", "encoder_sessions", "render_slots"):
            if getattr(self, name) < 0:
                raise BadParameter(f"{name} must be 0 or more")
        if self.role:
            check_role(self.role)
            if not self.project:
                raise BadParameter(f"a request as role {self.role!r} must name its project")

    def describe(self) -> str:
        parts = [f"{self.vram_mib} MiB VRAM"] if self.vram_mib else []
        if self.encoder_sessions:
            parts.append(f"{self.encoder_sessions} encoder session(s)")
        if self.render_slots:
            parts.append(f"{self.render_slots} render slot(s)")
        where = f" of class {'/'.join(self.classes)}" if self.classes else ""
        if self.device_ids:
            where += f" among {', '.join(self.device_ids)}"
        return f"{self.kind} lease ({', '.join(parts) or 'nothing'}) on a device{where}"


#: queues writes on a pipeline beside a lease's grant (``pipe``, the lease's id); the function
#: it returns reads their replies
LeaseBeside = Callable[[Any, str], Callable[[Sequence[Any]], None]]


@dataclass(frozen=True)
class Lease:
    id: str
    holder: str
    kind: str
    device: str
    token: int
    expires_ms: int
    revoked_others: int = 0


@dataclass(frozen=True)
class DeviceState:
    """One device as the allocator sees it (for `farm gpus`, metrics and tests)."""

    id: str
    agent: str
    host: str
    device_class: str
    model: str
    vram_mib: int
    encoder_sessions: int
    render_slots: int
    used_vram_mib: int
    used_encoder_sessions: int
    used_render_slots: int
    token: int
    available: bool
    alive: bool
    unavailable_reason: str = ""
    unexplained_vram_mib: int = 0
    #: encoder sessions open on the device beyond its leases' (held back)
    unexplained_encoder_sessions: int = 0
    leases: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DeviceOffer:
    """What an agent offers for one device in a registration or heartbeat."""

    id: str
    device_class: str
    model: str
    vram_mib: int
    encoder_sessions: int
    render_slots: int
    available: bool = True
    unavailable_reason: str = ""
    unexplained_vram_mib: int = 0
    #: NVML's energy counter in joules (since the driver loaded); None where not reported
    energy_j: float | None = None
    #: the memory NVML sees in use (an agent that reconciles its GPU): the registration then
    #: works out the unexplained memory itself, against the leases at that instant, and
    #: ``unexplained_vram_mib`` is not used; None where not read
    observed_vram_mib: int | None = None
    #: the encoder sessions NVML sees open: those beyond the leases' are held back; None where
    #: not read (what the device's last reading held back stays)
    observed_encoder_sessions: int | None = None

    def to_json(self) -> dict[str, Any]:
        observed: dict[str, int] = {}
        if self.observed_vram_mib is not None:
            observed["observed_vram_mib"] = self.observed_vram_mib
        if self.observed_encoder_sessions is not None:
            observed["observed_encoder_sessions"] = self.observed_encoder_sessions
        return {
            **observed,
            "id": self.id,
            "device_class": self.device_class,
            "model": self.model,
            "vram_mib": self.vram_mib,
            "encoder_sessions": self.encoder_sessions,
            "render_slots": self.render_slots,
            "available": "1" if self.available else "0",
            "unavailable_reason": self.unavailable_reason,
            "unexplained_vram_mib": self.unexplained_vram_mib,
            "energy_j": -1 if self.energy_j is None else self.energy_j,
        }


class SlotAllocator:
    """Client of the allocator; any number of processes share one Redis."""

    def __init__(
        self,
        conn: Redis,
        ttl_s: float = 15.0,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.conn = conn
        self.ttl_ms = int(ttl_s * 1000)
        # None: Redis's own clock, the same for every host
        self.clock_ms = clock_ms
        self._acquire = scripts.LIBRARY.bind(conn, "acquire")
        self._renew = scripts.LIBRARY.bind(conn, "renew")
        self._renew_many = scripts.LIBRARY.bind(conn, "renew_many")
        self._release = scripts.LIBRARY.bind(conn, "release")
        self._check = scripts.LIBRARY.bind(conn, "check")
        self._register = scripts.LIBRARY.bind(conn, "register")
        self._snapshot = scripts.LIBRARY.bind(conn, "snapshot")

    def _now(self) -> str:
        return "" if self.clock_ms is None else str(self.clock_ms())

    # --- agents --------------------------------------------------------------------------------

    def register(
        self,
        agent: str,
        host: str,
        devices: Sequence[DeviceOffer],
        ttl_s: float,
        host_encoder_budget: int | None = None,
    ) -> dict[str, LeaseView]:
        """Offer (or re-offer: this is also the heartbeat) an agent's devices for ``ttl_s``.
        Returns the leases, summed, of each device offered with ``observed_vram_mib``, as they
        were when its unexplained memory was worked out (the agent's reconciliation)."""
        reply = guard(self._register, args=self._registration(agent, host, devices, ttl_s,
                                                               host_encoder_budget))  # fmt: skip
        return _lease_views(reply)

    def register_in(
        self,
        pipe: Any,
        agent: str,
        host: str,
        devices: Sequence[DeviceOffer],
        ttl_s: float,
        host_encoder_budget: int | None = None,
    ) -> Callable[[Any], dict[str, LeaseView]]:
        """``register`` sent with ``pipe``; the function returned reads its reply (what
        ``register`` returns or raises)."""
        args = self._registration(agent, host, devices, ttl_s, host_encoder_budget)
        self._register.queue(pipe, args=args)
        return lambda value: _lease_views(guard(self._register.reply, value, args=args))

    def _registration(
        self, agent: str, host: str, devices: Sequence[DeviceOffer], ttl_s: float,
        host_encoder_budget: int | None,
    ) -> list[Any]:  # fmt: skip
        budget = -1 if host_encoder_budget is None else host_encoder_budget
        payload = json.dumps([d.to_json() for d in devices])
        tolerance = Tolerance()
        return [self._now(), agent, int(ttl_s * 1000), host, budget, payload,
                tolerance.vram_mib, tolerance.vram_fraction]  # fmt: skip

    # --- leases --------------------------------------------------------------------------------

    def try_acquire(
        self, holder: str, request: Request, beside: LeaseBeside | None = None
    ) -> Lease | None:
        """One attempt: a lease, None when it could fit later, NeverFits when it never can,
        Forbidden when the project's device policy keeps the request's role off the devices.
        ``beside(pipe, lease id)`` queues writes that go in the attempt's round trip, after
        the grant; they are to check that the lease exists (a refused attempt grants none)."""
        lease_id = uuid.uuid4().hex
        args = [
            self._now(), request.kind, holder, lease_id, request.vram_mib,
            request.encoder_sessions, request.render_slots, self.ttl_ms,
            ",".join(request.classes), ",".join(request.device_ids),
            "1" if request.preempt else "0", request.project, request.job, request.role,
        ]  # fmt: skip
        if beside is None:
            reply = guard(self._acquire, args=args)
        else:
            reply = self._acquire_beside(args, lease_id, beside)
        outcome = _text(reply[0])
        if outcome == "forbidden":
            allowed, refused = policy.parse(_text(reply[1])), _text(reply[2]).replace(",", "/")
            raise policy.refusal(request.project, request.role, allowed, refused)
        if outcome == "never":
            raise NeverFits(
                f"no device in the pool can ever hold a {request.describe()}",
                request=request.describe(),
            )
        if outcome == "busy":
            return None
        return Lease(
            id=lease_id,
            holder=holder,
            kind=request.kind,
            device=_text(reply[1]),
            token=int(reply[2]),
            expires_ms=int(reply[3]),
            revoked_others=int(reply[4]),
        )

    def _acquire_beside(self, args: list[Any], lease_id: str, beside: LeaseBeside) -> Any:
        pipe = self.conn.pipeline(transaction=False)
        self._acquire.queue(pipe, args=args)
        read = beside(pipe, lease_id)
        replies = guard(pipe.execute, raise_on_error=False)
        reply = guard(self._acquire.reply, replies[0], args=args)
        if isinstance(replies[0], Exception):
            # the attempt ran again on its own (its library loaded) after the writes beside
            # it had found no lease: they follow it
            pipe = self.conn.pipeline(transaction=False)
            read = beside(pipe, lease_id)
            replies = [reply, *guard(pipe.execute, raise_on_error=False)]
        read(replies[1:])
        return reply

    def acquire(
        self,
        holder: str,
        request: Request,
        wait_s: float = 0.0,
        poll_s: float = 0.05,
        stop: threading.Event | None = None,
        beside: LeaseBeside | None = None,
    ) -> Lease:
        """A lease, waiting up to ``wait_s`` for room; NoCapacity when there is none by then,
        or as soon as ``stop`` is set (a worker told to stop gives up waiting at once).
        ``beside``: as ``try_acquire``'s, with every attempt."""
        deadline = time.monotonic() + wait_s
        delay = poll_s
        stop = stop or threading.Event()
        while True:
            lease = self.try_acquire(holder, request, beside)
            if lease is not None:
                return lease
            if stop.is_set():
                raise NoCapacity(
                    f"no room now for a {request.describe()}, and the waiter stopped waiting",
                    request=request.describe(),
                )
            if time.monotonic() + delay > deadline:
                raise NoCapacity(
                    f"no room now for a {request.describe()}"
                    + (f" (waited {wait_s:.0f} s)" if wait_s else ""),
                    request=request.describe(),
                )
            stop.wait(delay)  # a bounded back-off between attempts, cut short by ``stop``
            delay = min(delay * 2, 1.0)

    def renew(self, lease: Lease) -> Lease:
        return self._held(lease, guard(self._renew, args=self._renew_args(lease)))

    def renew_in(self, pipe: Any, lease: Lease) -> Callable[[Any], Lease]:
        """``renew`` sent with ``pipe`` (``Function.queue``: one round trip with the
        pipeline's other calls); the function returned turns the pipeline's reply for it into
        the renewed lease, or raises what ``renew`` raises."""
        args = self._renew_args(lease)
        self._renew.queue(pipe, args=args)
        return lambda value: self._held(lease, guard(self._renew.reply, value, args=args))

    def _renew_args(self, lease: Lease) -> list[Any]:
        return [self._now(), lease.id, lease.token, self.ttl_ms]

    def _held(self, lease: Lease, reply: Any) -> Lease:
        """The renewed lease of a renewal's reply; LeaseLost where it is gone."""
        outcome = self._renewed(lease, _text(reply[0]), reply[1])
        if isinstance(outcome, LeaseLost):
            raise outcome
        return outcome

    def renew_many(self, leases: Sequence[Lease]) -> list[Lease | LeaseLost]:
        """Renew ``leases`` in one call (one round trip, however many): for each, in order, the
        renewed lease or the LeaseLost ``renew`` would raise. A process holding many leases
        (a stream service's sessions) renews them so."""
        if not leases:
            return []
        args = self._renew_many_args(leases)
        return self._renewed_many(leases, guard(self._renew_many, args=args))

    def renew_many_in(
        self, pipe: Any, leases: Sequence[Lease]
    ) -> Callable[[Sequence[Any]], list[Lease | LeaseLost]]:
        """``renew_many`` sent with ``pipe`` (nothing where ``leases`` is empty); the function
        returned reads its replies (what ``renew_many`` returns or raises)."""
        if not leases:
            return lambda _replies: []
        args = self._renew_many_args(leases)
        self._renew_many.queue(pipe, args=args)
        return lambda replies: self._renewed_many(
            leases, guard(self._renew_many.reply, replies[0], args=args)
        )

    def _renew_many_args(self, leases: Sequence[Lease]) -> list[Any]:
        args: list[Any] = [self._now(), self.ttl_ms]
        for lease in leases:
            args += [lease.id, lease.token]
        return args

    def _renewed_many(self, leases: Sequence[Lease], reply: Any) -> list[Lease | LeaseLost]:
        return [
            self._renewed(lease, _text(status), value)
            for lease, status, value in zip(leases, reply[::2], reply[1::2], strict=True)
        ]

    def _renewed(self, lease: Lease, status: str, value: Any) -> Lease | LeaseLost:
        if status != "ok":
            why = _text(value)
            return LeaseLost(f"lease on {lease.device} lost: {why}", lease=lease.id, why=why)
        return Lease(lease.id, lease.holder, lease.kind, lease.device, lease.token, int(value))

    def release(self, lease: Lease) -> bool:
        return bool(guard(self._release, args=[lease.id, lease.token, self._now()]))

    def release_in(self, pipe: Any, lease: Lease) -> Callable[[Any], bool]:
        """``release`` sent with ``pipe``; the function returned reads the reply for it (what
        ``release`` returns or raises)."""
        args = [lease.id, lease.token, self._now()]
        self._release.queue(pipe, args=args)
        return lambda value: bool(guard(self._release.reply, value, args=args))

    def check(self, lease: Lease) -> bool:
        """The fencing check: is this lease still held, with this token, unexpired?"""
        return bool(guard(self._check, args=[self._now(), lease.id, lease.token]))

    def why_gone(self, lease_id: str) -> str | None:
        value = guard(self.conn.get, keys.lease_gone(lease_id))
        return None if value is None else _text(value)

    # --- the projects' device policy (farm.alloc.policy) ----------------------------------

    def policy(self, project: str) -> dict[str, tuple[str, ...]]:
        """Every role's device classes in ``project`` (its own settings over the defaults)."""
        stored = guard(self.conn.hgetall, keys.project_policy(project))
        return policy.resolve({_text(k): _text(v) for k, v in stored.items()})

    def set_policy(self, project: str, role: str, classes: Sequence[str]) -> None:
        """Which device classes ``role`` may lease in ``project`` (``gpu``: every GPU class);
        leases already granted are kept, every later acquire obeys it."""
        check_role(role)
        named = policy.check_classes(classes)
        guard(self.conn.hset, keys.project_policy(project), role, ",".join(named))

    def check_policy(self, project: str, role: str, device_class: str) -> None:
        """Forbidden unless ``role`` may lease ``device_class`` (or, for ``gpu``, some GPU
        class) in ``project``: for a caller that picks a device or queue before asking."""
        policy.check(project, role, self.policy(project)[check_role(role)], device_class)

    # --- reading -------------------------------------------------------------------------------

    def devices(self, ids: Sequence[str] = ()) -> list[DeviceState]:
        """Every device (or only ``ids``, an agent's own) with its leases, read in one atomic
        step; reading a few devices costs nothing in the farm's size."""
        reply = guard(self._snapshot, args=[self._now(), ",".join(ids)])
        now_ms, rows = json.loads(_text(reply))
        states = []
        for device_id, h, leases in rows:
            states.append(
                DeviceState(
                    id=device_id,
                    agent=h.get("agent", ""),
                    host=h.get("host", ""),
                    device_class=h.get("class", ""),
                    model=h.get("model", ""),
                    vram_mib=int(h.get("vram", 0)),
                    encoder_sessions=int(h.get("enc", 0)),
                    render_slots=int(h.get("slots", 0)),
                    used_vram_mib=int(h.get("used_vram", 0)),
                    used_encoder_sessions=int(h.get("used_enc", 0)),
                    used_render_slots=int(h.get("used_slots", 0)),
                    token=int(h.get("token", 0)),
                    available=h.get("available") == "1",
                    alive=int(h.get("alive_until", 0)) >= now_ms,
                    unavailable_reason=h.get("unavailable_reason", ""),
                    unexplained_vram_mib=int(h.get("unexplained_vram", 0)),
                    unexplained_encoder_sessions=int(h.get("unexplained_enc", 0)),
                    # cjson turns an empty hash into an empty list
                    leases=[{"id": lease_id, **(row or {})} for lease_id, row in leases],
                )
            )
        return states


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lease_views(reply: Any) -> dict[str, LeaseView]:
    """The registration's reply, {device id, leased VRAM, leased encoder sessions, leases, ...},
    by device."""
    flat = list(reply or ())
    return {
        _text(flat[i]): LeaseView(int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
        for i in range(0, len(flat), 4)
    }
