"""Test helpers that run real farm processes: a `farm worker` against the test redis-server,
job submission as `farm submit` does it, and waiting for a job's events."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from farm import jobstore, queue, submission
from farm.accept import accept
from farm.models import Event
from farm.settings import Settings
from farm.storage.local import LocalStorage
from workers.child import BlenderChild


def descendants(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for child in kids:
        out.append(int(child))
        out.extend(descendants(int(child)))
    return out


def _is_blender_child(cmdline: bytes) -> bool:
    """The Blender child's Python process itself, not the sandbox (bwrap, setpriv) around it."""
    argv0 = cmdline.split(b"\0", 1)[0].rsplit(b"/", 1)[-1]
    return b"workers.blender" in cmdline and argv0 not in (b"bwrap", b"setpriv")


#: how long a test waits for its worker to exit after SIGTERM (a render gets FARM_STOP_GRACE_S,
#: 25 s, to finish)
STOP_WAIT_S = 30.0


class WorkerProcess:
    """A real `farm worker` process against the test session's redis-server."""

    def __init__(self, redis_url: str, tmp: Path, name: str = "w1", **env: str) -> None:
        self.name = name
        self.env = {
            **os.environ,
            "FARM_REDIS_URL": redis_url,
            "FARM_STORAGE_DIR": str(tmp / "storage"),
            "FARM_WORK_DIR": str(tmp / "work"),
            **env,
        }
        self.settings = Settings.from_env(self.env)
        self.log_path = tmp / f"{name}.log"
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "farm", "worker", "--name", name],
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def blender_pid(self, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            kids = [
                p
                for p in descendants(self.proc.pid)
                if _is_blender_child(Path(f"/proc/{p}/cmdline").read_bytes())
            ]
            if kids:
                return kids[0]
            time.sleep(0.05)
        raise AssertionError("the worker never started its Blender child")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_logged(self, text: str) -> bool:
        """Whether one of this worker's Blender children has logged ``text`` (their logs sit
        beside its scratch folder, BlenderChild.log_dir): what the child itself is doing."""
        logs = BlenderChild.for_settings(self.settings, self.name).log_dir.glob("*.log")
        return any(text in p.read_text(errors="replace") for p in logs)

    def stop(self) -> None:
        """SIGTERM, as an operator stops a worker. One still running STOP_WAIT_S later is
        killed and the test fails saying so: left running, it would serve the next tests'
        tasks from the session's Redis with this test's storage (every later test failed)."""
        try:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
                    tail = self.log_text().splitlines()[-20:]
                    raise AssertionError(
                        f"worker {self.name} was still running {STOP_WAIT_S:.0f} s after "
                        "SIGTERM (killed); its log's last lines:\n" + "\n".join(tail)
                    ) from None
        finally:
            self.log.close()


def submit(
    settings: Settings, blend: Path, tmp: Path, **kw: object
) -> tuple[jobstore.JobStore, str]:
    """Upload, inspect (a worker must be running) and queue a job through ``accept``, as
    `farm submit` does."""
    store = jobstore.JobStore(jobstore.connect(settings.redis_url), settings.lease_ttl_s)
    q = queue.RenderQueue(queue.connect(settings.redis_url), "cpu")
    source = LocalStorage(settings.storage_dir).put_upload(blend)
    req = submission.RenderRequest(output=tmp / "o", formats="exr", **kw)  # type: ignore[arg-type]
    return store, accept(settings, store, q, req, source, inspect_timeout_s=120).job_id


def wait_for(
    store: jobstore.JobStore,
    job_id: str,
    pred: Callable[[Event], object],
    timeout_s: float = 120,
) -> Event:
    """The first event of the job (from its start) for which ``pred`` holds."""
    deadline, after = time.monotonic() + timeout_s, "0"
    while time.monotonic() < deadline:
        for event in store.events(job_id, after, block_ms=500):
            after = event.id
            if pred(event):
                return event
    raise AssertionError(f"no such event of job {job_id} within {timeout_s} s")


def until(pred: Callable[[], object], timeout_s: float = 30, what: str = "condition") -> None:
    """Wait for ``pred`` to hold (polled every 50 ms), or fail saying what did not happen."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {timeout_s} s")


def blocked_on_a_queue(conn: Any) -> bool:
    """Whether a client of ``conn``'s server waits in a blocking take (an idle worker's BLMOVE
    on its empty queue): what a test waits for before it queues what that worker gets."""
    return any(c.get("cmd") == "blmove" for c in conn.client_list())


async def eventually(pred: Callable[[], object], timeout_s: float, what: str) -> None:
    """``until`` for a test's event loop: polls ``pred`` without stalling the loop."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(0.05)
