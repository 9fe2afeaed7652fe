"""Gamepads: the browser's standard-mapping Gamepad state turned into Linux input events of a
virtual controller (uinput), which the session's app reads like a plugged-in pad.

The kernel makes the controller's device nodes on the host (``eventN``, ``jsN``); a sandboxed
app sees only its session's ``/dev/input`` (encoder/appbox.py), so ``UinputPad.expose`` makes
the same nodes there, owned by the sandbox's uid (which needs the service to be root: mknod).

Where /dev/uinput cannot be opened (a VM or container without it), ``open_pad`` says so and
the session keeps only the last state its viewer sent.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import struct
from dataclasses import dataclass
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
#: UI_GET_SYSNAME(len): the device's name under /sys/devices/virtual/input ("input17")
SYSNAME_LEN = 64
UI_GET_SYSNAME = 0x80000000 | (SYSNAME_LEN << 16) | (ord("U") << 8) | 44
#: where the kernel lists a virtual input device's nodes
VIRTUAL_INPUT = Path("/sys/devices/virtual/input")
#: the nodes an app reads a pad through: evdev, and the older joystick API
NODE_PREFIXES = ("event", "js")


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
        ranges = {code: (-STICK_MAX, STICK_MAX) for code in STICKS.values()}
        ranges |= {code: (0, TRIGGER_MAX) for code in TRIGGERS.values()}
        ranges |= {ABS_HAT0X: (-1, 1), ABS_HAT0Y: (-1, 1)}
        for code, (low, high) in ranges.items():
            fcntl.ioctl(self.fd, UI_SET_ABSBIT, code)
            # struct uinput_abs_setup: code, then input_absinfo (value min max fuzz flat res)
            fcntl.ioctl(self.fd, UI_ABS_SETUP, struct.pack("<H2xiiiiii", code, 0, low, high,
                                                            0, 0, 0))  # fmt: skip
        name = f"Tessera virtual pad {index}".encode()[:79]
        # struct uinput_setup: input_id (bustype vendor product version), name[80], ff max
        setup = struct.pack("<HHHH80sI", BUS_VIRTUAL, 0x045E, 0x028E, 1, name, 0)
        fcntl.ioctl(self.fd, UI_DEV_SETUP, setup)
        fcntl.ioctl(self.fd, UI_DEV_CREATE)

    def expose(self, folder: Path, uid: int, gid: int) -> list[Path]:
        """Make this controller's device nodes in ``folder`` (a sandbox's /dev/input)."""
        name = fcntl.ioctl(self.fd, UI_GET_SYSNAME, bytes(SYSNAME_LEN))
        self.nodes = expose_nodes(VIRTUAL_INPUT / name.rstrip(b"\0").decode(), folder, uid, gid)
        return self.nodes

    def apply(self, state: PadState) -> None:
        # struct input_event: timeval (two longs), type, code, value
        data = b"".join(struct.pack("@llHHi", 0, 0, t, c, v) for t, c, v in events(state))
        os.write(self.fd, data)

    def close(self) -> None:
        for node in self.nodes:
            node.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            fcntl.ioctl(self.fd, UI_DEV_DESTROY)
        with contextlib.suppress(OSError):
            os.close(self.fd)


def open_pad(index: int, path: Path = UINPUT) -> UinputPad | None:
    """A virtual controller, or None where this host has no usable uinput."""
    try:
        return UinputPad(index, path)
    except OSError as exc:
        log.info("event=gamepad_unavailable path=%s error=%r", path, exc.strerror)
        return None
