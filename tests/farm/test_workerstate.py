"""The workers' registry against the real Redis, and the reasons a queued job is given."""

from __future__ import annotations

import time

import pytest
import redis

from farm import keys
from farm.errors import NotFound, NoWorker
from farm.queuewhy import explain, inspecting_kind, require_worker
from farm.workerstate import (
    Reporter,
    WorkerInfo,
    WorkerRegistry,
    WorkerState,
    render_text,
    state_of,
    utc_day,
)

SILENT_S = 30.0
RETENTION_S = 3600.0


@pytest.fixture
def registry(rconn: redis.Redis) -> WorkerRegistry:
    return WorkerRegistry(rconn, silent_s=SILENT_S, retention_s=RETENTION_S)


def _identity(queue: str = "cpu", device_class: str = "cpu") -> dict[str, object]:
    return {"kind": "render", "host": "h1", "pid": 42, "queue": queue, "device_id": "cpu-h1",
            "device_class": device_class, "model": device_class}  # fmt: skip


def test_state_is_silence_first_then_the_operators_flag_then_the_work() -> None:
    assert state_of("rendering", False, 5, SILENT_S) is WorkerState.RENDERING
    assert state_of("rendering", True, 5, SILENT_S) is WorkerState.DRAINING
    assert state_of("idle", True, 5, SILENT_S) is WorkerState.DISABLED
    assert state_of("rendering", True, 31, SILENT_S) is WorkerState.SILENT
    assert state_of("what", False, 1, SILENT_S) is WorkerState.IDLE


def test_a_workers_task_counters_and_disabled_flag_as_read_back(
    registry: WorkerRegistry,
) -> None:
    registry.beat("w1", _identity())
    (w,) = registry.list()
    assert (w.name, w.state, w.host, w.pid, w.queue, w.job) == ("w1", "idle", "h1", 42, "cpu", "")
    registry.start_task("w1", "rendering", task="tile", job="j1", project="A", frame=3, tile=1,
                        lease="L1")  # fmt: skip
    w = registry.list()[0]
    assert (w.state, w.job, w.project, w.frame, w.tile, w.lease) == (
        WorkerState.RENDERING, "j1", "A", 3, 1, "L1")  # fmt: skip
    assert registry.set_disabled("w1", True, "root").state is WorkerState.DRAINING
    registry.end_task("w1")
    registry.count("w1", "done")
    registry.count("w1", "done")
    registry.count("w1", "failed")
    w = registry.list()[0]
    assert (w.state, w.job, w.frame, w.disabled_by) == (WorkerState.DISABLED, "", None, "root")
    assert (w.tiles_done_today, w.tiles_failed_today) == (2, 1)
    assert registry.set_disabled("w1", False).state is WorkerState.IDLE
    with pytest.raises(NotFound):
        registry.set_disabled("nobody", True)
    # a stream service drains too (it starts no new session: encoder.service)
    registry.beat("s1", {**_identity(), "kind": "stream", "activity": "streaming"})
    assert registry.set_disabled("s1", True).state is WorkerState.DRAINING
    assert "w1" in render_text(registry.list())[1]


def test_outcomes_counted_during_a_task_are_written_with_its_end(
    registry: WorkerRegistry, rconn: redis.Redis
) -> None:
    registry.beat("w1", _identity())
    report = Reporter(registry, "w1")
    with report.activity("rendering", task="tile", job="j1", frame=1, tile=0):
        report.count("done")
        # not yet: the count goes with the end of the task, in its round trip
        assert registry.list()[0].tiles_done_today == 0
        assert registry.list()[0].state is WorkerState.RENDERING
    w = registry.list()[0]
    assert (w.state, w.job, w.tiles_done_today) == (WorkerState.IDLE, "", 1)
    report.count("failed")  # outside a task: written at once
    with report.activity("assembling", task="assembly", job="j1", frame=1):
        report.count("done")
        report.count("failed")
    w = registry.list()[0]
    assert (w.tiles_done_today, w.tiles_failed_today) == (2, 2)
    assert rconn.ttl(keys.worker_tiles("w1", utc_day(time.time()))) > 0  # today's counters


def test_a_silent_worker_shows_silent_and_one_gone_past_retention_is_trimmed(
    registry: WorkerRegistry, rconn: redis.Redis
) -> None:
    now = time.time()
    registry.beat("old", _identity(), now=now - RETENTION_S - 5)
    registry.set_disabled("old", True)
    registry.beat("quiet", _identity(), now=now - SILENT_S - 5)
    assert {w.name: w.state for w in registry.list()} == {
        "old": WorkerState.SILENT, "quiet": WorkerState.SILENT}  # fmt: skip
    registry.beat("w1", _identity(), now=now)  # a beat trims what is past the retention
    assert [w.name for w in registry.list()] == ["quiet", "w1"]
    assert rconn.zscore(keys.WORKERS, "old") is None
    assert not rconn.exists(keys.worker("old")) and not rconn.hexists(keys.WORKERS_DISABLED, "old")
    assert 0 < rconn.ttl(keys.worker("w1")) <= RETENTION_S


def _worker(name: str, queue: str, state: WorkerState, *, disabled: bool = False,
            device_class: str = "") -> WorkerInfo:  # fmt: skip
    return WorkerInfo(name=name, kind="render", host="h", pid=1, queue=queue, device_id=name,
                      device_class=device_class or queue, model="", state=state,
                      last_beat=0.0, started=0.0, disabled=disabled)  # fmt: skip


def test_a_gpu_job_with_only_a_cpu_worker_is_told_no_gpu_worker_is_online() -> None:
    cpu = [_worker("c1", "cpu", WorkerState.IDLE), _worker("c2", "cpu", WorkerState.RENDERING)]
    why = explain("gpu", cpu)
    assert why.reason == "no_worker"
    assert why.message.startswith("no GPU worker online: 1 CPU worker idle")
    assert explain("gpu", []).message.startswith(
        "no GPU worker online: no render worker is online at all"
    )
    gone = [_worker("g1", "gpu", WorkerState.SILENT, device_class="t4")]
    assert explain("gpu", gone).reason == "no_worker"


def test_busy_disabled_and_forbidden_workers_each_give_their_reason() -> None:
    t4 = [_worker("g1", "gpu", WorkerState.RENDERING, device_class="t4")]
    busy = explain("gpu", t4, tasks_ahead=3)
    assert (busy.reason, busy.tasks_ahead) == ("busy", 3)
    assert busy.message == "the only GPU worker is busy; 3 tasks ahead of it"
    two = [*t4, _worker("g2", "gpu", WorkerState.DRAINING, disabled=True, device_class="t4")]
    assert explain("gpu", two).message == "the only GPU worker is busy"
    off_two = [_worker(n, "gpu", WorkerState.DISABLED, disabled=True) for n in ("g1", "g2")]
    assert explain("gpu", off_two).message.startswith(
        "all 2 GPU workers online are disabled by an operator"
    )
    off = [_worker("g1", "gpu", WorkerState.DISABLED, disabled=True, device_class="t4")]
    assert explain("gpu", off).reason == "all_disabled"
    forbidden = explain("gpu", t4, allowed=("cpu", "a100"))
    assert forbidden.reason == "policy" and "online GPU workers are t4" in forbidden.message
    assert explain("gpu", t4, allowed=("gpu",)).reason == "busy"
    idle = [_worker("g1", "gpu", WorkerState.IDLE, device_class="t4")]
    assert explain("gpu", idle).reason == "starting"


def test_an_inspection_goes_to_a_worker_that_takes_work_or_is_refused_at_once() -> None:
    cpu_idle = _worker("c1", "cpu", WorkerState.IDLE)
    gpu_busy = _worker("g1", "gpu", WorkerState.RENDERING, device_class="t4")
    assert inspecting_kind([cpu_idle], "gpu") == "cpu"
    assert inspecting_kind([cpu_idle, gpu_busy], "gpu") == "cpu", "an idle worker first"
    assert inspecting_kind([gpu_busy], None) == "gpu"
    off = _worker("c1", "cpu", WorkerState.DISABLED, disabled=True)
    with pytest.raises(NoWorker, match="disabled by an operator"):
        inspecting_kind([off], None)
    with pytest.raises(NoWorker, match="no GPU worker online: 1 CPU worker idle"):
        require_worker([cpu_idle], "gpu")
    require_worker([cpu_idle], "cpu")
