"""The sandbox launcher (farm/sandbox.py) for real: bubblewrap, setpriv, cgroups on this host."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from farm import sandbox
from farm.errors import SetupError
from farm.redisserver import RedisServer
from farm.sandbox import Limits, SandboxSpec
from farm.settings import Settings

SETTINGS = Settings()


def run(spec: SandboxSpec, argv: list[str], timeout_s: float = 60.0) -> tuple[int, str]:
    box = sandbox.spawn(SETTINGS, spec, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = box.proc.communicate(timeout=timeout_s)
    finally:
        box.close()
    return box.proc.returncode, out.decode(errors="replace")


def python(code: str, **spec: object) -> tuple[int, str]:
    fields: dict[str, object] = {"name": "test", "ro_binds": sandbox.runtime_binds()}
    fields.update(spec)
    return run(SandboxSpec(**fields), [sys.executable, "-c", code])  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper, pid 1 here, is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture(scope="module")
def redis_unix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis-unix"), unix_socket=True) as server:
        yield server


def test_check_passes_on_this_host() -> None:
    sandbox.check(SETTINGS)


def test_check_names_bubblewrap_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SetupError, match="apt-get install bubblewrap"):
        sandbox.check(SETTINGS)


def test_runs_as_the_sandbox_user_with_only_its_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FARM_REDIS_URL", "redis://127.0.0.1:6379/0")
    code, out = python(
        "import os; print(os.getuid(), os.getgid(), os.getgroups());"
        "print(sorted(os.environ)); print(os.environ['APP_SETTING'])",
        env={"APP_SETTING": "given"},
    )
    assert code == 0, out
    ids, names, given = out.splitlines()
    assert ids == "64000 64000 []"
    assert os.getuid() != 64000
    assert not [n for n in eval(names) if n.startswith("FARM_")]
    assert given == "given"


def test_sees_only_its_own_processes_and_no_capabilities() -> None:
    code, out = python(
        "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()));"
        "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0].split()[1])"
    )
    assert code == 0, out
    pids, caps = out.splitlines()
    # bwrap's init, the interpreter: nothing of the host's
    assert len(eval(pids)) <= 3
    assert int(caps, 16) == 0


def test_host_files_outside_the_binds_are_not_there(tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    storage.mkdir()
    (storage / "frame.exr").write_bytes(b"secret")
    code, out = python(f"import os; print(os.path.exists({str(storage)!r}))")
    assert (code, out.strip()) == (0, "False")


def test_read_only_binds_are_read_only_and_rw_binds_writable(tmp_path: Path) -> None:
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    spec = SandboxSpec("t", uid=64000, gid=64000)
    sandbox.owned_dir(rw, spec)
    code, out = python(
        "import pathlib;"
        "pathlib.Path('/job/out.txt').write_text('ok');"
        "\ntry:\n pathlib.Path('/in/x').write_text('no')\nexcept OSError as e:\n print(e.errno)",
        ro_binds=(*sandbox.runtime_binds(), (ro, Path("/in"))),
        rw_binds=((rw, Path("/job")),),
    )
    assert code == 0, out
    assert out.strip() == "30"  # EROFS
    assert (rw / "out.txt").read_text() == "ok"
    assert not (ro / "x").exists()


def test_redis_is_unreachable_by_tcp_and_unix_socket(
    redis_server: RedisServer, redis_unix: RedisServer
) -> None:
    port, path = redis_server.port, redis_unix.url.removeprefix("unix://")
    probe = (
        "import socket\n"
        f"for fam, addr in ((socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_UNIX, {path!r})):\n"
        "    s = socket.socket(fam)\n"
        "    try:\n"
        "        s.connect(addr); print('reached')\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
    )
    code, out = python(probe)
    assert code == 0, out
    assert "reached" not in out, out
    # the same probe on the host does reach both: the sandbox is what stops it
    host = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert host.stdout.count("reached") == 2, host.stdout


def test_network_only_when_asked(redis_server: RedisServer) -> None:
    probe = (
        f"import socket; socket.create_connection(('127.0.0.1', {redis_server.port})); print('ok')"
    )
    assert python(probe, network=False)[1].strip() != "ok"
    assert python(probe, network=True)[1].strip() == "ok"


def test_memory_limit_stops_an_allocation() -> None:
    code, out = python(
        "b = bytearray(300 << 20); b[::4096] = b'x' * len(b[::4096]); print('allocated')",
        limits=Limits(memory_mib=64),
    )
    assert "allocated" not in out
    assert code != 0


def test_pids_limit_stops_a_fork_bomb() -> None:
    code, out = python(
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('stopped at', n, e.errno)\n",
        limits=Limits(pids=20),
    )
    assert code == 0, out
    stopped = out.split()
    assert stopped[:2] == ["stopped", "at"] and int(stopped[2]) < 20, out


def test_close_kills_every_process_and_removes_the_cgroup() -> None:
    spec = SandboxSpec("kill", ro_binds=sandbox.runtime_binds(), limits=Limits(pids=50))
    box = sandbox.spawn(
        SETTINGS, spec, ["/bin/sh", "-c", "sleep 600 & sleep 600 & echo up; wait"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert box.proc.stdout is not None
    assert box.proc.stdout.readline() == b"up\n"
    pids = box.pids()
    assert len(pids) >= 4  # bwrap, its init, sh, two sleeps (setpriv execs into sh)
    group = box.cgroup
    assert group is not None
    box.close()
    assert not [p for p in pids if alive(p)]
    assert not [d for d in group.dirs if d.exists()]


def test_farm_sandbox_takes_bwrap_or_none_only() -> None:
    from farm.errors import BadParameter

    assert Settings.from_env({"FARM_SANDBOX": "none"}).sandbox == "none"
    with pytest.raises(BadParameter, match="FARM_SANDBOX"):
        Settings.from_env({"FARM_SANDBOX": "docker"})
