"""The sandboxed Blender child's view of the machine: its job's files only, no farm environment,
no network; probed from inside through the very launcher and spec the worker uses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from farm import sandbox
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.blendscenes import make_scene
from workers.child import BlenderChild
from workers.exr import read_rgba

PROBE = textwrap.dedent(
    """
    import json, os, socket, sys
    mine, other, scratch, redis_port, blends = sys.argv[1:6]
    def reach(port):
        try:
            socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()
            return True
        except OSError:
            return False
    def writable(path):
        try:
            with open(path, "ab"):
                return True
        except OSError:
            return False
    print(json.dumps({
        "farm_env": sorted(k for k in os.environ if k.startswith("FARM_")),
        "uid": os.getuid(),
        "mine": os.path.exists(mine), "mine_writable": writable(mine),
        "other": os.path.exists(other), "blends": os.path.exists(blends),
        "scratch_writable": writable(os.path.join(scratch, "probe.txt")),
        "redis": reach(redis_port),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
    }))
    """
)


@pytest.fixture
def farm(tmp_path: Path) -> tuple[Settings, Path, Path]:
    """Settings of a worker whose storage holds project A's upload and project B's."""
    settings = Settings().with_(work_dir=tmp_path / "work", storage_dir=tmp_path / "storage")
    mine = make_scene(settings.storage_dir / "uploads" / "a" / "a.blend", width=24, height=16)
    other = settings.storage_dir / "uploads" / "b" / "b.blend"
    other.parent.mkdir(parents=True)
    other.write_bytes(mine.read_bytes())
    (settings.work_dir / "blends").mkdir(parents=True)
    return settings, mine, other


def test_the_child_sees_its_file_set_and_scratch_only_no_farm_env_no_network(
    farm: tuple[Settings, Path, Path], redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings, mine, other = farm
    sandbox.check(settings)
    monkeypatch.setenv("FARM_REDIS_URL", redis_server.url)
    child = BlenderChild.for_settings(settings, "probe")
    child.use("A", mine.parent)
    spec = child.sandbox_spec(settings, dict(os.environ))
    port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
    args = [str(mine), str(other), str(child.work_dir), port, str(settings.work_dir / "blends")]
    box = sandbox.spawn(settings, spec, [sys.executable, "-c", PROBE, *args],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        out, err = box.proc.communicate(timeout=60)
    finally:
        box.close()
    assert box.proc.returncode == 0, err.decode()
    seen = json.loads(out)
    assert seen["farm_env"] == []
    assert seen["uid"] not in (0, os.getuid()) or os.getuid() != 0
    assert seen["mine"] and not seen["mine_writable"], "the job's files are read-only"
    assert not seen["other"], "another project's upload is visible"
    assert not seen["blends"], "the worker's cache of uploads is visible"
    assert seen["scratch_writable"]
    assert not seen["redis"], "Redis is reachable"
    assert seen["interfaces"] in ([], ["lo"])
    # and the host's side of it: the redis-server is there to reach from outside
    socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()


def test_the_sandboxed_child_renders_its_job(farm: tuple[Settings, Path, Path]) -> None:
    settings, mine, _other = farm
    with BlenderChild.for_settings(settings, "render") as child:
        child.use("A", mine.parent)
        out = child.work_dir / "frame.exr"
        child.render(mine, frame=1, width=24, height=16, rect=None, samples=2, out_path=out,
                     timeout_s=120)  # fmt: skip
        assert read_rgba(out).shape == (16, 24, 4)
        assert child.log_path is not None and child.log_path.parent != child.work_dir
