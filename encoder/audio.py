"""A session's sound: the PulseAudio server in its sandbox (a null sink the app plays into),
captured by the service from the sink's monitor (parec), encoded to Opus once per session and
handed, as packets, to every viewer's audio track (aiortc only packetizes them; the WebSocket
viewers send them as they are) and to the session's recording.

A packet's ``pts`` counts samples; ``AudioFeed.capture_us`` turns it into the time the app
played it on the wall clock the video's frames carry (its read time less its wait in the sound
server, which the server reports), so that a recording and the players can put sound and
picture together.

The server listens only on a unix socket in the session's X socket folder (the one folder the
service and the sandbox share); it loads no module but the native protocol and the null sink
(``-n``: no default.pa, so nothing that reaches the network or the host's sound).
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from encoder.videoencoder import Packet
from farm.lifetime import die_with_parent

log = logging.getLogger("tessera.stream")

#: the socket's name in the session's X socket folder
SOCKET_NAME = "pulse"
#: the null sink's name (its monitor is what the service records)
SINK = "app"
RATE, CHANNELS = 48000, 2
#: one Opus frame: 20 ms (10 ms frames made the browser's jitter buffer deeper here, 60 ms not 38)
FRAME_SAMPLES = RATE // 50
FRAME_BYTES = FRAME_SAMPLES * CHANNELS * 2
BITRATE_BPS = 96_000
#: encoded frames a viewer may have waiting before the oldest are dropped (a stuck viewer)
MAX_PENDING = 10
#: how long the server may take to open its socket
START_TIMEOUT_S = 10.0
FRAME_US = FRAME_SAMPLES * 1_000_000 // RATE
#: sound that arrives this much later than its samples' count says (a restarted sandbox's
#: capture, after a pause) moves the count on, so that the capture times stay true
GAP_US = 100_000
#: how often the sound server is asked how long sound waits in it (each second at first)
LEAD_PERIOD_S = 5.0
#: the lead is the least of this many readings (a stream starting reads 0.8 s once), and never
#: more than LEAD_MAX_US
LEAD_READINGS = 3
LEAD_MAX_US = 250_000

#: the sandbox's pulse server command (started by encoder/appbox.py's launcher)
SERVER = (
    "pulseaudio -n --daemonize=no --exit-idle-time=-1 --use-pid-file=no --disable-shm=yes "
    "--log-target=stderr "
    f'-L "module-native-protocol-unix socket=$PULSE_SOCKET auth-anonymous=1" '
    f'-L "module-null-sink sink_name={SINK} rate={RATE} channels={CHANNELS}" '
    f'-L "module-always-sink"'
)


def wait_for_socket(path: Path, alive: subprocess.Popen[bytes]) -> None:
    """Return once the server at ``path`` accepts a connection (the app may then play)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if alive.poll() is not None:
            raise OSError("the session's sandbox exited before its sound server started")
        with socket.socket(socket.AF_UNIX) as sock:
            try:
                sock.connect(str(path))
                return
            except (FileNotFoundError, ConnectionRefusedError):
                pass
        # the server is starting in another process: nothing to wait on but its socket
        time.sleep(0.02)
    raise OSError(f"the session's sound server did not open {path} in {START_TIMEOUT_S:g} s")


class AudioTrack(MediaStreamTrack):
    """One viewer's audio track: ``recv`` returns the session's Opus packets."""

    kind = "audio"

    def __init__(self, clock: Callable[[int | None], int], lead: Callable[[], int]) -> None:
        super().__init__()
        #: a packet's capture time (µs since the epoch) from its pts
        self.capture_us = clock
        #: how long the sound waited in the sound server before its capture (µs)
        self.lead_us = lead
        self._pending: deque[Packet] = deque()
        self._ready = asyncio.Event()
        self.sent = 0
        self.dropped = 0

    def push(self, packet: Packet) -> None:
        if self.readyState != "live":
            return
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(packet)
        self._ready.set()

    async def recv(self) -> Packet:
        while not self._pending:
            if self.readyState != "live":
                raise MediaStreamError
            self._ready.clear()
            await self._ready.wait()
        self.sent += 1
        return self._pending.popleft()

    def stop(self) -> None:
        super().stop()
        self._ready.set()


class AudioFeed:
    """The session's sound for its viewers: one Opus encoder, one track per viewer; it lives
    as long as the session (a restarted sandbox's capture feeds the same one)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tracks: weakref.WeakSet[AudioTrack] = weakref.WeakSet()
        self._codec = av.CodecContext.create("libopus", "w")
        self._codec.sample_rate = RATE
        self._codec.layout = "stereo"
        self._codec.format = av.AudioFormat("s16")
        self._codec.bit_rate = BITRATE_BPS
        self._codec.time_base = fractions.Fraction(1, RATE)
        self._codec.options = {"application": "lowdelay", "frame_duration": "20"}
        self._samples = 0
        #: the capture time of sample 0 (µs since the epoch), set by the first frame
        self._base_us: int | None = None
        self._lock = threading.Lock()
        self.frames_in = 0
        #: how long sound the app plays waits in the sound server before the capture reads it
        #: (the app's stream buffer, the sink, the capture's own buffer; µs, from the server)
        self.lead_us = 0
        #: called on the loop with each batch of packets besides the tracks (the recording)
        self.on_packets: Callable[[list[Packet]], None] | None = None

    @property
    def extradata(self) -> bytes | None:
        """The encoder's OpusHead, which a container's Opus track needs."""
        return self._codec.extradata

    def track(self) -> AudioTrack:
        track = AudioTrack(self.capture_us, lambda: self.lead_us)
        self._tracks.add(track)
        return track

    def capture_us(self, pts: int | None) -> int:
        """When the app played the first sample of the packet with ``pts`` (µs since the
        epoch): its read time less the time it waited in the sound server."""
        return self._read_us(pts or 0) - self.lead_us

    def _read_us(self, samples: int) -> int:
        """When the sample counted ``samples`` was read from the server."""
        return (self._base_us or 0) + samples * 1_000_000 // RATE

    def push_pcm(self, pcm: bytes) -> None:
        """20 ms of s16le stereo at 48 kHz (from the capture's thread)."""
        frame = av.AudioFrame(format="s16", layout="stereo", samples=FRAME_SAMPLES)
        frame.planes[0].update(pcm)
        frame.sample_rate = RATE
        frame.time_base = fractions.Fraction(1, RATE)
        # the frame's last sample has just been read: its first is one frame old
        start_us = time.time_ns() // 1000 - FRAME_US
        with self._lock:
            if self._base_us is None:
                self._base_us = start_us
            elif start_us - self._read_us(self._samples) > GAP_US:
                self._samples = (start_us - self._base_us) * RATE // 1_000_000
            frame.pts = self._samples
            self._samples += FRAME_SAMPLES
            self.frames_in += 1
            packets = self._codec.encode(frame)
        if packets:
            with contextlib.suppress(RuntimeError):  # the loop closed: the session is gone
                self._loop.call_soon_threadsafe(self._deliver, packets)

    def _deliver(self, packets: list[Packet]) -> None:
        for track in list(self._tracks):
            for packet in packets:
                track.push(packet)
        if self.on_packets is not None:
            self.on_packets(packets)


class PulseCapture:
    """parec recording the sandbox's null sink monitor into an AudioFeed, on its own thread."""

    def __init__(self, socket_path: Path, feed: AudioFeed) -> None:
        self.feed = feed
        self.proc = subprocess.Popen(
            [
                "parec", f"--server=unix:{socket_path}", f"--device={SINK}.monitor", "--raw",
                "--format=s16le", f"--rate={RATE}", f"--channels={CHANNELS}",
                "--latency-msec=5", "--process-time-msec=2",
            ],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="audio-capture", daemon=True)
        self._thread.start()
        self._socket_path = socket_path
        self._stopped = threading.Event()
        self._watch = threading.Thread(target=self._watch_lead, name="audio-lead", daemon=True)
        self._watch.start()

    def _watch_lead(self) -> None:
        """Keep the feed's lead current: the server's own figures for the streams in it."""
        readings: deque[int] = deque(maxlen=LEAD_READINGS)
        while not self._stopped.wait(1.0 if len(readings) < LEAD_READINGS else LEAD_PERIOD_S):
            try:
                readings.append(server_lead_us(self._socket_path))
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("event=audio_lead_unknown error=%r", exc)
                return
            if len(readings) == LEAD_READINGS:
                self.feed.lead_us = min(min(readings), LEAD_MAX_US)

    def _run(self) -> None:
        assert self.proc.stdout is not None
        out, buf = self.proc.stdout, bytearray()
        while True:
            chunk = os.read(out.fileno(), FRAME_BYTES * 4)
            if not chunk:
                break
            buf += chunk
            while len(buf) >= FRAME_BYTES:
                self.feed.push_pcm(bytes(buf[:FRAME_BYTES]))
                del buf[:FRAME_BYTES]
        log.info("event=audio_capture_ended code=%s", self.proc.poll())

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self._thread.join(5)
        self._watch.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def server_lead_us(socket_path: Path) -> int:
    """How long sound waits in the session's sound server (µs): the longest app stream's
    buffer and sink latency, plus the capture's own (pactl's figures)."""
    return sum(
        max(stream_latencies_us(_pactl(socket_path, kind)), default=0)
        for kind in ("sink-inputs", "source-outputs")
    )


def _pactl(socket_path: Path, kind: str) -> str:
    done = subprocess.run(
        ["pactl", f"--server=unix:{socket_path}", "list", kind],
        capture_output=True, text=True, timeout=5, check=True,
        env={**os.environ, "LC_ALL": "C"},
    )  # fmt: skip
    return done.stdout


def stream_latencies_us(listing: str) -> list[int]:
    """Each stream's latency in a ``pactl list sink-inputs`` (or ``source-outputs``) listing:
    its buffer's and its sink's (or source's), µs."""
    streams: list[int] = []
    for line in listing.splitlines():
        if line.startswith(("Sink Input #", "Source Output #")):
            streams.append(0)
        elif streams and line.strip().startswith(
            ("Buffer Latency:", "Sink Latency:", "Source Latency:")
        ):
            value = line.split(":", 1)[1].split()
            if value and value[0].isdigit():
                streams[-1] += int(value[0])
    return streams
