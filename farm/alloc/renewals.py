"""Lease renewals sent together: the leases of one process (a stream service's sessions) are
renewed at a shared tick in one call (``SlotAllocator.renew_many``), one round trip to Redis
however many sessions a device holds, instead of one a session at times of its own. A process
that beats at the same tick (a stream service's device agent) carries them in its heartbeat's
round trip (``carrier``), and asks for the tick's call even when no lease does (``beat``)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence

from farm.alloc.allocator import Lease, SlotAllocator
from farm.errors import LeaseLost

#: sends a tick's renewals (maybe none) with the process's other writes of the tick, in one
#: round trip, and returns each lease's outcome, in order (on a thread of its own)
Carrier = Callable[[Sequence[Lease]], list[Lease | LeaseLost]]

#: who waits for the tick's call: a lease's holder (its lease) or a beat (None)
_Waiting = list[tuple[Lease | None, "asyncio.Future[Lease | None]"]]


class Renewals:
    """One process's renewals: each holder sleeps to the shared tick (``next_tick``) and asks
    (``renew``); what is asked in one turn of the event loop goes in one call."""

    def __init__(
        self, allocator: SlotAllocator, every_s: float | None = None, carrier: Carrier | None = None
    ) -> None:
        self.allocator = allocator
        #: a lease is renewed three times within its time to live (or more often)
        self.every_s = allocator.ttl_ms / 1000 / 3 if every_s is None else every_s
        self.carrier: Carrier = carrier or allocator.renew_many
        self._waiting: _Waiting = []
        self._calls: set[asyncio.Future[list[Lease | LeaseLost]]] = set()

    async def next_tick(self) -> None:
        """Sleep until the next multiple of ``every_s`` on the loop's clock: every holder
        wakes at the same moment, so their renewals meet in one call."""
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.every_s - loop.time() % self.every_s)

    async def renew(self, lease: Lease) -> Lease:
        """``lease`` renewed, sent with every renewal asked before the loop's next turn;
        raises what ``SlotAllocator.renew`` raises (LeaseLost, FarmError: Redis away)."""
        renewed = await self._ask(lease)
        assert renewed is not None
        return renewed

    async def beat(self) -> None:
        """Wait for this turn's call, made even when no lease is renewed in it: the carrier's
        own writes go out; raises what the call raised (FarmError: Redis away)."""
        await self._ask(None)

    async def drain(self) -> None:
        """Until the calls sent have come back (a call cannot be stopped halfway)."""
        await asyncio.gather(*self._calls, return_exceptions=True)

    async def _ask(self, lease: Lease | None) -> Lease | None:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Lease | None] = loop.create_future()
        self._waiting.append((lease, answer))
        if len(self._waiting) == 1:
            # after every holder woken at this tick has asked
            loop.call_soon(self._send)
        return await answer

    def _send(self) -> None:
        # a waiter that stopped waiting (its session ended, the service stopping its beats)
        # asks for nothing: no call is made for it after its holder is gone
        batch = [(lease, answer) for lease, answer in self._waiting if not answer.done()]
        self._waiting = []
        if not batch:
            return
        leases = [lease for lease, _ in batch if lease is not None]
        # held in _calls until done: the loop keeps only a weak reference to a task
        call = asyncio.ensure_future(asyncio.to_thread(self.carrier, leases))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        call.add_done_callback(functools.partial(_answer, batch))


def _answer(batch: _Waiting, call: asyncio.Future[list[Lease | LeaseLost]]) -> None:
    """Each holder gets its own lease's outcome, or the call's error, and a beat None; one
    that stopped waiting (its session ended meanwhile) gets nothing."""
    if call.cancelled():
        for _, answer in batch:
            answer.cancel()  # (nothing, for one already done)
        return
    error = call.exception()
    outcomes = iter(call.result() if error is None else ())
    for lease, answer in batch:
        outcome = next(outcomes) if lease is not None and error is None else None
        if answer.done():
            continue
        if error is not None:
            answer.set_exception(error)
        elif isinstance(outcome, BaseException):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)
