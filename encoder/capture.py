"""Frames into a session: x11grab of its display (when the app draws, via XDamage) or the test
pattern, each on its own thread, into a one-frame slot where the latest frame wins."""

from __future__ import annotations

import logging
import math
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import av
from av.video.frame import VideoFrame
from Xlib import display as xdisplay
from Xlib import error as xerror
from Xlib.ext import damage

from encoder.testpattern import Scene

log = logging.getLogger("tessera.stream")

#: RTP's video clock: frames carry their capture time as pts in this time base
TIME_BASE = Fraction(1, 90_000)


def capture_us_of(pts: int) -> int:
    """The capture time (microseconds since the epoch) a frame's pts stands for."""
    return pts * 100 // 9


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


class DamageWatch:
    """XDamage on a display's root window: ``wait`` returns as soon as anything was drawn since
    the previous call (one DamageNotify per non-empty region; the region is then emptied)."""

    def __init__(self, display_name: str) -> None:
        self.disp = xdisplay.Display(display_name)
        try:
            if not self.disp.has_extension(damage.extname):
                raise xerror.DisplayError(f"{display_name} has no {damage.extname} extension")
            self.disp.damage_query_version()
            self.damage = self.disp.screen().root.damage_create(damage.DamageReportNonEmpty)
            self.disp.sync()
        except BaseException:
            self.disp.close()
            raise
        self._notify = self.disp.extension_event.DamageNotify

    def wait(self, timeout_s: float) -> bool:
        """True when something was drawn (now or within ``timeout_s``), False at the time-out."""
        deadline = time.monotonic() + timeout_s
        while True:
            drawn = False
            while self.disp.pending_events():
                if self.disp.next_event().type == self._notify:
                    drawn = True
            if drawn:
                # empty the region: the next drawing sends the next notify
                self.disp.damage_subtract(self.damage)
                self.disp.flush()
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            readable, _, _ = select.select([self.disp.fileno()], [], [], remaining)
            if not readable:
                return False

    def close(self) -> None:
        self.disp.close()


class GrabPace:
    """When a grab on damage may follow the previous ones: never two closer than ``MIN_GAP``
    frame intervals, and over time no faster than the session's rate: a virtual frame clock
    that grabs may run up to ``TOLERANCE`` intervals ahead of (the generic cell rate
    algorithm), so an app drawing faster than the session is grabbed at the session's rate.

    An app drawing at the session's rate is grabbed as it draws. A grab that comes late (the
    capture thread held up) moves the clock with it. With a tolerance of half a frame (this
    class's predecessor), a grab late by more than that held every later frame of an app
    drawing at exactly the session's rate by the excess, for the rest of the session (one
    run's median 8 ms above another's). Lateness up to a frame now leaves the clock within two
    frames of the app's next drawing; a grab later than that shows a later drawing, which
    moves the drawing it waits for as well.
    """

    MIN_GAP = 0.5
    TOLERANCE = 2.0

    def __init__(self, fps: float) -> None:
        self.interval_s = 1.0 / fps
        #: when the next grab would be due were grabs exactly at the session's rate
        self._due_s = -math.inf
        #: when the last grab was (monotonic s)
        self.last_s = -math.inf

    def hold_s(self, now_s: float) -> float:
        """How long a grab asked for at ``now_s`` waits (0: none)."""
        earliest = max(
            self.last_s + self.MIN_GAP * self.interval_s,
            self._due_s - self.TOLERANCE * self.interval_s,
        )
        return max(0.0, earliest - now_s)

    def grabbed(self, now_s: float) -> None:
        self._due_s = max(self._due_s, now_s) + self.interval_s
        self.last_s = now_s


class X11Grabber(Grabber):
    """PyAV's x11grab of a whole display: grabbed the moment the app draws (XDamage), within
    the session's rate (``GrabPace``), and at ``fps`` while nothing is drawn (a still screen
    keeps its frame rate). Without XDamage, x11grab polls at ``fps``."""

    #: after a frame grabbed on damage, the next still-screen refresh waits this many frame
    #: intervals: an app drawing at the session's rate keeps the grabs in its phase instead of
    #: racing a refresh that would land just before its drawing (and push it half a frame back)
    REPHASE = 1.5

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
        #: frames grabbed because the app drew (the rest are still-screen refreshes)
        self.damage_grabs = 0
        #: "damage" or "poll", once running
        self.mode = ""
        self._pace = GrabPace(fps)
        #: the last grab followed a drawing
        self._rephase = False

    def run(self) -> None:
        if self.before is not None:
            self.before()
        try:
            watch: DamageWatch | None = DamageWatch(self.display)
        except (xerror.DisplayError, xerror.XError, OSError) as exc:
            log.warning("event=damage_unavailable display=%s reason=%r capture=poll",
                        self.display, str(exc))  # fmt: skip
            watch = None
        try:
            self.mode = "damage" if watch is not None else "poll"
            # on damage x11grab must grab at once: its own clock (framerate) would otherwise
            # hold each read to the next tick of it; at 1000 it never holds one more than 1 ms
            rate = 1000 if watch is not None else self.fps
            options = {
                "framerate": str(rate),
                "video_size": f"{self.width}x{self.height}",
                # the X cursor stays out of the video: the player shows the viewer's own
                # pointer, and a drawn one would lag it by the whole round trip (issue #18)
                "draw_mouse": "0",
                # the frames read while probing the stream are served first: stale ones
                "probesize": "32",
            }
            with av.open(self.display, format="x11grab", options=options) as container:
                stream = container.streams.video[0]
                packets = container.demux(stream)
                while not self.stopping:
                    if watch is not None:
                        self._wait_for_frame(watch)
                        if self.stopping:
                            return
                    packet = next(packets)
                    for frame in packet.decode():
                        assert isinstance(frame, VideoFrame)
                        self.frames += 1
                        self.slot.put(frame, time.time_ns() // 1000)
        finally:
            if watch is not None:
                watch.close()

    def _wait_for_frame(self, watch: DamageWatch) -> None:
        """Until the app draws (then as the pace allows) or the still screen's refresh is due."""
        pace = self._pace
        due_s = pace.last_s + pace.interval_s * (self.REPHASE if self._rephase else 1.0)
        drawn = watch.wait(max(0.0, due_s - time.monotonic()))
        if drawn:
            self.damage_grabs += 1
            hold_s = pace.hold_s(time.monotonic())
            if hold_s > 0:
                self._stop.wait(hold_s)
        self._rephase = drawn
        pace.grabbed(time.monotonic())


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
