"""Lease renewals sent together: the leases of one process (a stream service's sessions) are
renewed at a shared tick in one call (``SlotAllocator.renew_many``), one round trip to Redis
however many sessions a device holds, instead of one a session at times of its own."""

from __future__ import annotations

import asyncio
import functools

from farm.alloc.allocator import Lease, SlotAllocator
from farm.errors import LeaseLost

#: what a renewal waiting for the next call is answered through
_Waiting = list[tuple[Lease, "asyncio.Future[Lease]"]]


class Renewals:
    """One process's renewals: each holder sleeps to the shared tick (``next_tick``) and asks
    (``renew``); what is asked in one turn of the event loop goes in one call."""

    def __init__(self, allocator: SlotAllocator) -> None:
        self.allocator = allocator
        #: a lease is renewed three times within its time to live
        self.every_s = allocator.ttl_ms / 1000 / 3
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
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Lease] = loop.create_future()
        self._waiting.append((lease, answer))
        if len(self._waiting) == 1:
            # after every holder woken at this tick has asked
            loop.call_soon(self._send)
        return await answer

    def _send(self) -> None:
        batch, self._waiting = self._waiting, []
        leases = [lease for lease, _ in batch]
        # held in _calls until done: the loop keeps only a weak reference to a task
        call = asyncio.ensure_future(asyncio.to_thread(self.allocator.renew_many, leases))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        call.add_done_callback(functools.partial(_answer, batch))


def _answer(batch: _Waiting, call: asyncio.Future[list[Lease | LeaseLost]]) -> None:
    """Each holder gets its own lease's outcome, or the call's error; a holder that stopped
    waiting (its session ended meanwhile) gets nothing."""
    if call.cancelled():
        for _, answer in batch:
            answer.cancel()  # (nothing, for one already done)
        return
    error = call.exception()
    for i, (_, answer) in enumerate(batch):
        if answer.done():
            continue
        outcome = error if error is not None else call.result()[i]
        if isinstance(outcome, BaseException):
            answer.set_exception(outcome)
        else:
            answer.set_result(outcome)
