"""Gamepads: the browser's standard-mapping Gamepad state turned into Linux input events of a
virtual controller, which the session's app reads like a plugged-in pad.

Two controllers, chosen at run time by ``open_pad``:

- ``UinputPad``, where /dev/uinput opens: the kernel makes the controller's device nodes on the
  host (``eventN``, ``jsN``); a sandboxed app sees only its session's ``/dev/input``
  (encoder/appbox.py), so ``expose`` makes the same nodes there, owned by the sandbox's uid
  (which needs the service to be root: mknod).
- ``SocketPad``, where it does not (a VM, a container or a Kubernetes pod without the device, a
  service that is not root), for a sandboxed app: a unix socket where each node would be, in
  the session's ``/dev/input``, and the app loads the pad shim (encoder/padshim/padshim.c,
  LD_PRELOAD), which opens those sockets as the nodes and answers the joystick and evdev
  queries. The app reads the same events, codes and ranges from either, through the joystick
  API (``jsN``: ``struct js_event``) or evdev (``eventN``: ``struct input_event``).

Where neither can be made (no uinput, no sandbox or no shim built), ``open_pad`` says so and
the session keeps only the last state its viewer sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tessera.stream")

UINPUT = Path("/dev/uinput")
#: the most pads one session drives (the Gamepad API's index 0-3)
MAX_PADS = 4

# linux/input-event-codes.h
EV_SYN, EV_KEY, EV_ABS = 0x00, 0x01, 0x03
SYN_REPORT = 0
ABS_X, ABS_Y, ABS_Z, ABS_RX, ABS_RY, ABS_RZ = 0x00, 0x01, 0x02, 0x03, 0x04, 0x05
ABS_HAT0X, ABS_HAT0Y = 0x10, 0x11
BTN_SOUTH, BTN_EAST, BTN_NORTH, BTN_WEST = 0x130, 0x131, 0x133, 0x134
BTN_TL, BTN_TR, BTN_SELECT, BTN_START, BTN_MODE = 0x136, 0x137, 0x13A, 0x13B, 0x13C
BTN_THUMBL, BTN_THUMBR = 0x13D, 0x13E

#: standard-mapping button index -> evdev key (6, 7 are the analogue triggers: axes; 12-15
#: the d-pad: the hat)
BUTTONS = {
    0: BTN_SOUTH, 1: BTN_EAST, 2: BTN_WEST, 3: BTN_NORTH, 4: BTN_TL, 5: BTN_TR,
    8: BTN_SELECT, 9: BTN_START, 10: BTN_THUMBL, 11: BTN_THUMBR, 16: BTN_MODE,
}  # fmt: skip
#: standard-mapping axis index -> evdev axis (sticks, -1..1)
STICKS = {0: ABS_X, 1: ABS_Y, 2: ABS_RX, 3: ABS_RY}
#: trigger buttons (0..1) -> evdev axis
TRIGGERS = {6: ABS_Z, 7: ABS_RZ}
STICK_MAX, TRIGGER_MAX = 32767, 255

# linux/uinput.h ioctls
UI_DEV_CREATE, UI_DEV_DESTROY = 0x5501, 0x5502
UI_DEV_SETUP, UI_ABS_SETUP = 0x405C5503, 0x401C5504
UI_SET_EVBIT, UI_SET_KEYBIT, UI_SET_ABSBIT = 0x40045564, 0x40045565, 0x40045567
BUS_VIRTUAL = 0x06
#: the controller's input_id: bus, vendor, product (an Xbox 360 pad's: SDL maps it as one),
#: version; the pad shim (padshim/padshim.c) reports the same
PAD_ID = (BUS_VIRTUAL, 0x045E, 0x028E, 1)
#: UI_GET_SYSNAME(len): the device's name under /sys/devices/virtual/input ("input17")
SYSNAME_LEN = 64
UI_GET_SYSNAME = 0x80000000 | (SYSNAME_LEN << 16) | (ord("U") << 8) | 44
#: where the kernel lists a virtual input device's nodes
VIRTUAL_INPUT = Path("/sys/devices/virtual/input")
#: the nodes an app reads a pad through: evdev, and the older joystick API
NODE_PREFIXES = ("event", "js")

#: the pad shim an app loads to read a ``SocketPad`` (built by .ci/setup and the image)
SHIM = Path(__file__).with_name("padshim") / "padshim.so"
# linux/joystick.h: struct js_event (time in ms, value, type, number) and its types
JS_EVENT = struct.Struct("@IhBB")
JS_EVENT_BUTTON, JS_EVENT_AXIS, JS_EVENT_INIT = 0x01, 0x02, 0x80
#: struct input_event: timeval (two longs), type, code, value
INPUT_EVENT = struct.Struct("@llHHi")
#: the connections one pad's node keeps (an app opens a node once or twice)
MAX_READERS = 8
#: the events a connection may have waiting before it is dropped (an app that stopped reading)
MAX_PENDING_BYTES = 64 * 1024


def expose_nodes(device: Path, folder: Path, uid: int, gid: int) -> list[Path]:
    """Make the device nodes of the input device at ``device`` (its sysfs folder) in
    ``folder``, owned by ``uid``:``gid``, mode 0600; the nodes made. Each node's number is the
    kernel's own (``<node>/dev``: "major:minor"); a name already there is replaced."""
    made = []
    for entry in sorted(device.iterdir()):
        if not entry.name.startswith(NODE_PREFIXES) or not (entry / "dev").is_file():
            continue
        major, minor = (int(v) for v in (entry / "dev").read_text().strip().split(":"))
        node = folder / entry.name
        node.unlink(missing_ok=True)
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(major, minor))
        os.chown(node, uid, gid, follow_symlinks=False)
        made.append(node)
    return made


@dataclass(frozen=True)
class PadState:
    """One pad as the browser reports it: buttons 0..1, axes -1..1 (standard mapping)."""

    buttons: tuple[float, ...]
    axes: tuple[float, ...]

    @classmethod
    def parse(cls, message: dict[str, Any]) -> PadState:
        """From a ``gp`` message; ValueError/TypeError where it is not one."""
        buttons, axes = message["b"], message["a"]
        if not isinstance(buttons, list) or not isinstance(axes, list):
            raise TypeError("gamepad buttons and axes must be lists")
        if len(buttons) > 32 or len(axes) > 16:
            raise ValueError("too many gamepad buttons or axes")
        return cls(
            tuple(min(1.0, max(0.0, float(v))) for v in buttons),
            tuple(min(1.0, max(-1.0, float(v))) for v in axes),
        )


def events(state: PadState) -> list[tuple[int, int, int]]:
    """Every (type, code, value) of ``state``: the whole pad, so a lost update heals."""
    out: list[tuple[int, int, int]] = []
    b = state.buttons

    def button(index: int) -> float:
        return b[index] if index < len(b) else 0.0

    for index, code in BUTTONS.items():
        out.append((EV_KEY, code, int(button(index) >= 0.5)))
    for index, code in TRIGGERS.items():
        out.append((EV_ABS, code, round(button(index) * TRIGGER_MAX)))
    for index, code in STICKS.items():
        value = state.axes[index] if index < len(state.axes) else 0.0
        out.append((EV_ABS, code, round(value * STICK_MAX)))
    out.append((EV_ABS, ABS_HAT0X, int(button(15) >= 0.5) - int(button(14) >= 0.5)))
    out.append((EV_ABS, ABS_HAT0Y, int(button(13) >= 0.5) - int(button(12) >= 0.5)))
    out.append((EV_SYN, SYN_REPORT, 0))
    return out


#: each evdev axis of the controller and its (min, max)
AXIS_RANGES = (
    {code: (-STICK_MAX, STICK_MAX) for code in STICKS.values()}
    | {code: (0, TRIGGER_MAX) for code in TRIGGERS.values()}
    | {ABS_HAT0X: (-1, 1), ABS_HAT0Y: (-1, 1)}
)
#: (evdev type, code) -> (joystick API type, number): the kernel's joystick driver numbers a
#: controller's buttons and axes in the order of their evdev codes
JS_NUMBERS = {
    **{(EV_KEY, code): (JS_EVENT_BUTTON, n) for n, code in enumerate(sorted(BUTTONS.values()))},
    **{(EV_ABS, code): (JS_EVENT_AXIS, n) for n, code in enumerate(sorted(AXIS_RANGES))},
}


def js_events(state: PadState) -> list[tuple[int, int, int]]:
    """Every (type, number, value) of ``state`` as the kernel's joystick driver reports a
    uinput controller's: axis values scaled from their range to -32767..32767."""
    out = []
    for kind, code, value in events(state):
        if kind == EV_KEY:
            out.append((*JS_NUMBERS[kind, code], value))
        elif kind == EV_ABS:
            low, high = AXIS_RANGES[code]
            scaled = round((value - low) * 2 * STICK_MAX / (high - low)) - STICK_MAX
            out.append((*JS_NUMBERS[kind, code], scaled))
    return out


class JsReader:
    """A pad as an app reads it through the joystick API (``/dev/input/jsN``, ``struct
    js_event``), from uinput's controller or the pad shim's: the latest value of each button
    and axis, by number. The built-in game and the test's probe app read pads with it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buttons: dict[int, int] = {}
        self.axes: dict[int, int] = {}
        self._rest = b""

    @classmethod
    def open(cls, path: Path, blocking: bool = False) -> JsReader | None:
        """The pad at ``path``, or None where none is plugged in."""
        try:
            return cls(os.open(path, os.O_RDONLY | (0 if blocking else os.O_NONBLOCK)))
        except OSError:
            return None

    def read(self) -> bool:
        """Take what the pad sent (waiting for it where opened blocking); False when the pad
        is gone (unplugged)."""
        try:
            data = os.read(self.fd, JS_EVENT.size * 64)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self._rest += data
        whole = len(self._rest) - len(self._rest) % JS_EVENT.size
        for _, value, kind, number in JS_EVENT.iter_unpack(self._rest[:whole]):
            (self.buttons if kind & JS_EVENT_BUTTON else self.axes)[number] = value
        self._rest = self._rest[whole:]
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class UinputPad:
    """A virtual controller made through ``/dev/uinput`` (or ``path``)."""

    def __init__(self, index: int, path: Path = UINPUT) -> None:
        #: the device nodes ``expose`` made for a sandbox (removed with the pad)
        self.nodes: list[Path] = []
        self.fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            self._setup(index)
        except OSError:
            os.close(self.fd)
            raise

    def _setup(self, index: int) -> None:
        fcntl.ioctl(self.fd, UI_SET_EVBIT, EV_KEY)
        for code in BUTTONS.values():
            fcntl.ioctl(self.fd, UI_SET_KEYBIT, code)
        fcntl.ioctl(self.fd, UI_SET_EVBIT, EV_ABS)
        for code, (low, high) in AXIS_RANGES.items():
            fcntl.ioctl(self.fd, UI_SET_ABSBIT, code)
            # struct uinput_abs_setup: code, then input_absinfo (value min max fuzz flat res)
            fcntl.ioctl(self.fd, UI_ABS_SETUP, struct.pack("<H2xiiiiii", code, 0, low, high,
                                                            0, 0, 0))  # fmt: skip
        name = f"Tessera virtual pad {index}".encode()[:79]
        # struct uinput_setup: input_id (bustype vendor product version), name[80], ff max
        setup = struct.pack("<HHHH80sI", *PAD_ID, name, 0)
        fcntl.ioctl(self.fd, UI_DEV_SETUP, setup)
        fcntl.ioctl(self.fd, UI_DEV_CREATE)

    def expose(self, folder: Path, uid: int, gid: int) -> list[Path]:
        """Make this controller's device nodes in ``folder`` (a sandbox's /dev/input)."""
        name = fcntl.ioctl(self.fd, UI_GET_SYSNAME, bytes(SYSNAME_LEN))
        self.nodes = expose_nodes(VIRTUAL_INPUT / name.rstrip(b"\0").decode(), folder, uid, gid)
        return self.nodes

    def apply(self, state: PadState) -> None:
        data = b"".join(INPUT_EVENT.pack(0, 0, t, c, v) for t, c, v in events(state))
        os.write(self.fd, data)

    def close(self) -> None:
        for node in self.nodes:
            node.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            fcntl.ioctl(self.fd, UI_DEV_DESTROY)
        with contextlib.suppress(OSError):
            os.close(self.fd)


@dataclass
class _Reader:
    """One connection to a ``SocketPad``'s node: what its app was last sent, and the bytes
    still to send (a connection's stream must never be cut inside an event)."""

    sock: socket.socket
    js: bool
    sent: dict[tuple[int, int], int] = field(default_factory=dict)
    pending: bytes = b""


class SocketPad:
    """A virtual controller without uinput: unix sockets named as its nodes (``jsN``,
    ``eventN``) in the sandbox's /dev/input, which the app's pad shim opens as the nodes. Each
    connection gets what a node's reader gets from the kernel: on the joystick API the whole
    pad at once (``JS_EVENT_INIT``), then every change; on evdev every change from a pad at
    rest, each state closed by ``SYN_REPORT``. Runs on the service's event loop."""

    def __init__(self, index: int) -> None:
        self.index = index
        #: the sockets ``expose`` made (removed with the pad)
        self.nodes: list[Path] = []
        self.state = PadState((), ())
        self._listeners: list[socket.socket] = []
        self._readers: list[_Reader] = []

    def expose(self, folder: Path, uid: int, gid: int) -> list[Path]:
        """Listen at this pad's nodes in ``folder`` (the sandbox's /dev/input), owned by
        ``uid``:``gid`` (where the service may chown) and mode 0600; a restarted display's
        new folder replaces the old one."""
        loop = asyncio.get_running_loop()
        self._unlisten()
        for name, js in ((f"js{self.index}", True), (f"event{self.index}", False)):
            node = folder / name
            node.unlink(missing_ok=True)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(str(node))
                node.chmod(0o600)
                if os.geteuid() == 0:
                    os.chown(node, uid, gid, follow_symlinks=False)
                sock.listen(MAX_READERS)
                sock.setblocking(False)
            except OSError:
                sock.close()
                node.unlink(missing_ok=True)
                self._unlisten()
                raise
            loop.add_reader(sock, self._accept, sock, js)
            self._listeners.append(sock)
            self.nodes.append(node)
        return self.nodes

    def _accept(self, listener: socket.socket, js: bool) -> None:
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while True:
                sock, _ = listener.accept()
                if len(self._readers) >= MAX_READERS:
                    sock.close()
                    continue
                sock.setblocking(False)
                reader = _Reader(sock, js)
                self._readers.append(reader)
                asyncio.get_running_loop().add_reader(sock, self._drain, reader)
                self._send(reader, opened=True)

    def _drain(self, reader: _Reader) -> None:
        """Throw away what the app writes; its end closed, forget it."""
        try:
            if reader.sock.recv(4096):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._drop(reader)

    def _drop(self, reader: _Reader) -> None:
        with contextlib.suppress(ValueError, RuntimeError):
            loop = asyncio.get_running_loop()
            loop.remove_reader(reader.sock)
            loop.remove_writer(reader.sock)
        reader.sock.close()
        if reader in self._readers:
            self._readers.remove(reader)

    def _send(self, reader: _Reader, opened: bool = False) -> None:
        now = time.time()
        # what changed since this reader was last sent (on evdev from a pad at rest; the
        # joystick driver's reader gets every button and axis as it opens)
        current = js_events(self.state) if reader.js else events(self.state)[:-1]  # no SYN
        changed = [(t, c, v) for t, c, v in current
                   if (reader.js and opened) or reader.sent.get((t, c), 0) != v]  # fmt: skip
        reader.sent.update(((t, c), v) for t, c, v in changed)
        if reader.js:
            stamp, flag = int(now * 1000) & 0xFFFFFFFF, JS_EVENT_INIT if opened else 0
            data = b"".join(JS_EVENT.pack(stamp, v, t | flag, n) for t, n, v in changed)
        elif changed:
            sec, usec = int(now), int(now % 1 * 1e6)
            report = [*changed, (EV_SYN, SYN_REPORT, 0)]
            data = b"".join(INPUT_EVENT.pack(sec, usec, t, c, v) for t, c, v in report)
        else:
            data = b""
        reader.pending += data
        if len(reader.pending) > MAX_PENDING_BYTES:
            log.info("event=gamepad_reader_dropped pad=%d reason=not_reading", self.index)
            self._drop(reader)
            return
        self._flush(reader)

    def _flush(self, reader: _Reader) -> None:
        """Send what ``reader`` has waiting; what its socket cannot take now goes when it can."""
        loop = asyncio.get_running_loop()
        try:
            reader.pending = reader.pending[reader.sock.send(reader.pending) :]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(reader)
            return
        if reader.pending:
            loop.add_writer(reader.sock, self._flush, reader)
        else:
            loop.remove_writer(reader.sock)

    def apply(self, state: PadState) -> None:
        self.state = state
        for reader in list(self._readers):
            self._send(reader)

    def _unlisten(self) -> None:
        for reader in list(self._readers):
            self._drop(reader)
        for sock in self._listeners:
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(sock)
            sock.close()
        for node in self.nodes:
            node.unlink(missing_ok=True)
        self._listeners, self.nodes = [], []

    def close(self) -> None:
        self._unlisten()


#: a controller of either kind
VirtualPad = UinputPad | SocketPad


def open_pad(
    index: int, path: Path = UINPUT, sandboxed: bool = False, shim: Path = SHIM
) -> VirtualPad | None:
    """A virtual controller: uinput's where the host has it, else (for a ``sandboxed`` app,
    which loads the ``shim``) a ``SocketPad``; None where neither can be."""
    try:
        return UinputPad(index, path)
    except OSError as exc:
        if sandboxed and shim.is_file():
            log.info("event=gamepad_shim pad=%d uinput_error=%r", index, exc.strerror)
            return SocketPad(index)
        log.info("event=gamepad_unavailable path=%s error=%r", path, exc.strerror)
        return None
