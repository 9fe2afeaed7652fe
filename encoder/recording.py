"""A session's recording: the packets the session already encoded, muxed into an MP4 (PyAV,
no second encode), stored in the farm's storage under the session's project. A session with
sound records it too (its Opus packets, an MP4 Opus track), each packet placed by its capture
time on the video's clock."""

from __future__ import annotations

import logging
import re
from fractions import Fraction
from pathlib import Path

import av

from encoder.audio import RATE
from encoder.capture import TIME_BASE, capture_us_of
from encoder.videoencoder import Packet
from farm.errors import FarmError, SourceFailed
from farm.storage.base import Storage

log = logging.getLogger("tessera.stream")

#: the sound's clock: Opus at 48 kHz
AUDIO_TIME_BASE = Fraction(1, RATE)
#: H.264 Annex B start codes before each NAL unit
_START = re.compile(b"\x00\x00\x01")
#: NAL unit types of the parameter sets (SPS, PPS) an MP4 keeps in its header
_PARAMETER_SETS = (7, 8)


def recording_key(project: str, session_id: str) -> str:
    """Where a session's recording is stored: under its project's prefix."""
    return f"projects/{project or '_'}/recordings/{session_id}.mp4"


def parameter_sets(data: bytes) -> bytes:
    """The SPS and PPS NAL units of an Annex B keyframe, with their start codes."""
    found = []
    starts = [m.end() for m in _START.finditer(data)]
    for i, at in enumerate(starts):
        end = starts[i + 1] - 3 if i + 1 < len(starts) else len(data)
        nal = data[at:end].rstrip(b"\x00")
        if nal and nal[0] & 0x1F in _PARAMETER_SETS:
            found.append(b"\x00\x00\x00\x01" + nal)
    return b"".join(found)


class Recording:
    """An MP4 being written at ``path``; it starts at the next keyframe. ``opus_head``: the
    session's sound encoder's header, when the session has sound (an Opus track is added)."""

    def __init__(
        self, path: Path, width: int, height: int, fps: int, opus_head: bytes | None = None
    ) -> None:
        self.path, self.width, self.height, self.fps = path, width, height, fps
        self.opus_head = opus_head
        self.frames = 0
        self.sound_packets = 0
        self._audio: av.audio.stream.AudioStream | None = None
        self._last_audio_pts = -1
        self.size: tuple[int, int] | None = None
        self._out: av.container.OutputContainer | None = None
        self._stream: av.video.stream.VideoStream | None = None
        self._first_pts = 0
        self._last_pts = -1
        self.closed = False

    def write(self, packet: Packet, keyframe: bool, size: tuple[int, int]) -> None:
        """Add one encoded frame (ignored until the first keyframe, and after a size change:
        an MP4 track has one size)."""
        if self.closed or (self._out is None and not keyframe):
            return
        if self._out is None:
            self._open(bytes(packet), size)
            self._first_pts = packet.pts or 0
        elif size != self.size:
            return
        assert self._out is not None and self._stream is not None
        pts = (packet.pts or 0) - self._first_pts
        pts = max(pts, self._last_pts + 1)
        self._last_pts = pts
        out = av.Packet(bytes(packet))
        out.pts = out.dts = pts
        out.time_base = TIME_BASE
        out.stream = self._stream
        if keyframe:
            out.is_keyframe = True
        if self._mux(out):
            self.frames += 1

    def write_sound(self, packet: Packet, capture_us: int) -> None:
        """Add one Opus packet captured at ``capture_us`` (µs since the epoch); sound from
        before the recording's first frame is left out."""
        if self.closed or self._out is None or self._audio is None:
            return
        pts = (capture_us - capture_us_of(self._first_pts)) * RATE // 1_000_000
        if pts < 0 or pts <= self._last_audio_pts:
            return
        self._last_audio_pts = pts
        out = av.Packet(bytes(packet))
        out.pts = out.dts = pts
        out.duration = packet.duration
        out.time_base = AUDIO_TIME_BASE
        out.stream = self._audio
        if self._mux(out):
            self.sound_packets += 1

    def _mux(self, packet: Packet) -> bool:
        assert self._out is not None
        try:
            self._out.mux(packet)
        except av.FFmpegError as exc:
            log.warning("event=recording_failed path=%s error=%r", self.path, exc)
            self.close()
            return False
        return True

    def _open(self, keyframe: bytes, size: tuple[int, int]) -> None:
        self.size = size
        out = av.open(str(self.path), "w", format="mp4")
        stream = out.add_stream("h264", rate=self.fps)
        stream.width, stream.height = size
        stream.time_base = TIME_BASE
        stream.codec_context.extradata = parameter_sets(keyframe)
        if self.opus_head is not None:
            sound = out.add_stream("libopus", rate=RATE, layout="stereo")
            sound.time_base = AUDIO_TIME_BASE
            sound.codec_context.extradata = self.opus_head
            self._audio = sound
        self._out, self._stream = out, stream

    def close(self) -> None:
        """Finish the file (its index is written now)."""
        if self.closed:
            return
        self.closed = True
        if self._out is not None:
            try:
                self._out.close()
            except av.FFmpegError as exc:
                log.warning("event=recording_failed path=%s error=%r", self.path, exc)

    def store(self, storage: Storage, key: str) -> str | None:
        """Close and put the file under ``key``; the key, or None when nothing was recorded."""
        self.close()
        if self.frames == 0 or not self.path.exists():
            return None
        try:
            storage.put(key, self.path)
        except FarmError:
            raise
        except OSError as exc:
            raise SourceFailed(f"the recording could not be stored: {exc}") from exc
        finally:
            self.path.unlink(missing_ok=True)
        return key
