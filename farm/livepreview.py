"""Live-preview passes in Redis: each tile's latest pass image for viewers joining mid-frame,
and a capped stream of passes as they land for those watching.

A pass is a small display-referred JPEG of the tile's core (what stitching keeps) after that
many samples, tone-mapped by Blender with the scene's view transform. Both keys expire
(FARM_LIVE_PREVIEW_TTL_S after the last pass): a preview is for watching, not a record.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from farm import keys
from farm.redisclient import Redis, guard

#: stream entries kept: enough for a viewer's XREAD to catch up after a slow write, while what
#: the farm keeps stays bounded by the jobs rendering
STREAM_MAXLEN = 256


@dataclass(frozen=True)
class TilePass:
    """One pass of one tile, as viewers get it (``jpeg`` is base64)."""

    frame: int
    tile: int
    attempt: int
    #: the tile's core in the frame, top-down pixels: left, top, width, height
    x: int
    y: int
    w: int
    h: int
    frame_w: int
    frame_h: int
    #: 1-based pass number and the tile's passes
    index: int
    passes: int
    samples: int
    total_samples: int
    jpeg: str
    #: when the worker published it (epoch s): latency measurements start here
    ts: float = 0.0

    @property
    def done(self) -> bool:
        return self.index == self.passes

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TilePass:
        return cls(**json.loads(text))

    def meta(self) -> dict[str, Any]:
        """Everything but the image (logs, events)."""
        return {k: v for k, v in asdict(self).items() if k != "jpeg"}


def encode_jpeg(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def publish(conn: Redis, job_id: str, tile_pass: TilePass, ttl_s: float) -> str:
    """Make ``tile_pass`` the tile's current state and announce it; returns the stream id."""
    stamped = replace(tile_pass, ts=tile_pass.ts or time.time())
    text = stamped.to_json()
    ttl_ms = max(1, int(ttl_s * 1000))
    pipe = conn.pipeline(transaction=True)
    pipe.hset(keys.live_frame(job_id, stamped.frame), str(stamped.tile), text)
    pipe.pexpire(keys.live_frame(job_id, stamped.frame), ttl_ms)
    pipe.xadd(keys.live_passes(job_id), {"pass": text}, maxlen=STREAM_MAXLEN, approximate=True)
    pipe.pexpire(keys.live_passes(job_id), ttl_ms)
    replies = guard(pipe.execute)
    return str(replies[2])


def snapshot(conn: Redis, job_id: str) -> tuple[str, list[TilePass]]:
    """The frame shown now (the one of the latest pass): each tile's latest pass, and the
    stream id to follow from (a pass landing in between may come twice; it is the same)."""
    latest = guard(conn.xrevrange, keys.live_passes(job_id), count=1)
    if not latest:
        return "0", []
    entry_id, fields = latest[0]
    frame = TilePass.from_json(fields["pass"]).frame
    tiles = guard(conn.hgetall, keys.live_frame(job_id, frame))
    passes = sorted((TilePass.from_json(t) for t in tiles.values()), key=lambda p: p.tile)
    return str(entry_id), passes


def follow(conn: Redis, job_id: str, after: str, block_ms: int) -> list[tuple[str, TilePass]]:
    """Passes landed after stream id ``after`` (waiting up to ``block_ms`` for one)."""
    reply = guard(conn.xread, {keys.live_passes(job_id): after}, count=100, block=block_ms)
    out: list[tuple[str, TilePass]] = []
    for _stream, entries in reply or []:
        out.extend((str(eid), TilePass.from_json(f["pass"])) for eid, f in entries)
    return out
