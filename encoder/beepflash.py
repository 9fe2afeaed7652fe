"""A probe app for audio/video sync: once a period it turns its window white and starts a tone
at the same instant, then goes black and silent again, so that a viewer can measure how far
apart the flash (decoded video) and the beep (received sound) reach it.

The sound is a raw stream to the session's sound server (``pacat``, PULSE_SERVER) written in
10 ms chunks with a short buffer: the server takes each chunk as it plays the one before, so
the chunk holding the tone's start is written the moment the flash is drawn.

    DISPLAY=:N PULSE_SERVER=unix:... python -m encoder.beepflash [period_s]   (default 1)
"""

from __future__ import annotations

import fcntl
import math
import signal
import subprocess
import sys
import threading

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
F_SETPIPE_SZ = 1031


def sound(period_s: float, flash: threading.Event, dark: threading.Event) -> None:
    """Write the sound in 10 ms chunks (paced by the server); signal each tone's start and end."""
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
        if phase == 0:
            flash.set()
        elif phase == per_pulse:
            dark.set()
        player.stdin.write(beeps[phase] if phase < per_pulse else SILENCE)
        player.stdin.flush()
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
    flash, dark = threading.Event(), threading.Event()
    threading.Thread(target=sound, args=(period_s, flash, dark), daemon=True).start()
    size = (0, 0, screen.width_in_pixels, screen.height_in_pixels)
    while True:
        flash.wait()
        flash.clear()
        window.fill_rectangle(white, *size)
        disp.sync()
        dark.wait()
        dark.clear()
        window.fill_rectangle(black, *size)
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
