"""Gamepads: the browser's standard mapping turned into a virtual controller's input events,
and (where the host has /dev/uinput) a controller the session's app can read; its device
nodes made in the session's sandbox, where the app sees them (this VM has no /dev/uinput: the
nodes' path into the sandbox is tested with a node of /dev/null's number)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import select
import socket
import stat
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    opened: list[bool] = []

    def open_pad(index: int, sandboxed: bool) -> ExposedPad:
        opened.append(sandboxed)
        return pad

    monkeypatch.setattr("encoder.control.open_pad", open_pad)
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
    assert opened == [True]  # one controller, for a sandboxed app (the shim's where no uinput)
    assert pad.made_in == [tmp_path / "a", tmp_path / "b", tmp_path / "c"]


def _start_probe(tmp_path: Path, name: str, script: str) -> SandboxedSource:
    """``script`` (Python) started as a session's app, in its sandbox; stop it when done."""
    app = App(name, name, (sys.executable, "-c", script), 320, 240, 30)
    source = make_source(app, Settings().with_(work_dir=tmp_path), name)
    assert isinstance(source, SandboxedSource)
    source.start(lambda reason: None)
    return source


async def _until(done: Callable[[], bool], deadline: float, what: str) -> None:
    """Until ``done()``, the event loop running meanwhile; ``what`` went wrong past
    ``deadline`` (time.monotonic)."""
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _shim_pad(index: int, tmp_path: Path) -> gp.SocketPad:
    """The controller this host gets for a sandboxed app without uinput: the shim's."""
    assert gp.SHIM.is_file(), "the pad shim is not built: .ci/setup builds it"
    pad = open_pad(index, tmp_path / "no-uinput", sandboxed=True)
    assert isinstance(pad, gp.SocketPad)
    return pad


#: the app of the shim's test: waits for its pad's nodes, reads them as the kernel's (stat,
#: the joystick and evdev queries, the events) and writes what it saw into its home folder
SHIM_PROBE = r"""
import fcntl, json, os, select, stat, struct, sys, time
JSIOCGAXES, JSIOCGBUTTONS = 0x80016A11, 0x80016A12
def JSIOCGNAME(n): return 0x80006A13 | (n << 16)
def EVIOCGNAME(n): return 0x80004506 | (n << 16)
def EVIOCGBIT(ev, n): return 0x80004520 + ev | (n << 16)
EVIOCGABS_X, EVIOCGID = 0x80184540, 0x80084502
seen = {"preload": os.environ.get("LD_PRELOAD", "")}
for _ in range(400):
    if os.path.exists("/dev/input/event1"):
        break
    time.sleep(0.05)
for name in ("js1", "event1"):
    info = os.stat("/dev/input/" + name)
    seen[name] = [stat.S_ISCHR(info.st_mode), os.major(info.st_rdev), os.minor(info.st_rdev)]
js = os.open("/dev/input/js1", os.O_RDONLY | os.O_NONBLOCK)
ev = os.open("/dev/input/event1", os.O_RDONLY | os.O_NONBLOCK)
seen["fstat"] = os.minor(os.fstat(ev).st_rdev)
seen["js_axes"] = fcntl.ioctl(js, JSIOCGAXES, b"\0")[0]
seen["js_buttons"] = fcntl.ioctl(js, JSIOCGBUTTONS, b"\0")[0]
seen["js_name"] = fcntl.ioctl(js, JSIOCGNAME(128), bytes(128)).rstrip(b"\0").decode()
seen["ev_name"] = fcntl.ioctl(ev, EVIOCGNAME(128), bytes(128)).rstrip(b"\0").decode()
seen["ev_id"] = list(struct.unpack("4H", fcntl.ioctl(ev, EVIOCGID, bytes(8))))
keys = fcntl.ioctl(ev, EVIOCGBIT(1, 96), bytes(96))
seen["ev_keys"] = [b for b in range(768) if keys[b // 8] >> (b % 8) & 1]
seen["ev_abs_x"] = list(struct.unpack("6i", fcntl.ioctl(ev, EVIOCGABS_X, bytes(24))))[1:3]
try:
    fcntl.ioctl(ev, 0x80044599, b"\0" * 4)
except OSError as exc:
    seen["unknown_query"] = exc.errno
js_events, ev_events = [], []
deadline = time.monotonic() + 20
# until the viewer's A press arrives on both nodes
while time.monotonic() < deadline and not (
    [1, 1, 0] in [e[1:] for e in js_events] and [1, 0x130, 1] in ev_events
):
    ready, _, _ = select.select([js, ev], [], [], 0.2)
    if js in ready:
        data = os.read(js, 8 * 64)
        js_events += [[t, v, typ, n] for t, v, typ, n in struct.iter_unpack("@IhBB", data)]
    if ev in ready:
        data = os.read(ev, 24 * 64)
        ev_events += [[t, c, v] for _, _, t, c, v in struct.iter_unpack("@llHHi", data)]
seen["js"] = [e[1:] for e in js_events]
seen["ev"] = ev_events
with open(os.path.expanduser("~/seen.tmp"), "w") as out:
    json.dump(seen, out)
os.rename(os.path.expanduser("~/seen.tmp"), os.path.expanduser("~/seen"))
time.sleep(60)
"""


@pytest.mark.usefixtures("no_orphans")
def test_without_uinput_a_sandboxed_app_reads_the_pad_through_the_shim(tmp_path: Path) -> None:
    """The shim's nodes read as the kernel's: a character device of the joystick major, the
    joystick and evdev queries answered for the controller uinput would make, the whole pad at
    once on js (JS_EVENT_INIT, the triggers at rest at -32767), then each change on both."""
    source = _start_probe(tmp_path, "shimprobe", SHIM_PROBE)

    async def drive() -> dict[str, Any]:
        where = source.pad_devices
        assert where is not None and source.home is not None
        pad = _shim_pad(1, tmp_path)
        try:
            assert [n.name for n in pad.expose(*where)] == ["js1", "event1"]
            seen, deadline = source.home / "seen", time.monotonic() + 20
            await _until(lambda: len(pad._readers) == 2, deadline, "the app opened no nodes")
            await asyncio.sleep(0.2)
            pad.apply(PadState((1.0,), (-1.0,)))  # A held, left stick hard left
            await _until(seen.exists, deadline, "the app did not report")
            return dict(json.loads(seen.read_text()))
        finally:
            pad.close()
            assert not list(where[0].iterdir())  # its sockets go with it

    try:
        seen = asyncio.run(drive())
    finally:
        source.stop()
    assert seen["preload"] == str(gp.SHIM)
    assert seen["js1"] == [True, 13, 1] and seen["event1"] == [True, 13, 65]
    assert seen["fstat"] == 65
    assert (seen["js_axes"], seen["js_buttons"]) == (8, 11)
    assert seen["js_name"] == seen["ev_name"] == "Tessera virtual pad 1"
    assert seen["ev_id"] == list(gp.PAD_ID)
    assert seen["ev_keys"] == sorted(gp.BUTTONS.values())
    assert seen["ev_abs_x"] == [-gp.STICK_MAX, gp.STICK_MAX]
    assert seen["unknown_query"] == errno.EINVAL
    # the whole pad as it opened: 11 buttons up, sticks and hat centred, triggers (axes 2
    # and 5: ABS_Z, ABS_RZ in code order) at rest, the bottom of their range
    init = {(t & ~gp.JS_EVENT_INIT, n): v for v, t, n in seen["js"] if t & gp.JS_EVENT_INIT}
    at_rest = {(gp.JS_EVENT_AXIS, 2): -32767, (gp.JS_EVENT_AXIS, 5): -32767}
    assert init == {(gp.JS_EVENT_BUTTON, n): 0 for n in range(11)} | {
        (gp.JS_EVENT_AXIS, n): at_rest.get((gp.JS_EVENT_AXIS, n), 0) for n in range(8)
    }
    changes = [e for e in seen["js"] if not e[1] & gp.JS_EVENT_INIT]
    assert changes == [[1, gp.JS_EVENT_BUTTON, 0], [-32767, gp.JS_EVENT_AXIS, 0]]
    assert seen["ev"] == [
        [gp.EV_KEY, gp.BTN_SOUTH, 1], [gp.EV_ABS, gp.ABS_X, -32767], [gp.EV_SYN, 0, 0]
    ]  # fmt: skip


def test_a_shim_pads_reader_gets_whole_events_in_order_a_stalled_one_is_dropped(
    tmp_path: Path,
) -> None:
    """Straight to the pad's sockets (no shim: the app's side is plain reads): what a reader's
    socket cannot take waits and goes whole and in order when it reads; one that stops reading
    is dropped past MAX_PENDING_BYTES; past MAX_READERS connections are refused."""

    async def drive() -> tuple[list[tuple[int, int, int]], bool, int]:
        pad = gp.SocketPad(0)
        pad.expose(tmp_path, os.getuid(), os.getgid())
        loop = asyncio.get_running_loop()
        slow, stalled = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
        for sock in (slow, stalled):
            sock.setblocking(False)
            await loop.sock_connect(sock, str(tmp_path / "event0"))
        while len(pad._readers) < 2:
            await asyncio.sleep(0.01)
        for reader in pad._readers:  # a unix socket's sender holds what is unread: a small one
            reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
        # 200 states of the left stick: about 14 KB each way, far past the socket's buffer
        for step in range(1, 201):
            pad.apply(PadState((), (step / 200,)))
        assert pad._readers[0].pending, "the reader's socket took everything at once"
        got = b""
        while len(got) < 200 * 2 * gp.INPUT_EVENT.size:
            got += await asyncio.wait_for(loop.sock_recv(slow, 65536), 5)
        seen = [(t, c, v) for _, _, t, c, v in gp.INPUT_EVENT.iter_unpack(got)]
        # the stalled one: past its share it is let go; the one reading stays
        for step in range(2000):
            pad.apply(PadState((), (-(step % 2) - 0.5,)))
            with contextlib.suppress(BlockingIOError):
                slow.recv(65536)
        # the stalled one reads what was sent before, then the end; the other stays
        while await asyncio.wait_for(loop.sock_recv(stalled, 65536), 5):
            pass
        dropped = len(pad._readers) == 1
        more = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(9)]
        for sock in more:
            sock.setblocking(False)
            await loop.sock_connect(sock, str(tmp_path / "js0"))
        await asyncio.sleep(0.2)
        readers = len(pad._readers)
        pad.close()
        for sock in (slow, stalled, *more):
            sock.close()
        return seen, dropped, readers

    seen, dropped, readers = asyncio.run(drive())
    want = []
    for step in range(1, 201):
        want += [(gp.EV_ABS, gp.ABS_X, round(step / 200 * gp.STICK_MAX)), (gp.EV_SYN, 0, 0)]
    assert seen == want
    assert dropped
    assert readers == gp.MAX_READERS


#: an SDL2 app (the library most games read pads with; PySDL2 and its bundled SDL2): waits for
#: a game controller, writes ~/ready once it has opened it, then what it saw into ~/seen
SDL_PROBE = r"""
import ctypes, json, os, time, warnings
warnings.simplefilter("ignore")  # PySDL2 says which SDL2 binaries it loaded
import sdl2
home = os.path.expanduser("~")
sdl2.SDL_Init(sdl2.SDL_INIT_GAMECONTROLLER)
deadline = time.monotonic() + 20
while sdl2.SDL_NumJoysticks() < 1 and time.monotonic() < deadline:
    sdl2.SDL_PumpEvents()
    time.sleep(0.05)
version = sdl2.SDL_version()
sdl2.SDL_GetVersion(ctypes.byref(version))
seen = {"version": f"{version.major}.{version.minor}.{version.patch}"}
seen["controllers"] = [bool(sdl2.SDL_IsGameController(i)) for i in range(sdl2.SDL_NumJoysticks())]
pad = sdl2.SDL_GameControllerOpen(0) if seen["controllers"] else None
if pad:
    joystick = sdl2.SDL_GameControllerGetJoystick(pad)
    seen["name"] = sdl2.SDL_GameControllerName(pad).decode()
    seen["axes"] = sdl2.SDL_JoystickNumAxes(joystick)
    seen["buttons"] = sdl2.SDL_JoystickNumButtons(joystick)
    open(os.path.join(home, "ready"), "w").close()
    events, event = [], sdl2.SDL_Event()
    while time.monotonic() < deadline and ["axis", 0, -32768] not in events:
        while sdl2.SDL_PollEvent(ctypes.byref(event)):
            if event.type == sdl2.SDL_CONTROLLERBUTTONDOWN:
                events.append(["down", event.cbutton.button])
            elif event.type == sdl2.SDL_CONTROLLERAXISMOTION and event.caxis.value:
                events.append(["axis", event.caxis.axis, event.caxis.value])
        time.sleep(0.01)
    seen["events"] = events
with open(os.path.join(home, "seen.tmp"), "w") as out:
    json.dump(seen, out)
os.rename(os.path.join(home, "seen.tmp"), os.path.join(home, "seen"))
time.sleep(60)
"""


@pytest.mark.usefixtures("no_orphans")
def test_sdl2_in_the_sandbox_reads_the_shims_pad_as_a_game_controller(tmp_path: Path) -> None:
    """What most games do: SDL2 scans the sandbox's /dev/input (no udev there), takes the
    shim's event node for a game controller (an Xbox 360 pad by its ids, SDL's own mapping),
    and reports the viewer's A press and left stick as controller events."""
    source = _start_probe(tmp_path, "sdlprobe", SDL_PROBE)

    async def drive() -> dict[str, Any]:
        where = source.pad_devices
        assert where is not None and source.home is not None
        pad = _shim_pad(0, tmp_path)
        try:
            pad.expose(*where)
            ready, seen = source.home / "ready", source.home / "seen"
            deadline = time.monotonic() + 30
            await _until(lambda: ready.exists() or seen.exists(), deadline, "SDL found no pad")
            pad.apply(PadState((1.0,), (-1.0,)))  # A held, left stick hard left
            await _until(seen.exists, deadline, "the app did not report")
            return dict(json.loads(seen.read_text()))
        finally:
            pad.close()

    try:
        seen = asyncio.run(drive())
    finally:
        source.stop()
    assert seen["controllers"] == [True], seen
    assert (seen["name"], seen["axes"], seen["buttons"]) == ("Xbox 360 Controller", 6, 11), seen
    # SDL's controller button 0 is A; axis 0 the left stick's x (SDL scales -32767 to -32768)
    assert seen["events"] == [["down", 0], ["axis", 0, -32768]], seen
