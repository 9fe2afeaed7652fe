"""Latest frame wins: a slow encoder skips captured frames, a slow viewer skips to a keyframe;
nothing queues up behind."""

from __future__ import annotations

import asyncio

import numpy as np
from av.packet import Packet
from av.video.frame import VideoFrame

from encoder.capture import FrameSlot
from encoder.peers import MAX_PENDING_FRAMES, PacketTrack


def test_the_encoder_takes_the_newest_frame_and_skips_the_rest() -> None:
    slot = FrameSlot()
    for i in range(4):
        slot.put(VideoFrame.from_ndarray(np.zeros((16, 16), np.uint8), format="gray"), 1000 + i)
    taken = slot.take(timeout_s=1)
    assert taken is not None and taken.seq == 4 and taken.capture_us == 1003
    assert slot.skipped == 3
    assert slot.take(timeout_s=0.01) is None  # nothing new: no stale frame comes back
    slot.close()
    assert slot.take(timeout_s=1) is None


def test_a_viewer_that_falls_behind_drops_stale_frames_and_restarts_at_a_keyframe() -> None:
    async def main() -> None:
        asked: list[int] = []
        track = PacketTrack(lambda: asked.append(1), max_pending=MAX_PENDING_FRAMES)
        track.push(Packet(b"p0"), keyframe=False)
        assert track.dropped == 1, "a P-frame before the first keyframe is undecodable"
        track.push(Packet(b"k1"), keyframe=True)
        assert bytes(await track.recv()) == b"k1" and asked == [
            1
        ]  # the first pull asks for a keyframe
        for i in range(MAX_PENDING_FRAMES):
            track.push(Packet(f"p{i}".encode()), keyframe=False)
        # the sender did not pull: one more frame means it is behind
        track.push(Packet(b"late"), keyframe=False)
        assert track.catch_ups == 1 and track.waiting_keyframe and asked == [1, 1]
        track.push(Packet(b"p9"), keyframe=False)
        track.push(Packet(b"k2"), keyframe=True)
        assert bytes(await track.recv()) == b"k2"
        track.stop()

    asyncio.run(main())
