"""A paused assembler delivers nothing: its lease is fenced by its attempt, checked right before
each file is renamed into the output folder (issue #14 item 3)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

from farm import delivery, jobstore, queue
from farm.alloc.allocator import SlotAllocator
from farm.alloc.devices import Device
from farm.errors import LeaseLost
from farm.jobstore import JobStore
from farm.models import BlendSource, JobSpec, TileTask
from farm.settings import Settings
from farm.states import JobState
from farm.storage.local import LocalStorage
from farm.submission import submit
from tests.farmprocs import until
from workers.child import BlenderChild
from workers.tasks import WorkerContext, _FrameLease

#: the assembly lease (the tiles' lease TTL) in this test: short, so a pause outlives it
LEASE_S = 1.0


@pytest.fixture
def ctx(redis_url: str, tmp_path: Path) -> WorkerContext:
    settings = Settings(redis_url=redis_url, work_dir=tmp_path / "work", python=sys.executable)
    conn = jobstore.connect(redis_url)
    return WorkerContext(
        settings=settings,
        name="assembler",
        conn=conn,
        store=JobStore(conn, tile_lease_s=LEASE_S),
        queue=queue.RenderQueue(queue.connect(redis_url), "cpu"),
        storage=LocalStorage(tmp_path / "storage"),
        child=BlenderChild.for_settings(settings, "assembler"),
        allocator=SlotAllocator(conn),
        device=Device("cpu-fence", "host", None, "cpu", "cpu", 1024, 0, 1),
    )


def _snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file in the folder, hidden ones too: (inode, mtime ns, bytes)."""
    out = {}
    for name in sorted(os.listdir(folder)):
        st = os.stat(folder / name)
        out[name] = (st.st_ino, st.st_mtime_ns, (folder / name).read_bytes())
    return out


def test_an_assembler_paused_past_its_lease_writes_nothing(
    ctx: WorkerContext, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    source = BlendSource("path", "/nowhere/scene.blend", "0" * 64, "scene.blend")
    spec = JobSpec(source, (1,), "1x1", 64, 32, str(out), formats=("png",))
    job_id = submit(ctx.queue.conn, ctx.store, ctx.queue, spec, [], scripts_blocked=False)
    tile = TileTask(job_id, 1, 0, 1)
    assert ctx.store.start_tile(tile) == "ok"
    assert ctx.store.finish_tile(tile, 1) == "frame_ready"

    # A takes the frame, assembles, and is paused (SIGSTOP-like: no renewal either) right before
    # its file is renamed into the output
    assert ctx.store.claim_frame(job_id, 1, 1)
    stale = _FrameLease(ctx, job_id, 1, 1)
    paused, resume = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def paused_fence() -> None:
        paused.set()
        resume.wait(30)
        stale.check()

    def assembler_a() -> None:
        a_file = tmp_path / "a" / "frame_0001.png"
        a_file.parent.mkdir()
        a_file.write_bytes(b"stale assembler's frame")
        try:
            delivery.deliver_frame(ctx.conn, ctx.settings, spec, job_id, 1, [a_file],
                                   fence=paused_fence)  # fmt: skip
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    a = threading.Thread(target=assembler_a)
    a.start()
    assert paused.wait(10)

    # its lease runs out; the sweep offers the frame again under attempt 2, and B delivers it
    offered: list[tuple[str, int, int]] = []

    def reoffered() -> bool:
        offered.extend(ctx.store.sweep("sweeper", 5).frames)
        return bool(offered)

    until(reoffered, 10, "the frame offered again")
    assert offered == [(job_id, 1, 2)]
    assert ctx.store.claim_frame(job_id, 1, 2)
    b_file = tmp_path / "b" / "frame_0001.png"
    b_file.parent.mkdir()
    b_file.write_bytes(b"the frame B delivered")
    with _FrameLease(ctx, job_id, 1, 2) as fresh:
        delivery.deliver_frame(ctx.conn, ctx.settings, spec, job_id, 1, [b_file],
                               fence=fresh.check)  # fmt: skip
    assert ctx.store.finish_frame(job_id, 1, 2) == "ok"
    assert ctx.store.state(job_id) == JobState.DONE
    delivered = {n: v for n, v in _snapshot(out).items() if not n.startswith(".")}
    assert set(delivered) == {"frame_0001.png", "manifest.json"}
    status = ctx.store.status(job_id)

    # A resumes: the fence refuses, and the folder is as B left it (no orphan either)
    resume.set()
    a.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost), outcome
    assert _snapshot(out) == delivered
    assert (out / "frame_0001.png").read_bytes() == b"the frame B delivered"
    assert ctx.store.finish_frame(job_id, 1, 1) == "stale"
    assert ctx.store.status(job_id) == status
