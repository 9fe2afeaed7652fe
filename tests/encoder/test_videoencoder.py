"""The session's encoder: which one is picked, its low-latency options, keyframes on demand,
bitrate changes in place."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from av.video.frame import VideoFrame

from encoder.capture import TIME_BASE
from encoder.testpattern import Scene
from encoder.videoencoder import (
    EncoderConfig,
    NvencEncoder,
    X264Encoder,
    open_encoder,
    start_bitrate,
)
from farm.errors import BadParameter, EncoderUnavailable
from tests import doubles
from tests.doubles import FakeNvencEncoder

CONFIG = EncoderConfig(
    width=640, height=360, fps=30, bitrate_bps=2_000_000, min_bps=200_000, max_bps=4_000_000
)


def frames(n: int, noisy: bool = False) -> list[VideoFrame]:
    scene = Scene(640, 360)
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        planes = scene.yuv420p(i, i * 33_333)
        if noisy:  # incompressible content, so the bitrate shows in the packet sizes
            planes[48:360] = rng.integers(0, 255, (312, 640), dtype=np.uint8)
        frame = VideoFrame.from_ndarray(planes, format="yuv420p")
        frame.pts, frame.time_base = i * 3000, TIME_BASE
        out.append(frame)
    return out


def nvenc_opens(gpu_index: int) -> bool:
    try:
        NvencEncoder(CONFIG.__class__(**{**CONFIG.__dict__, "gpu_index": gpu_index}))
    except EncoderUnavailable:
        return False
    return True


def test_auto_picks_nvenc_when_it_opens_on_the_gpu_and_libx264_otherwise() -> None:
    on_cpu = open_encoder("auto", CONFIG)
    assert on_cpu.codec_name == "libx264"
    gpu = EncoderConfig(**{**CONFIG.__dict__, "gpu_index": 0})
    picked = open_encoder("auto", gpu)
    assert picked.codec_name == ("h264_nvenc" if nvenc_opens(0) else "libx264")
    assert open_encoder("off", gpu).codec_name == "libx264"
    if not nvenc_opens(0):
        with pytest.raises(EncoderUnavailable, match="h264_nvenc could not be opened"):
            open_encoder("require", gpu)
    with pytest.raises(EncoderUnavailable, match="no GPU"):
        open_encoder("require", CONFIG)


def test_without_the_test_doubles_the_fake_mode_is_refused_naming_the_real_ones() -> None:
    with doubles.removed(), pytest.raises(BadParameter) as refused:
        open_encoder("fake", CONFIG)
    assert refused.value.message == "FARM_NVENC 'fake' is not one of auto, require, off"


def test_the_nvenc_path_builds_low_latency_options_and_encodes_through_the_same_interface() -> None:
    gpu = EncoderConfig(**{**CONFIG.__dict__, "gpu_index": 1, "input_format": "bgr0"})
    encoder = open_encoder("fake", gpu)
    assert isinstance(encoder, FakeNvencEncoder)
    assert encoder.codec_name == "h264_nvenc" and encoder.backend == "libx264"
    opts = encoder.options
    assert opts["delay"] == "0" and opts["zerolatency"] == "1" and opts["bf"] == "0"
    assert (opts["tune"], opts["rc"], opts["forced-idr"], opts["gpu"]) == ("ull", "cbr", "1", "1")
    # one frame of the top rate in the rate buffer: no frame waits behind another
    assert int(opts["bufsize"]) == 4_000_000 // 30
    packets = [p for f in frames(3) for p in encoder.encode(f)]
    assert len(packets) == 3 and packets[0].is_keyframe


def test_frames_come_out_one_for_one_and_a_requested_keyframe_is_the_next_frame() -> None:
    encoder = X264Encoder(CONFIG)
    assert encoder.options["preset"] == "ultrafast" and encoder.options["tune"] == "zerolatency"
    keys = []
    for i, frame in enumerate(frames(12)):
        packets = encoder.encode(frame, keyframe=i == 7)
        assert len(packets) == 1, "the encoder held a frame back"
        assert packets[0].time_base == TIME_BASE and packets[0].pts == i * 3000
        keys.append(packets[0].is_keyframe)
    # a keyframe at the start and where asked, none in between (no periodic GOP)
    assert [i for i, k in enumerate(keys) if k] == [0, 7]
    assert encoder.keyframes == 2


def test_the_bitrate_follows_requests_within_bounds_without_reopening() -> None:
    encoder = X264Encoder(CONFIG)
    ctx = encoder.ctx
    sizes = []
    for i, frame in enumerate(frames(90, noisy=True)):
        if i == 30:
            encoder.set_bitrate(100_000)  # below the floor: clamped to 200 kbit/s
        if i == 60:
            encoder.set_bitrate(3_000_000)
        sizes.append(sum(p.size for p in encoder.encode(frame)))
        if i == 59:
            assert encoder.bitrate_bps == 200_000
            encoder.set_bitrate(205_000)  # within 5 %: not worth a reconfiguration
    assert encoder.ctx is ctx, "the encoder was rebuilt"
    assert encoder.bitrate_bps == 3_000_000 and encoder.bitrate_changes == 2
    start, low, high = sum(sizes[10:30]), sum(sizes[40:60]), sum(sizes[70:90])
    assert low < start / 4 and high > low * 4, (start, low, high)
    encoder.set_bitrate(10**9)
    encoder.encode(frames(91)[90])
    assert encoder.bitrate_bps == 4_000_000


def test_frames_of_another_size_or_format_are_converted() -> None:
    encoder = X264Encoder(EncoderConfig(**{**CONFIG.__dict__, "width": 320, "height": 180}))
    bgra = VideoFrame.from_ndarray(np.zeros((360, 640, 4), dtype=np.uint8), format="bgra")
    bgra.pts, bgra.time_base = 0, Fraction(1, 90_000)
    (packet,) = encoder.encode(bgra)
    assert packet.is_keyframe and packet.size > 0


def test_the_first_bitrate_scales_with_pixels_and_rate() -> None:
    assert start_bitrate(1280, 720, 60, 500_000, 20_000_000) == 5_529_600
    assert start_bitrate(64, 64, 1, 500_000, 20_000_000) == 500_000
    assert start_bitrate(3840, 2160, 144, 500_000, 20_000_000) == 20_000_000


@pytest.mark.parametrize("mode", ["off", "fake"])
def test_after_the_bitrate_drops_no_frame_is_larger_than_the_path_carries_in_a_frame(
    mode: str,
) -> None:
    # a slow path (1 Mbit/s: 4.2 KB a frame at 30 fps) and a scene change: each frame fully new
    config = EncoderConfig(**{**CONFIG.__dict__, "gpu_index": 0 if mode == "fake" else None})
    encoder = open_encoder(mode, config)
    clip = frames(40, noisy=True)
    for frame in clip[:10]:
        encoder.encode(frame)
    encoder.set_bitrate(1_000_000)
    sizes = [
        sum(p.size for p in encoder.encode(f, keyframe=i == 20)) for i, f in enumerate(clip[10:])
    ]
    per_frame = 1_000_000 // 30 // 8
    # one frame of the rate buffer, and x264's margin on it (measured: at most 0.99 of it)
    assert max(sizes) <= per_frame * 1.25, (max(sizes), per_frame)
    assert sum(sizes) / len(sizes) <= per_frame * 1.1
