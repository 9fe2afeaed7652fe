"""The slot allocator in the running farm: agents, NVML faults, fencing and preemption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import redis

from farm import keys
from farm.alloc.agent import DeviceAgent
from farm.alloc.allocator import Request, SlotAllocator
from farm.errors import LeaseLost, NoCapacity
from farm.gpu.fake import FakeNvml
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, until, wait_for
from workers import exr
from workers.child import BlenderChild


@pytest.fixture
def allocator(redis_url: str) -> SlotAllocator:
    return SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=5)


# --- agents ------------------------------------------------------------------------------------


def test_an_agent_that_stops_beating_takes_its_devices_out_of_the_pool(
    allocator: SlotAllocator,
) -> None:
    settings = Settings().with_(nvml="fake:t4,l4", agent_timeout_s=0.5)
    agent = DeviceAgent(settings, allocator, "host-a", nvml=FakeNvml(["t4", "l4"]))
    agent.beat()  # registered once, then silent
    lease = allocator.acquire("s", Request("stream", vram_mib=1000, encoder_sessions=1))
    assert {d.id for d in allocator.devices() if d.alive} == {d.id for d in agent.devices}
    until(lambda: not any(d.alive for d in allocator.devices()), 5, "the devices leaving")
    with pytest.raises(NoCapacity):
        allocator.acquire("s2", Request("stream", encoder_sessions=1))
    with pytest.raises(LeaseLost) as lost:
        allocator.renew(lease)
    assert "agent stopped answering" in lost.value.message
    assert all(d.used_encoder_sessions == 0 for d in allocator.devices())


def test_a_beating_agent_keeps_its_devices(allocator: SlotAllocator) -> None:
    settings = Settings().with_(agent_timeout_s=1.5)
    agent = DeviceAgent(settings, allocator, "host-b", nvml=FakeNvml(["l4"]))
    agent.start()
    try:
        (device,) = agent.devices
        lease = allocator.acquire("s", Request("stream", encoder_sessions=2))
        # the first registration alone keeps the device until this, on Redis's clock
        first_ms = _alive_until_ms(allocator, device.id)
        until(lambda: _redis_ms(allocator) > first_ms, 30, "the first registration's end")
        # past it, only the heartbeats keep the device in
        assert _alive_until_ms(allocator, device.id) > first_ms
        assert all(d.alive for d in allocator.devices())
        allocator.renew(lease)
    finally:
        agent.stop()


def _alive_until_ms(allocator: SlotAllocator, device_id: str) -> int:
    return int(allocator.conn.hget(keys.device(device_id), "alive_until") or 0)


def _redis_ms(allocator: SlotAllocator) -> int:
    seconds, micros = allocator.conn.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_nvml_faults_mark_the_device_unavailable_and_the_agent_keeps_running(
    allocator: SlotAllocator,
) -> None:
    nvml = FakeNvml(["t4", "l4"])
    settings = Settings().with_(agent_timeout_s=0.3)
    agent = DeviceAgent(settings, allocator, "host-c", nvml=nvml)
    agent.start()
    try:
        t4, l4 = agent.devices
        nvml.lose(0)
        until(lambda: not _state(allocator, t4.id).available, 5, "the lost GPU leaving")
        assert "lost" in _state(allocator, t4.id).unavailable_reason.lower()
        # streams go to the healthy GPU only
        for _ in range(3):
            assert allocator.acquire("s", Request("stream", encoder_sessions=1)).device == l4.id
        nvml.fail_next(6)  # NVML errors on every query for a while
        until(lambda: not _state(allocator, l4.id).available, 5, "the failing GPU leaving")
        until(lambda: _state(allocator, l4.id).available, 5, "the GPU coming back")
        assert agent._thread is not None and agent._thread.is_alive()
    finally:
        agent.stop()


def _state(allocator: SlotAllocator, device_id: str):  # type: ignore[no-untyped-def]
    return next(d for d in allocator.devices() if d.id == device_id)


# --- the render worker under the allocator ------------------------------------------------------


@pytest.fixture(scope="module")
def slow_scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("alloc") / "slow.blend", width=96, height=54)


#: the tile is still rendering when the test acts on it (seconds on one thread), and the
#: takeover's re-render costs little
SLOW_SAMPLES = 600


@pytest.fixture(scope="module")
def reference(
    slow_scene: Path, tmp_path_factory: pytest.TempPathFactory
) -> npt.NDArray[np.float32]:
    """The slow scene's frame as a plain Blender child renders it, once for the module."""
    out = tmp_path_factory.mktemp("ref") / "ref.exr"
    with BlenderChild(python=sys.executable, work_dir=out.parent) as child:
        child.render(slow_scene, frame=1, width=96, height=54, rect=None,
                     samples=SLOW_SAMPLES, out_path=out, timeout_s=300)  # fmt: skip
    return exr.read_rgba(out)


def test_renders_hold_leases_and_farm_gpus_shows_the_device(
    redis_url: str, tmp_path: Path, slow_scene: Path
) -> None:
    w = WorkerProcess(redis_url, tmp_path)
    try:
        alloc = SlotAllocator(redis.Redis.from_url(redis_url))
        until(lambda: alloc.devices(), 60, "the worker registering its device")
        store, job_id = submit(w.settings, slow_scene, tmp_path, tiles="2x1", samples=400)
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
        until(lambda: any(d.leases for d in alloc.devices()), 30, "a render lease")
        out = subprocess.run([sys.executable, "-m", "farm", "gpus", "--json"], env=w.env,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        (device,) = json.loads(out)
        assert device["device_class"] == "cpu" and device["alive"]
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done")
        until(lambda: not alloc.devices()[0].leases, 10, "the lease released")
        table = subprocess.run([sys.executable, "-m", "farm", "gpus"], env=w.env,
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert device["id"][:28] in table and " ok " in table
        assert "token=" in w.log_text()
    finally:
        w.stop()


def test_a_worker_paused_past_its_lease_cannot_commit_and_the_takeover_output_counts(
    redis_url: str, tmp_path: Path, slow_scene: Path, reference: npt.NDArray[np.float32]
) -> None:
    env = {"FARM_LEASE_TTL_S": "2", "FARM_CPU_RENDER_SLOTS": "2", "FARM_CPU_THREADS": "1"}
    a = WorkerProcess(redis_url, tmp_path, "paused", **env)
    b: WorkerProcess | None = None
    try:
        store, job_id = submit(a.settings, slow_scene, tmp_path, tiles="1x1",
                               samples=SLOW_SAMPLES)  # fmt: skip
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
        os.kill(a.proc.pid, signal.SIGSTOP)  # a GC pause, a network cut: the lease runs out
        b = WorkerProcess(redis_url, tmp_path, "takeover", **{**env, "FARM_CPU_THREADS": "2"})
        requeued = wait_for(store, job_id, lambda e: e.state == "queued" and bool(e.message), 60)
        assert "stopped answering" in requeued.message and requeued.attempt == 2
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 180)
        os.kill(a.proc.pid, signal.SIGCONT)
        # the paused worker wakes up, finds its lease gone, and commits nothing
        until(lambda: "frame=1 tile=0 attempt=1" in a.log_text()
              and ("commit=stale" in a.log_text() or "commit=fenced" in a.log_text()
                   or "lease_lost" in a.log_text()), 60, "the paused worker giving up")  # fmt: skip
        assert "commit=ok" not in a.log_text() and "commit=frame_ready" not in a.log_text()
        assert "attempt=2" in b.log_text() and "commit=frame_ready" in b.log_text()
        assert store.tile_attempt(job_id, 1, 0) == 2
        frame = exr.read_rgba(tmp_path / "o" / "frame_0001.exr")
        assert np.array_equal(frame, reference)
    finally:
        with_pid = a.proc.pid
        if a.proc.poll() is None:
            os.kill(with_pid, signal.SIGCONT)
        a.stop()
        if b is not None:
            b.stop()


def test_a_stream_preempts_a_render_and_the_tile_is_requeued_not_failed(
    redis_url: str, tmp_path: Path, slow_scene: Path, reference: npt.NDArray[np.float32]
) -> None:
    # the CPU device has room for the render (1024 MiB) or the stream (1000 MiB), not both
    env = {"FARM_LEASE_TTL_S": "1.5", "FARM_RENDER_VRAM_FLOOR_MIB": "1024",
           "FARM_DEVICE_OVERRIDES": json.dumps({"cpu": {"vram_mib": 1500}})}  # fmt: skip
    w = WorkerProcess(redis_url, tmp_path, **env)
    try:
        store, job_id = submit(w.settings, slow_scene, tmp_path, tiles="1x1",
                               samples=SLOW_SAMPLES)  # fmt: skip
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
        alloc = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=30)
        # the tile is marked rendering before its worker asks for the device: wait for the lease
        until(lambda: any(d.leases for d in alloc.devices()), 30, "the render's lease")
        stream = alloc.acquire(
            "stream-1", Request("stream", vram_mib=1000, encoder_sessions=1, preempt=True)
        )
        assert stream.revoked_others == 1
        requeued = wait_for(store, job_id, lambda e: e.state == "queued" and bool(e.message), 30)
        assert "preempted by a stream" in requeued.message
        alloc.release(stream)
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 180)
        status = store.status(job_id)
        assert status.tile_failures == 0, "a preempted tile is not a failed tile"
        frame = exr.read_rgba(tmp_path / "o" / "frame_0001.exr")
        assert np.array_equal(frame, reference)
    finally:
        w.stop()


def test_a_tile_waiting_for_its_device_keeps_its_lease_and_counts_no_failure(
    redis_url: str, tmp_path: Path, slow_scene: Path
) -> None:
    # the chaos suite found this: workers sharing one CPU device, each tile that waited for it
    # longer than a tile lease was requeued by the sweep as if its worker had died, and counted
    w = WorkerProcess(redis_url, tmp_path, FARM_LEASE_TTL_S="1")
    try:
        alloc = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=60)
        until(lambda: alloc.devices(), 60, "the worker registering its device")
        (device,) = alloc.devices()
        held = alloc.acquire("test", Request("render", render_slots=1, device_ids=(device.id,)))
        store, job_id = submit(w.settings, slow_scene, tmp_path, tiles="1x1", samples=8)
        wait_for(store, job_id, lambda e: e.type == "tile_state" and e.state == "rendering")
        # four tile leases pass while the device is busy (the sweep runs every lease)
        busy_until = time.monotonic() + 4
        until(lambda: time.monotonic() > busy_until, 10, "four tile leases passing")
        alloc.release(held)
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done", 120)
        assert store.tile_attempt(job_id, 1, 0) == 1, "the wait was taken for a lost worker"
        assert store.status(job_id).tile_failures == 0
    finally:
        w.stop()
