"""Frames into a session: x11grab of its display or the test pattern, each on its own thread,
into a one-frame slot where the latest frame wins."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import av
from av.video.frame import VideoFrame

from encoder.testpattern import Scene

log = logging.getLogger("tessera.stream")

#: RTP's video clock: frames carry their capture time as pts in this time base
TIME_BASE = Fraction(1, 90_000)


@dataclass(frozen=True)
class Captured:
    frame: VideoFrame
    seq: int
    capture_us: int


class FrameSlot:
    """Holds only the newest frame: a consumer that falls behind skips frames, never queues."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._latest: Captured | None = None
        self._taken = True
        self._seq = 0
        self.closed = False
        #: frames replaced before anyone took them
        self.skipped = 0

    def put(self, frame: VideoFrame, capture_us: int) -> None:
        with self._cond:
            if not self._taken:
                self.skipped += 1
            self._seq += 1
            frame.pts = capture_us * 9 // 100
            frame.time_base = TIME_BASE
            self._latest = Captured(frame, self._seq, capture_us)
            self._taken = False
            self._cond.notify_all()

    def take(self, timeout_s: float) -> Captured | None:
        """The newest frame not yet taken, waiting up to ``timeout_s``; None on time-out/close."""
        with self._cond:
            if self._taken and not self.closed:
                self._cond.wait(timeout_s)
            if self._taken or self._latest is None:
                return None
            self._taken = True
            return self._latest

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class Grabber:
    """A thread putting frames into a slot until stopped; ``error`` says why it stopped early."""

    def __init__(self, slot: FrameSlot, name: str) -> None:
        self.slot = slot
        self.error: str | None = None
        self.frames = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _guarded(self) -> None:
        try:
            self.run()
        except Exception as exc:
            if not self._stop.is_set():
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "event=capture_failed thread=%s error=%r", self._thread.name, self.error
                )
        finally:
            self.slot.close()

    def run(self) -> None:
        raise NotImplementedError


class X11Grabber(Grabber):
    """PyAV's x11grab of a whole display at ``fps`` (FFmpeg paces the reads)."""

    def __init__(
        self,
        slot: FrameSlot,
        display: str,
        width: int,
        height: int,
        fps: int,
        before: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(slot, f"x11grab{display}")
        self.display, self.width, self.height, self.fps = display, width, height, fps
        #: run on the capture thread before the display is opened (a sandboxed display's
        #: IPC namespace is joined there, so x11grab's MIT-SHM segments reach its Xvfb)
        self.before = before

    def run(self) -> None:
        if self.before is not None:
            self.before()
        options = {
            "framerate": str(self.fps),
            "video_size": f"{self.width}x{self.height}",
            "draw_mouse": "1",
        }
        with av.open(self.display, format="x11grab", options=options) as container:
            stream = container.streams.video[0]
            for packet in container.demux(stream):
                if self.stopping:
                    return
                for frame in packet.decode():
                    assert isinstance(frame, VideoFrame)
                    self.frames += 1
                    self.slot.put(frame, time.time_ns() // 1000)


class PatternGrabber(Grabber):
    """The test pattern at ``fps``: each frame stamped with its number and capture time."""

    def __init__(self, slot: FrameSlot, width: int, height: int, fps: int) -> None:
        super().__init__(slot, "testpattern")
        self.scene = Scene(width, height)
        self.interval_s = 1.0 / fps

    def run(self) -> None:
        next_s = time.monotonic()
        counter = 0
        while not self.stopping:
            capture_us = time.time_ns() // 1000
            planes = self.scene.yuv420p(counter, capture_us)
            frame = VideoFrame.from_ndarray(planes, format="yuv420p")
            self.frames += 1
            self.slot.put(frame, capture_us)
            counter += 1
            next_s += self.interval_s
            # a frame clock, not a synchronisation: wait for the next frame's time (or a stop)
            delay = next_s - time.monotonic()
            if delay < -self.interval_s:
                next_s = time.monotonic()  # fell behind: skip ahead instead of bursting
            elif delay > 0:
                self._stop.wait(delay)
