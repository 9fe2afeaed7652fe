"""A UDP relay of the tests' own between a viewer and a stream service on loopback: random loss
and a bottleneck (a rate with a drop-tail queue), as a lossy or narrow path would be.

The viewer is given the relay's address in place of the service's ICE candidates
(``rewrite_candidates``); the relay forwards each datagram to the service from a socket of its
own, which the service learns as a peer-reflexive candidate, and forwards the answers back.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass, field

Address = tuple[str, int]


@dataclass
class Path:
    """What the relay does to datagrams towards the viewer (the media); the way back (NACK,
    PLI, receiver reports) is loss-free, so what is measured is the service's handling of
    lost media."""

    loss: float = 0.0
    #: bottleneck, bits per second (0: none)
    rate_bps: int = 0
    #: a datagram that would wait longer than this in the bottleneck's queue is dropped
    queue_ms: float = 100.0
    seed: int = 1
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


class _Side(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: object) -> None:
        self.on_datagram = on_datagram
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.on_datagram(data, addr)  # type: ignore[operator]


class UdpRelay:
    """One relayed path: viewer <-> relay (``address``) <-> ``target`` (the service)."""

    def __init__(self, target: Address, path: Path) -> None:
        self.target = target
        self.path = path
        self.viewer: Address | None = None
        self.sent = self.dropped = self.queue_drops = 0
        self._busy_until_s = 0.0
        self._front: _Side | None = None
        self._back: _Side | None = None

    @property
    def address(self) -> Address:
        assert self._front is not None and self._front.transport is not None
        host, port = self._front.transport.get_extra_info("sockname")[:2]
        return str(host), int(port)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        _, self._front = await loop.create_datagram_endpoint(
            lambda: _Side(self._from_viewer), local_addr=("127.0.0.1", 0)
        )
        _, self._back = await loop.create_datagram_endpoint(
            lambda: _Side(self._from_service), local_addr=("127.0.0.1", 0)
        )

    def close(self) -> None:
        for side in (self._front, self._back):
            if side is not None and side.transport is not None:
                side.transport.close()

    def _from_viewer(self, data: bytes, addr: Address) -> None:
        self.viewer = addr
        assert self._back is not None and self._back.transport is not None
        self._back.transport.sendto(data, self.target)

    def _from_service(self, data: bytes, addr: Address) -> None:
        if self.viewer is None:
            return
        path = self.path
        if path.loss and path.rng.random() < path.loss:
            self.dropped += 1
            return
        if not path.rate_bps:
            self._deliver(data)
            return
        now_s = time.monotonic()
        start_s = max(now_s, self._busy_until_s)
        if (start_s - now_s) * 1000 > path.queue_ms:
            self.queue_drops += 1
            return
        self._busy_until_s = start_s + len(data) * 8 / path.rate_bps
        asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + (self._busy_until_s - now_s), self._deliver, data
        )

    def _deliver(self, data: bytes) -> None:
        if self._front is not None and self._front.transport is not None and self.viewer:
            self.sent += 1
            self._front.transport.sendto(data, self.viewer)


_CANDIDATE = re.compile(r"^a=candidate:.*$", re.MULTILINE)


def service_candidate(sdp: str) -> Address:
    """The service's first IPv4 UDP host candidate in its answer."""
    for line in _CANDIDATE.findall(sdp):
        parts = line.split()
        if parts[2].lower() == "udp" and parts[4].count(".") == 3 and "host" in parts[6:8]:
            return parts[4], int(parts[5])
    raise ValueError("the answer has no IPv4 UDP host candidate")


def rewrite_candidates(sdp: str, relay: Address) -> str:
    """The answer with one host candidate: the relay's."""
    kept = [line for line in sdp.split("\r\n") if not line.startswith("a=candidate:")]
    out: list[str] = []
    for line in kept:
        out.append(line)
        if line.startswith("m="):
            out.append(f"a=candidate:1 1 udp 2130706431 {relay[0]} {relay[1]} typ host")
    return "\r\n".join(out)
