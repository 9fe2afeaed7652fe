"""The session's H.264 encoder (PyAV): h264_nvenc where it opens on the session's GPU, libx264
otherwise; keyframes on demand, bitrate changes without reopening."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypeAlias

import av
from av.codec.context import CodecContext
from av.packet import Packet as AvPacket
from av.video.codeccontext import VideoCodecContext
from av.video.frame import PictureType, VideoFrame

from encoder.avoptions import OpenOptions
from encoder.capture import TIME_BASE
from farm.errors import BadParameter, EncoderUnavailable
from farm.settings import NVENC_MODES

#: an encoded frame, as aiortc packetizes it (generic only to the type checker)
if TYPE_CHECKING:
    Packet: TypeAlias = AvPacket[Any]
else:
    Packet = AvPacket

log = logging.getLogger("tessera.stream")

#: a bitrate change smaller than this share of the current one is not applied (REMB jitters)
BITRATE_HYSTERESIS = 0.05
#: no periodic keyframes: a keyframe is sent when a viewer joins or asks (PLI/FIR); one an hour
GOP_S = 3600


@dataclass(frozen=True)
class EncoderConfig:
    width: int
    height: int
    fps: int
    bitrate_bps: int
    min_bps: int
    max_bps: int
    #: NVML index of the session's GPU; None on the CPU device
    gpu_index: int | None = None
    #: the pixel format frames arrive in (bgr0 from x11grab, yuv420p from the test pattern)
    input_format: str = "yuv420p"

    def clamp(self, bps: int) -> int:
        return max(self.min_bps, min(self.max_bps, bps))


def start_bitrate(width: int, height: int, fps: int, min_bps: int, max_bps: int) -> int:
    """A first bitrate before any receiver estimate: 0.1 bit per pixel (about 5.5 Mbit/s for
    720p60), within the bounds."""
    return max(min_bps, min(max_bps, int(width * height * fps * 0.1)))


class VideoEncoder:
    """An open H.264 encoder: one frame in, its packets out (no frames held back)."""

    #: the FFmpeg encoder this class stands for (what a session reports)
    codec_name = ""
    #: the FFmpeg encoder actually opened, where it differs (the tests' fake NVENC: libx264)
    backend = ""
    #: pixel formats the encoder takes as they are; others are converted first
    formats: tuple[str, ...] = ("yuv420p",)

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self.pix_fmt = config.input_format if config.input_format in self.formats else "yuv420p"
        self.options = self.build_options()
        self.bitrate_bps = config.clamp(config.bitrate_bps)
        self._wanted_bps = self.bitrate_bps
        self.bitrate_changes = 0
        self.keyframes = 0
        self._last_pts = -1
        self.ctx = self._open(self.backend or self.codec_name, self.options)
        self._open_options = OpenOptions.of(self.ctx)
        self._apply_bitrate(self.bitrate_bps)

    def build_options(self) -> dict[str, str]:
        raise NotImplementedError

    def _open(self, codec: str, options: dict[str, str]) -> VideoCodecContext:
        cfg = self.config
        try:
            ctx = CodecContext.create(codec, "w")
            assert isinstance(ctx, VideoCodecContext)
            ctx.width, ctx.height = cfg.width, cfg.height
            ctx.pix_fmt = self.pix_fmt
            ctx.time_base = TIME_BASE
            ctx.framerate = Fraction(cfg.fps)
            # opened at the top rate (= maxrate): x264 then runs in its constant-rate mode, the
            # one where x264_encoder_reconfig moves the bitrate; the start rate follows at once
            ctx.bit_rate = cfg.max_bps
            ctx.gop_size = cfg.fps * GOP_S
            ctx.options = options
            ctx.open()
        except (av.FFmpegError, ValueError) as exc:
            raise EncoderUnavailable(
                f"{codec} could not be opened for {cfg.width}x{cfg.height}@{cfg.fps}: {exc}",
                codec=codec,
            ) from exc
        return ctx

    def set_bitrate(self, bps: int) -> None:
        """Ask for ``bps`` (clamped to the bounds); applied at the next frame when it moved
        enough. The encoder is reconfigured in place (x264_encoder_reconfig, NVENC's
        nvEncReconfigureEncoder through FFmpeg), never rebuilt."""
        self._wanted_bps = self.config.clamp(bps)

    def _apply_bitrate(self, bps: int) -> None:
        """The new rate, its peak and a rate buffer of one frame at it: a frame larger than the
        path carries in a frame interval (a scene change, a keyframe) is not made, it is coded
        coarser. Without the open-options hook the buffer stays one frame at the top rate."""
        self.ctx.bit_rate = bps
        self.bitrate_bps = bps
        if self._open_options is None:
            return
        try:
            self._open_options.set("maxrate", bps)
            self._open_options.set("bufsize", bps // self.config.fps)
        except ValueError as exc:
            log.warning("event=encoder_options_fixed reason=%r", str(exc))
            self._open_options = None

    def encode(self, frame: VideoFrame, keyframe: bool = False) -> list[Packet]:
        wanted = self._wanted_bps
        if abs(wanted - self.bitrate_bps) > self.bitrate_bps * BITRATE_HYSTERESIS:
            self._apply_bitrate(wanted)
            self.bitrate_changes += 1
        cfg = self.config
        if frame.format.name != self.pix_fmt or (frame.width, frame.height) != (
            cfg.width,
            cfg.height,
        ):
            pts, time_base = frame.pts, frame.time_base
            frame = frame.reformat(width=cfg.width, height=cfg.height, format=self.pix_fmt)
            frame.pts, frame.time_base = pts, time_base
        # encoders refuse a pts that does not grow (two frames in one 90 kHz tick)
        pts = frame.pts if frame.pts is not None else self._last_pts + 1
        if pts <= self._last_pts:
            pts = self._last_pts + 1
        frame.pts = self._last_pts = pts
        frame.pict_type = PictureType.I if keyframe else PictureType.NONE
        try:
            packets = self.ctx.encode(frame)
        except av.FFmpegError as exc:
            raise EncoderUnavailable(f"{self.codec_name} failed to encode: {exc}") from exc
        for packet in packets:
            packet.time_base = TIME_BASE
            if packet.is_keyframe:
                self.keyframes += 1
        return packets

    def close(self) -> None:
        # frames are never held back (zerolatency / delay=0): nothing to flush
        self._open_options = None  # it holds the context too
        del self.ctx


class X264Encoder(VideoEncoder):
    codec_name = backend = "libx264"

    def build_options(self) -> dict[str, str]:
        cfg = self.config
        return {
            "preset": "ultrafast",
            "tune": "zerolatency",
            "forced-idr": "1",
            # opened at the top rate, then one frame at the current rate (_apply_bitrate)
            "maxrate": str(cfg.max_bps),
            "bufsize": str(cfg.max_bps // cfg.fps),
        }


class NvencEncoder(VideoEncoder):
    codec_name = backend = "h264_nvenc"
    formats: tuple[str, ...] = ("yuv420p", "nv12", "bgr0", "rgb0")

    def build_options(self) -> dict[str, str]:
        cfg = self.config
        options = {
            "preset": "p1",
            "tune": "ull",
            "rc": "cbr",
            "zerolatency": "1",
            # FFmpeg otherwise holds frames back in NVENC's queue
            "delay": "0",
            "bf": "0",
            "forced-idr": "1",
            "no-scenecut": "1",
            "maxrate": str(cfg.max_bps),
            "bufsize": str(cfg.max_bps // cfg.fps),
        }
        if cfg.gpu_index is not None:
            options["gpu"] = str(cfg.gpu_index)
        return options


#: FARM_NVENC modes of test doubles (``fake``: the NVENC path over libx264), each making the
#: session's encoder; only the test suite's entry point (tests/doubles.py) installs one, so a
#: production process knows auto, require and off alone
_DOUBLES: dict[str, Callable[[EncoderConfig], VideoEncoder]] = {}


def install_double(mode: str, make: Callable[[EncoderConfig], VideoEncoder]) -> None:
    """Let FARM_NVENC be ``mode``, a session's encoder being ``make(config)`` (tests only)."""
    _DOUBLES[mode] = make


def remove_double(mode: str) -> None:
    _DOUBLES.pop(mode, None)


def check_mode(mode: str) -> None:
    """BadParameter unless FARM_NVENC ``mode`` is auto, require, off or an installed double's."""
    if mode in NVENC_MODES or mode in _DOUBLES:
        return
    allowed = [*NVENC_MODES, *sorted(_DOUBLES)]
    raise BadParameter(f"FARM_NVENC {mode!r} is not one of {', '.join(allowed)}")


def open_encoder(mode: str, config: EncoderConfig) -> VideoEncoder:
    """The encoder FARM_NVENC (``mode``) picks for a session.

    ``auto``: h264_nvenc when it opens on the session's GPU, else libx264; ``require``: NVENC or
    EncoderUnavailable; ``off``: libx264 (or an installed double's mode).
    """
    check_mode(mode)
    if mode in _DOUBLES:
        return _DOUBLES[mode](config)
    if mode == "off" or (mode == "auto" and config.gpu_index is None):
        return X264Encoder(config)
    if config.gpu_index is None:
        raise EncoderUnavailable("FARM_NVENC=require but this stream service has no GPU")
    try:
        return NvencEncoder(config)
    except EncoderUnavailable as exc:
        if mode == "require":
            raise
        log.info("event=nvenc_unavailable gpu=%s reason=%r encoder=libx264", config.gpu_index,
                 exc.message)  # fmt: skip
        return X264Encoder(config)
