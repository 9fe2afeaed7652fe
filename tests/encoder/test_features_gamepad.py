"""Gamepads: the browser's standard mapping turned into a virtual controller's input events,
and (where the host has /dev/uinput) a controller the session's app can read; its device
nodes made in the session's sandbox, where the app sees them (this VM has no /dev/uinput: the
nodes' path into the sandbox is tested with a node of /dev/null's number)."""

from __future__ import annotations

import os
import select
import stat
import struct
import sys
import time
from pathlib import Path

import pytest

from encoder import gamepad as gp
from encoder.catalog import App
from encoder.control import InputControl
from encoder.gamepad import UINPUT, PadState, events, expose_nodes, open_pad
from encoder.source import SandboxedSource, make_source
from farm.settings import Settings

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes needs root")


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


def _fake_sysfs(root: Path, *nodes: str) -> Path:
    """A virtual input device's sysfs folder whose ``nodes`` have /dev/null's number."""
    device = root / "input17"
    for name in nodes:
        (device / name).mkdir(parents=True)
        (device / name / "dev").write_text("1:3\n")
    (device / "power").mkdir()  # not a node
    (device / "name").write_text("Tessera virtual pad 0\n")
    return device


@as_root
def test_a_pads_nodes_are_made_with_the_kernels_numbers_for_the_sandboxs_uid(
    tmp_path: Path,
) -> None:
    device = _fake_sysfs(tmp_path / "sys", "event5", "js2")
    folder = tmp_path / "dev-input"
    folder.mkdir()
    made = expose_nodes(device, folder, 64000, 64001)
    assert [node.name for node in made] == ["event5", "js2"]
    for node in made:
        info = node.lstat()
        assert stat.S_ISCHR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert (os.major(info.st_rdev), os.minor(info.st_rdev)) == (1, 3)
        assert (info.st_uid, info.st_gid) == (64000, 64001)
    # made again (the same index after a restart): replaced, not an error
    assert expose_nodes(device, folder, 64000, 64001) == made


#: the app of the test below: waits for /dev/input/event0, opens it, tries to add a node of its
#: own, and writes what it saw into its home folder
PAD_PROBE = """
import os, time
node = "/dev/input/event0"
for _ in range(400):
    if os.path.exists(node):
        break
    time.sleep(0.05)
try:
    fd = os.open(node, os.O_RDONLY)
    rdev = os.fstat(fd).st_rdev
    seen = f"opened {os.major(rdev)}:{os.minor(rdev)}"
except OSError as exc:
    seen = f"not opened: {exc.strerror}"
try:
    open("/dev/input/mine", "w").close()
    added = "added"
except OSError:
    added = "refused"
with open(os.path.expanduser("~/seen.tmp"), "w") as out:
    out.write(f"{seen} uid={os.getuid()} {added} {sorted(os.listdir('/dev/input'))}")
os.rename(os.path.expanduser("~/seen.tmp"), os.path.expanduser("~/seen"))
time.sleep(60)
"""


@as_root
@pytest.mark.usefixtures("no_orphans")
def test_a_sandboxed_app_sees_a_pad_plugged_in_after_it_started(tmp_path: Path) -> None:
    settings = Settings().with_(work_dir=tmp_path)
    app = App("padprobe", "pad probe", (sys.executable, "-c", PAD_PROBE), 320, 240, 30)
    source = make_source(app, settings, "padprobe")
    assert isinstance(source, SandboxedSource)
    source.start(lambda reason: None)
    try:
        where = source.pad_devices
        assert where is not None
        folder, uid, gid = where
        assert not list(folder.iterdir())  # no pad yet
        expose_nodes(_fake_sysfs(tmp_path / "sys", "event0"), folder, uid, gid)
        assert source.home is not None
        seen, deadline = source.home / "seen", time.monotonic() + 20
        while not seen.exists():
            assert time.monotonic() < deadline, "the app did not report"
            time.sleep(0.05)
        assert seen.read_text() == f"opened 1:3 uid={settings.sandbox_uid} refused ['event0']"
    finally:
        source.stop()


class ExposedPad:
    """A controller that records where its nodes were made (``fail_in``: mknod refused)."""

    def __init__(self, fail_in: Path | None = None) -> None:
        self.nodes: list[Path] = []
        self.made_in: list[Path] = []
        self.states = 0
        self.fail_in = fail_in

    def expose(self, folder: Path, uid: int, gid: int) -> list[Path]:
        self.made_in.append(folder)
        if folder == self.fail_in:
            raise PermissionError(1, "Operation not permitted")
        self.nodes = [folder / "event0"]
        return self.nodes

    def apply(self, state: PadState) -> None:
        self.states += 1

    def close(self) -> None:
        pass


def test_a_pads_nodes_follow_the_sandbox_once_each_and_a_refusal_is_not_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pad = ExposedPad(fail_in=tmp_path / "c")
    monkeypatch.setattr("encoder.control.open_pad", lambda index: pad)
    folder = [tmp_path / "a"]
    app = App("probe", "probe", ("true",), 320, 240, 30)
    control = InputControl(
        "s", app, lambda: None, lambda: (320, 240), lambda w, h: None,
        pad_devices=lambda: (folder[0], 64000, 64000),
    )  # fmt: skip
    control.joined("viewer", "player")
    press = {"t": "gp", "i": 0, "b": [1.0], "a": [0.0]}
    for where in ("a", "a", "b", "b", "c", "c", "c"):  # a restarted display: a new folder
        folder[0] = tmp_path / where
        control.handle("viewer", press)
    assert pad.states == 7
    assert pad.made_in == [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
