"""The test client's own pieces: the marker-aware jitter buffer and the stamp, over real aiortc."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import av
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtp import RtpPacket

from encoder import testpattern
from tests.encoder.streamclient import (
    CountingJitterBuffer,
    MarkerJitterBuffer,
    PatternTrack,
    Stamp,
    Viewer,
    read_stamp,
)


def packet(seq: int, timestamp: int, marker: bool, data: bytes) -> RtpPacket:
    p = RtpPacket(payload_type=96, marker=int(marker), sequence_number=seq, timestamp=timestamp)
    p._data = data  # type: ignore[attr-defined]
    return p


def test_a_frame_is_complete_on_its_marker_packet_not_one_frame_later() -> None:
    ours, stock = MarkerJitterBuffer(), JitterBuffer(capacity=512, is_video=True)
    frame_packets = [
        packet(100, 3000, False, b"a"),
        packet(101, 3000, False, b"b"),
        packet(102, 3000, True, b"c"),
    ]
    for p in frame_packets[:-1]:
        assert ours.add(p)[1] is None
        stock.add(p)
    done = ours.add(frame_packets[-1])[1]
    assert done is not None and done.data == b"abc" and done.timestamp == 3000
    # the stock buffer still holds it: it waits for the next frame's first packet
    assert stock.add(frame_packets[-1])[1] is None
    assert stock.add(packet(103, 6000, True, b"d"))[1] is not None
    assert ours.add(packet(103, 6000, True, b"d"))[1] is not None


def test_a_frame_whose_marker_was_lost_still_goes_out_when_the_next_one_starts() -> None:
    ours = MarkerJitterBuffer()
    assert ours.add(packet(7, 90, False, b"x"))[1] is None
    done = ours.add(packet(8, 180, False, b"y"))[1]
    assert done is not None and (done.data, done.timestamp) == (b"x", 90)


def test_a_counting_viewer_counts_frames_and_decodes_none() -> None:
    counting = CountingJitterBuffer()
    for seq, (timestamp, marker) in enumerate([(1, False), (1, True), (2, True), (3, True)]):
        assert counting.add(packet(seq, timestamp, marker, b"zz"))[1] is None
    assert (counting.frames, counting.bytes) == (3, 8)


def test_stamp_survives_h264_encode_and_decode() -> None:
    scene = testpattern.Scene(1280, 720)
    encoder = av.CodecContext.create("libx264", "w")
    encoder.width, encoder.height, encoder.pix_fmt = 1280, 720, "yuv420p"
    encoder.options = {"preset": "ultrafast", "tune": "zerolatency", "crf": "35"}
    decoder = av.CodecContext.create("h264", "r")
    now_us = time.time_ns() // 1000
    decoded = []
    for counter in (123456, 123457):
        frame = av.VideoFrame.from_ndarray(scene.yuv420p(counter, now_us + counter), "yuv420p")
        for pkt in [*encoder.encode(frame), *([] if counter < 123457 else encoder.encode(None))]:
            decoded.extend(decoder.decode(pkt))
    stamps = [read_stamp(f) for f in decoded]
    assert stamps == [Stamp(123456, now_us + 123456), Stamp(123457, now_us + 123457)]


def test_plain_aiortc_frames_arrive_decoded_with_their_stamps() -> None:
    asyncio.run(plain_loopback())


async def plain_loopback() -> None:
    sender = RTCPeerConnection()
    track = PatternTrack(640, 360, fps=30)
    sender.addTrack(track)
    viewer = Viewer()

    async def signal(offer: dict[str, Any]) -> dict[str, Any]:
        await sender.setRemoteDescription(RTCSessionDescription(offer["sdp"], "offer"))
        await sender.setLocalDescription(await sender.createAnswer())
        return {"type": "answer", "sdp": sender.localDescription.sdp}

    try:
        await viewer.connect(signal)
        first = await viewer.next_frame(timeout_s=20)
        later = await viewer.wait_frame(
            lambda f: read_stamp(f.frame).counter > read_stamp(first.frame).counter + 5, 10
        )
        stamp = read_stamp(later.frame)
        assert (later.frame.width, later.frame.height) == (640, 360)
        assert 0 <= later.arrival_s - stamp.capture_s < 2.0
    finally:
        await viewer.close()
        await sender.close()
        track.stop()
        await asyncio.sleep(0)
