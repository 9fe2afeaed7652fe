"""From inside a running desktop session: what a member's app can and cannot reach.

Two desktop sessions run on a real service (Xvfb + openbox + xterm in their sandboxes); a probe
runs through the same launcher spec as session A's app, and the session's own processes are
read from the host side.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from encoder import appbox
from encoder.app import running
from encoder.service import StreamService
from encoder.source import SandboxedSource
from farm import sandbox
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.encoder import tokens
from tests.encoder.streamclient import StreamClient

PROBE = Path(__file__).with_name("stream_probe.py")
#: how long the desktop may take to hold still before the typing test
STILL_WAIT_S = 60.0
#: frames (at the session's 10 fps) in which nothing may be drawn before the keys are sent
QUIET_FRAMES = 20
#: a pixel drawn (text typed, a window mapped) moves by more than the encoder's refinement of
#: a still picture does (a few levels)
DRAWN_LEVELS = 48


def drawn(now: Any, before: Any, pixels: int) -> bool:
    """More than ``pixels`` pixels of a grey picture changed by more than DRAWN_LEVELS."""
    return int((np.abs(now.astype(np.int16) - before) > DRAWN_LEVELS).sum()) > pixels


@pytest.fixture(scope="module")
def service(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StreamService]:
    storage = tmp_path_factory.mktemp("storage")
    (storage / "frame.exr").write_bytes(b"project A's frame")
    settings = Settings().with_(
        redis_url=redis_server.url.rsplit("/", 1)[0] + "/3",
        storage_dir=storage,
        work_dir=tmp_path_factory.mktemp("stream-sandbox"),
        device="cpu",
        stream_port=0,
        cpu_encode_sessions=3,
        stream_secret=tokens.STREAM_SECRET,
        stream_memory_mib=256,
        stream_pids=64,
    )
    with running(settings) as svc:
        yield svc


def two_desktops(service: StreamService) -> tuple[SandboxedSource, SandboxedSource]:
    async def go() -> list[str]:
        async with aiohttp.ClientSession(headers=tokens.operator_headers()) as http:
            client = StreamClient(service.url, http)
            made = [await client.create_session("desktop", 640, 480, 10) for _ in range(2)]
            return [str(m["session_id"]) for m in made]

    a, b = asyncio.run(go())
    sources = [service.sessions[sid].source for sid in (a, b)]
    assert all(isinstance(s, SandboxedSource) for s in sources)
    return sources[0], sources[1]  # type: ignore[return-value]


def probe(source: SandboxedSource, args: list[str]) -> dict[str, Any]:
    """Run the probe in a sandbox made exactly as the session's (binds, uid, limits, network)
    plus the probe's own file; its JSON report comes back on stdout."""
    spec = source.box.spec()
    spec = sandbox.SandboxSpec(
        **{
            **spec.__dict__,
            "name": "probe",
            "ro_binds": (*spec.ro_binds, (PROBE, Path("/probe.py"))),
        }
    )
    box = sandbox.spawn(
        source.box.settings, spec, [sys.executable, "/probe.py", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = box.proc.communicate(timeout=60)
    finally:
        box.close()
    assert box.proc.returncode == 0, err.decode()
    return dict(json.loads(out))


def test_a_desktop_session_is_confined(service: StreamService, redis_server: RedisServer) -> None:
    a, b = two_desktops(service)
    settings = service.settings
    # the session's own processes, seen from the host: the sandbox uid, no farm environment
    for pid in a.pids():
        status = Path(f"/proc/{pid}/status").read_text()
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm == "bwrap":
            continue  # the launcher itself, before it drops to the sandbox uid
        assert int(uid) == settings.sandbox_uid != 0, (pid, comm)
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith(b"FARM_")], (pid, comm)
    assert b.box.number is not None and a.box.number is not None
    report = probe(
        a,
        [
            str(redis_server.port),
            str(settings.storage_dir),
            str(b.box.number),
            str(a.box.number),
            str(sys.prefix),
        ],
    )
    assert report["uid"] == settings.sandbox_uid
    assert report["farm_env"] == []
    assert report["redis_tcp"] == "refused"
    assert report["storage"] is False
    assert report["other_display"] == "refused"
    assert report["own_display"] == "reached"  # the probe shares its session's display folder
    assert report["processes"] <= 4, report  # the probe's own sandbox: nothing of the host's
    assert report["memory"] == "stopped", report
    assert report["pids"] == "stopped", report
    end_all(service)


def end_all(service: StreamService) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession(headers=tokens.operator_headers()) as http:
            client = StreamClient(service.url, http)
            for sid in list(service.sessions):
                await client.delete_session(sid)

    asyncio.run(go())


def shm_segments(service: StreamService, sid: str) -> list[int]:
    """Sizes of the SysV shared memory segments in the session's sandbox's IPC namespace."""
    source = service.sessions[sid].source
    assert isinstance(source, SandboxedSource) and source.box.box is not None
    namespace = source.box.box.ipc_namespace()
    assert namespace is not None
    listing = subprocess.run(
        ["nsenter", f"--ipc={namespace}", "cat", "/proc/sysvipc/shm"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()[1:]  # fmt: skip
    return [int(line.split()[3]) for line in listing]


def test_the_desktop_streams_and_takes_input(service: StreamService) -> None:
    async def go() -> None:
        async with aiohttp.ClientSession(headers=tokens.operator_headers()) as http:
            client = StreamClient(service.url, http)
            made = await client.create_session("desktop", 640, 480, 10)
            sid = str(made["session_id"])
            viewer = await client.join(sid)
            try:
                frame = await viewer.next_frame(timeout_s=20)
                assert (frame.frame.width, frame.frame.height) == (640, 480)
                # the capture shares memory with the sandboxed Xvfb (MIT-SHM in the
                # sandbox's IPC namespace), rather than copying each frame through the socket
                assert [n for n in shm_segments(service, sid) if n >= 640 * 480 * 4]
                await viewer.wait_open()

                async def still() -> Any:
                    """The picture once it has not changed for 10 frames (~1 s): the desktop
                    has started (openbox maps xterm and gives it the focus in its own time).
                    The encoder refines a still picture for a while after a keyframe or a
                    bitrate change (its rate buffer is one frame at the current rate): a few
                    levels of change are not a change."""
                    last = (await viewer.next_frame()).frame.to_ndarray(format="gray")
                    same = 0
                    deadline = time.monotonic() + STILL_WAIT_S
                    while same < 10:
                        assert time.monotonic() < deadline, "the desktop never held still"
                        now = (await viewer.next_frame()).frame.to_ndarray(format="gray")
                        same = same + 1 if not drawn(now, last, 0) else 0
                        last = now
                    return last

                # xterm in the sandbox gets the keys: typed text changes a still picture (on a
                # loaded machine xterm may map after the first try: clicking and typing go on
                # until it does)
                changed = False
                for _ in range(4):
                    # a click in the terminal gives it the focus, as a user would
                    viewer.send({"t": "mm", "x": 320, "y": 260})
                    viewer.send({"t": "mb", "b": 1, "d": True})
                    viewer.send({"t": "mb", "b": 1, "d": False})
                    before = await still()
                    # nothing more is drawn without typing (a shell prompt that comes late
                    # would pass for typed text): else the desktop is still starting
                    quiet = [(await viewer.next_frame()).frame.to_ndarray(format="gray")
                             for _ in range(QUIET_FRAMES)]  # fmt: skip
                    if any(drawn(now, before, 20) for now in quiet):
                        continue
                    for code in ("KeyE", "KeyC", "KeyH", "KeyO"):
                        viewer.send({"t": "kd", "code": code})
                        viewer.send({"t": "ku", "code": code})
                    for _ in range(50):
                        now = (await viewer.next_frame()).frame.to_ndarray(format="gray")
                        if drawn(now, before, 20):
                            changed = True
                            break
                    if changed:
                        break
                assert changed, "typing into the sandboxed desktop changed nothing on screen"
            finally:
                await client.leave(sid, viewer)
                await client.delete_session(sid)

    asyncio.run(go())


def test_ending_a_session_kills_its_whole_sandbox(service: StreamService) -> None:
    a, _ = two_desktops(service)
    group = a.box.box.cgroup if a.box.box is not None else None
    assert group is not None and group.pids()
    dirs, number = group.dirs, a.box.number
    sid = next(s for s, session in service.sessions.items() if session.source is a)

    async def end() -> None:
        async with aiohttp.ClientSession(headers=tokens.operator_headers()) as http:
            await StreamClient(service.url, http).delete_session(sid)

    asyncio.run(end())
    assert not [d for d in dirs if d.exists()]
    assert not appbox.X11_DIR.joinpath(f"X{number}").is_symlink()
    end_all(service)


def test_a_display_number_left_by_a_dead_service_is_taken_again() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    number, lock = appbox._claim_display()
    # as a killed service leaves them: its lock file and the link into its socket folder
    lock.write_text(f"{dead.pid:10d}\n")
    (appbox.X11_DIR / f"X{number}").symlink_to("/nonexistent/X")
    again, lock = appbox._claim_display()
    try:
        assert again == number
        assert not (appbox.X11_DIR / f"X{number}").is_symlink()
    finally:
        lock.unlink()
