"""A probe app for audio/video sync: once a period it turns its window white and starts a tone
at the same instant, then goes black and silent again, so that a viewer can measure how far
apart the flash (decoded video) and the beep (received sound) reach it.

The sound is a raw stream to the session's sound server (``pacat``, PULSE_SERVER) written in
10 ms chunks with a short buffer: the server takes each chunk as it plays the one before. The
chunk holding the tone's start still waits behind what the pipe to ``pacat`` holds (up to a
page, 21 ms), which the sound server cannot see; the app draws each flash when that wait is
over, as a game times its picture to its own sound, so that the two leave the app together.

    DISPLAY=:N PULSE_SERVER=unix:... python -m encoder.beepflash [period_s]   (default 1)
"""

from __future__ import annotations

import fcntl
import math
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

from Xlib import X, display, error

RATE = 48000
CHUNK_S = 0.01
CHUNK_SAMPLES = int(RATE * CHUNK_S)
TONE_HZ = 1000.0
#: how long each flash and beep lasts
PULSE_S = 0.1


def tone(samples: int, start: int) -> bytes:
    """``samples`` stereo s16le samples of the tone from sample ``start`` (loud, not clipped)."""
    out = bytearray()
    for i in range(start, start + samples):
        value = int(20000 * math.sin(2 * math.pi * TONE_HZ * i / RATE)).to_bytes(
            2, "little", signed=True
        )
        out += value + value
    return bytes(out)


SILENCE = bytes(CHUNK_SAMPLES * 4)
BYTES_PER_S = RATE * 4
F_SETPIPE_SZ = 1031


class Cue(threading.Event):
    """An event set with the moment (time.monotonic) its picture is due."""

    at = 0.0

    def cue(self, at: float) -> None:
        self.at = at
        self.set()


def queued_s(fd: int) -> float:
    """Seconds of sound waiting in the pipe ``fd`` writes to."""
    return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]) / BYTES_PER_S


def sound(period_s: float, flash: Cue, dark: Cue) -> None:
    """Write the sound in 10 ms chunks (paced by the server); cue each tone's start and end
    for when they leave the pipe."""
    player = subprocess.Popen(
        ["pacat", "--raw", "--format=s16le", f"--rate={RATE}", "--channels=2",
         "--latency-msec=10", "--process-time-msec=2"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert player.stdin is not None
    # the pipe holds one page (21 ms), not 64 KiB (340 ms) of sound waiting to be played
    fcntl.fcntl(player.stdin.fileno(), F_SETPIPE_SZ, 4096)
    per_period = round(period_s / CHUNK_S)
    per_pulse = round(PULSE_S / CHUNK_S)
    beeps = [tone(CHUNK_SAMPLES, k * CHUNK_SAMPLES) for k in range(per_pulse)]
    chunk = 0
    while True:
        phase = chunk % per_period
        data = beeps[phase] if phase < per_pulse else SILENCE
        player.stdin.write(data)
        player.stdin.flush()
        if phase in (0, per_pulse):
            # the chunk just written plays once what is ahead of it in the pipe has
            ahead_s = queued_s(player.stdin.fileno()) - len(data) / BYTES_PER_S
            (flash if phase == 0 else dark).cue(time.monotonic() + max(0.0, ahead_s))
        chunk += 1


def run(disp: display.Display, period_s: float) -> None:
    screen = disp.screen()
    window = screen.root.create_window(
        0, 0, screen.width_in_pixels, screen.height_in_pixels, 0, screen.root_depth,
        X.InputOutput, X.CopyFromParent, background_pixel=screen.black_pixel,
        override_redirect=True,
    )  # fmt: skip
    window.map()
    disp.sync()
    white = window.create_gc(foreground=screen.white_pixel)
    black = window.create_gc(foreground=screen.black_pixel)
    flash, dark = Cue(), Cue()
    threading.Thread(target=sound, args=(period_s, flash, dark), daemon=True).start()
    size = (0, 0, screen.width_in_pixels, screen.height_in_pixels)
    while True:
        for cue, gc in ((flash, white), (dark, black)):
            cue.wait()
            cue.clear()
            time.sleep(max(0.0, cue.at - time.monotonic()))
            window.fill_rectangle(gc, *size)
            disp.sync()


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    period_s = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    try:
        run(display.Display(), period_s)
    except (error.ConnectionClosedError, error.DisplayError):
        return 0  # the session's display went away: so does the app
    return 0


if __name__ == "__main__":
    sys.exit(main())
