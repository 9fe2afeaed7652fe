"""Relaying a WebSocket: messages both ways between a client's socket and the one the web opened
further on (a stream service's, or a cell's behind the front door), until either side closes."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web


async def answer(request: web.Request, far: aiohttp.ClientWebSocketResponse) -> web.StreamResponse:
    """The client's WebSocket, relayed to ``far`` until either side closes; then both closed.
    Messages of any size pass: ``far``'s end holds them to its own limits."""
    near = web.WebSocketResponse(max_msg_size=0)
    try:
        await near.prepare(request)
        await relay(near, far)
    finally:
        await far.close()
        await near.close()
    return near


async def relay(near: web.WebSocketResponse, far: aiohttp.ClientWebSocketResponse) -> None:
    """Text and binary messages each way as they come; pings are each side's own (autoping)."""
    tasks = [asyncio.ensure_future(_pump(far, near)), asyncio.ensure_future(_pump(near, far))]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(source: Any, sink: Any) -> None:
    async for msg in source:
        if msg.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(msg.data)
        elif msg.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(msg.data)
