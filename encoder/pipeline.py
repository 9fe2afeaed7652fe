"""One session's capture-to-packets path: the encoder thread taking the newest captured frame,
honouring keyframe requests, bitrate and size changes, and handing packets to the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from encoder.capture import FrameSlot, Grabber
from encoder.videoencoder import Packet, VideoEncoder
from farm.errors import FarmError

log = logging.getLogger("tessera.stream")


@dataclass(frozen=True)
class EncodedFrame:
    packet: Packet
    keyframe: bool
    #: the captured frame's number in this session (gaps: frames skipped by the encoder)
    seq: int
    capture_us: int
    encode_ms: float


class Pipeline:
    """Capture thread -> one-frame slot -> encoder thread -> ``on_frame`` on the event loop.

    The encoder always takes the newest frame: when encoding falls behind, older frames are
    skipped, never queued. ``on_failed`` (on the loop) gets the reason when capture or
    encoding stops by itself.
    """

    def __init__(
        self,
        grabber: Grabber,
        slot: FrameSlot,
        make_encoder: Callable[[int, int], VideoEncoder],
        width: int,
        height: int,
        loop: asyncio.AbstractEventLoop,
        on_frame: Callable[[EncodedFrame], None],
        on_failed: Callable[[str], None],
        name: str = "session",
    ) -> None:
        self.grabber, self.slot = grabber, slot
        self.make_encoder = make_encoder
        self.encoder = make_encoder(width, height)
        self.loop = loop
        self.on_frame, self.on_failed = on_frame, on_failed
        self._keyframe = threading.Event()
        self._size: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"encode-{name}", daemon=True)
        self.encoded = 0
        self.encode_ms = 0.0

    @property
    def codec_name(self) -> str:
        return self.encoder.codec_name

    @property
    def size(self) -> tuple[int, int]:
        return self.encoder.config.width, self.encoder.config.height

    def start(self) -> None:
        self.grabber.start()
        self._thread.start()

    def request_keyframe(self) -> None:
        """The next encoded frame will be an IDR (with SPS/PPS) for every viewer."""
        self._keyframe.set()

    def set_bitrate(self, bps: int) -> None:
        self.encoder.set_bitrate(bps)

    def resize(self, width: int, height: int) -> None:
        """Encode at ``width`` x ``height`` from the next frame on (frames are scaled)."""
        self._size = (width, height)

    def stop(self) -> None:
        self._stop.set()
        self.grabber.stop()
        self.slot.close()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        try:
            self._loop()
        except FarmError as exc:
            self._fail(exc.message)
        except Exception as exc:
            log.exception("event=encode_failed")
            self._fail(f"encoder thread failed: {exc!r}")
        finally:
            self.encoder.close()

    def _fail(self, reason: str) -> None:
        if not self._stop.is_set():
            self._call(self.on_failed, reason)

    def _call(self, fn: Callable[[Any], None], arg: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed under us: the service is gone
            self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            captured = self.slot.take(timeout_s=0.5)
            if captured is None:
                if self.slot.closed:
                    self._fail(self.grabber.error or "capture stopped")
                    return
                continue
            size = self._size
            if size is not None and size != self.size:
                bitrate = self.encoder.bitrate_bps
                self.encoder.close()
                self.encoder = self.make_encoder(*size)
                self.encoder.set_bitrate(bitrate)
                log.info("event=encoder_resized size=%dx%d", *size)
            keyframe = self._keyframe.is_set()
            self._keyframe.clear()
            t0 = time.perf_counter()
            packets = self.encoder.encode(captured.frame, keyframe=keyframe)
            took_ms = (time.perf_counter() - t0) * 1000
            self.encode_ms = took_ms if self.encoded == 0 else 0.9 * self.encode_ms + 0.1 * took_ms
            self.encoded += 1
            for packet in packets:
                frame = EncodedFrame(
                    packet, bool(packet.is_keyframe), captured.seq, captured.capture_us, took_ms
                )
                self._call(self.on_frame, frame)
