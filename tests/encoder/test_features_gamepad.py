"""Gamepads: the browser's standard mapping turned into a virtual controller's input events,
and (where the host has /dev/uinput) a controller the session's app can read."""

from __future__ import annotations

import os
import select
import struct
from pathlib import Path

import pytest

from encoder import gamepad as gp
from encoder.gamepad import UINPUT, PadState, events, open_pad


def test_a_pad_state_becomes_the_whole_pads_events() -> None:
    buttons = [0.0] * 17
    buttons[0] = 1.0  # A
    buttons[9] = 1.0  # Start
    buttons[7] = 0.5  # right trigger, half way
    buttons[12] = 1.0  # d-pad up
    buttons[15] = 1.0  # d-pad right
    out = events(PadState(tuple(buttons), (-1.0, 0.5, 0.0, 0.0)))
    got = {(t, c): v for t, c, v in out}
    assert got[(gp.EV_KEY, gp.BTN_SOUTH)] == 1 and got[(gp.EV_KEY, gp.BTN_START)] == 1
    assert got[(gp.EV_ABS, gp.ABS_RZ)] == 128
    assert got[(gp.EV_ABS, gp.ABS_X)] == -32767 and got[(gp.EV_ABS, gp.ABS_Y)] == 16384
    assert (got[(gp.EV_ABS, gp.ABS_HAT0X)], got[(gp.EV_ABS, gp.ABS_HAT0Y)]) == (1, -1)
    # one report per state: the app sees the pad change at once, all of it
    assert out[-1] == (gp.EV_SYN, 0, 0)


def test_a_pad_message_is_clamped_or_refused() -> None:
    state = PadState.parse({"t": "gp", "b": [2, -1, "0.25"], "a": [-3, 0.5]})
    assert state == PadState((1.0, 0.0, 0.25), (-1.0, 0.5))
    for bad in ({"b": "x", "a": []}, {"b": [0] * 33, "a": []}, {"b": [], "a": [None]}):
        with pytest.raises((TypeError, ValueError)):
            PadState.parse(bad)


def test_without_uinput_no_controller_is_made(tmp_path: Path) -> None:
    assert open_pad(0, tmp_path / "no-uinput") is None


@pytest.mark.skipif(
    not os.access(UINPUT, os.W_OK), reason="no writable /dev/uinput on this host (VM without it)"
)
def test_the_virtual_controller_reports_what_the_viewer_pressed() -> None:
    pad = open_pad(3)
    assert pad is not None
    try:
        node = _event_node("Tessera virtual pad 3")
        fd = os.open(node, os.O_RDONLY | os.O_NONBLOCK)
        try:
            pad.apply(PadState((1.0,), (0.0,)))
            ready, _, _ = select.select([fd], [], [], 5.0)
            assert ready, "the controller reported nothing"
            size = struct.calcsize("@llHHi")
            data = os.read(fd, size * 64)
            seen = [struct.unpack_from("@llHHi", data, at)[2:] for at in range(0, len(data), size)]
            assert (gp.EV_KEY, gp.BTN_SOUTH, 1) in seen
        finally:
            os.close(fd)
    finally:
        pad.close()


def _event_node(name: str) -> Path:
    for entry in Path("/sys/class/input").glob("event*"):
        if (entry / "device" / "name").read_text().strip() == name:
            return Path("/dev/input") / entry.name
    raise AssertionError(f"no input device named {name!r}")
