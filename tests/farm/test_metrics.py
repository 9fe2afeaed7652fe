"""/metrics: a render worker's tile counts and durations after a real job, the farm-wide gauges
the web exports (queue depth, device capacity and use, leases, usage), the NVML gauges a device
agent sets, and the stream service's per-session series."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from farm import metrics
from farm.alloc import usage
from farm.alloc.agent import DeviceAgent
from farm.alloc.allocator import Request, SlotAllocator
from farm.gpu.fake import FakeNvml
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess, submit, until, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

#: the worker's agent timeout: its device is down this long after its last beat
AGENT_TIMEOUT_S = 5.0


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def names(samples: Samples) -> set[str]:
    return {name for name, _labels in samples}


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(resp.read().decode())


@pytest.fixture
def farm_metrics(redis_url: str) -> Iterator[Settings]:
    settings = Settings(redis_url=redis_url)
    metrics.register_farm_collector(settings)
    yield settings
    metrics.unregister_farm_collector()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_after_a_job_the_worker_and_farm_metrics_count_its_tiles_time_and_usage(
    redis_url: str, tmp_path: Path, farm_metrics: Settings
) -> None:
    scene = make_scene(tmp_path / "small.blend", width=32, height=24, samples=4)
    port = _free_port()
    w = WorkerProcess(
        redis_url, tmp_path, FARM_METRICS_PORT=str(port), FARM_AGENT_TIMEOUT_S=str(AGENT_TIMEOUT_S)
    )
    try:
        store, job_id = submit(w.settings, scene, tmp_path, tiles="2x1")
        wait_for(store, job_id, lambda e: e.type == "job_state" and e.state == "done")
        # the worker counts the job just after its last frame says done: wait for the count
        worker: Samples = {}

        def counted() -> bool:
            nonlocal worker
            worker = scrape(f"http://127.0.0.1:{port}/metrics")
            return any(
                n == "tessera_job_duration_seconds_count" and ("state", "done") in labels
                for n, labels in worker
            )

        until(counted, 10, "the worker counting the job")
        running = parse(metrics.exposition()[0].decode())
    finally:
        w.stop()
    assert value(worker, "tessera_tiles_rendered_total", device_class="cpu") == 2
    assert value(worker, "tessera_tile_duration_seconds_count", device_class="cpu") == 2
    tile_s = value(worker, "tessera_tile_duration_seconds_sum", device_class="cpu")
    status = store.status(job_id)
    job_s = (status.finished_s or 0) - status.created_s
    assert 0 < tile_s < 2 * job_s
    assert value(worker, "tessera_job_duration_seconds_count", state="done") == 1
    assert value(worker, "tessera_job_duration_seconds_sum", state="done") == pytest.approx(
        job_s, abs=0.01
    )
    assert "tessera_tiles_failed_total" not in names(worker)  # no failure, no series
    assert value(worker, "process_resident_memory_bytes") > 0

    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain")
    farm = parse(body.decode())
    assert value(farm, "tessera_farm_up") == 1
    assert value(farm, "tessera_queue_depth", queue="tessera-render-cpu") == 0
    device = {"device_class": "cpu"}
    assert value(farm, "tessera_device_render_slots", **device) >= 1
    assert value(farm, "tessera_device_render_slots_used", **device) == 0
    assert value(farm, "tessera_device_vram_bytes", **device) > 2**20
    assert value(farm, "tessera_device_leases", kind="render", **device) == 0
    # up while its worker ran; down once the stopped worker's agent timeout has passed
    assert value(running, "tessera_device_up", **device) == 1

    def device_up() -> float:
        return value(parse(metrics.exposition()[0].decode()), "tessera_device_up", **device)

    until(lambda: device_up() == 0, AGENT_TIMEOUT_S + 10, "the stopped worker's device going down")
    # usage: the job's two leases, charged to its project, as the records say
    recorded = usage.records(store.conn, "default")
    assert len(recorded) == 2 and {r.job for r in recorded} == {job_id}
    leased_s = sum(r.seconds for r in recorded)
    assert 0 < leased_s < job_s + 1
    assert value(
        farm, "tessera_usage_device_seconds_total", project="default", kind="render", **device
    ) == pytest.approx(leased_s)
    assert value(farm, "tessera_usage_energy_joules_total", project="default", **device) > 0


def test_a_pending_tile_shows_in_the_queue_depth_and_a_lease_on_its_device(
    redis_url: str, farm_metrics: Settings
) -> None:
    from farm import queue
    from farm.models import TileTask

    rq_conn = queue.connect(redis_url)
    q = queue.RenderQueue(rq_conn, "gpu")
    q.stage_tiles([TileTask("j1", 1, i, 1) for i in range(3)], 60)
    nvml = FakeNvml(["l4"])
    alloc = SlotAllocator(redis.Redis.from_url(redis_url, decode_responses=True))
    agent = DeviceAgent(Settings(nvml="fake:l4"), alloc, "agent-1", nvml=nvml)
    agent.beat()
    alloc.acquire("s1", Request("stream", encoder_sessions=1, vram_mib=1024))
    farm = parse(metrics.exposition()[0].decode())
    assert value(farm, "tessera_queue_depth", queue="tessera-render-gpu") == 3
    l4 = {"device_class": "l4"}
    assert value(farm, "tessera_device_leases", kind="stream", **l4) == 1
    assert value(farm, "tessera_device_encoder_sessions_used", **l4) == 1
    assert value(farm, "tessera_device_encoder_sessions", **l4) == 16  # 2 NVENC x 8
    assert value(farm, "tessera_device_vram_used_bytes", **l4) == 1024 * 2**20
    assert value(farm, "tessera_device_up", **l4) == 1
    rq_conn.close()


def test_a_device_agent_exports_nvml_gauges_and_charges_measured_energy_to_leases(
    redis_url: str,
) -> None:
    nvml = FakeNvml(["t4"])
    nvml.set_usage(0, utilization_pct=73, memory_used_mib=4096, power_w=61.5, energy_j=10_000)
    alloc = SlotAllocator(redis.Redis.from_url(redis_url, decode_responses=True))
    agent = DeviceAgent(Settings(nvml="fake:t4"), alloc, "agent-t4", nvml=nvml)
    agent.beat()
    lease = alloc.acquire("w", Request("render", render_slots=1, project="p", job="j"))
    own = parse(metrics.exposition()[0].decode())
    t4 = {"device": agent.devices[0].id}
    assert value(own, "tessera_gpu_utilization_percent", **t4) == 73
    assert value(own, "tessera_gpu_memory_used_bytes", **t4) == 4096 * 2**20
    assert value(own, "tessera_gpu_memory_total_bytes", **t4) == 15360 * 2**20
    assert value(own, "tessera_gpu_power_watts", **t4) == 61.5
    assert value(own, "tessera_gpu_energy_joules", **t4) == 10_000
    assert value(own, "tessera_gpu_encoder_sessions", **t4) == 0
    # the GPU burns 700 J while the lease is held: the lease is charged exactly that
    nvml.set_usage(0, energy_j=10_700)
    agent.beat()
    alloc.release(lease)
    (record,) = usage.records(alloc.conn, "p")
    assert record.energy_j == pytest.approx(700) and record.device_class == "t4"
    assert record.job == "j" and record.why == "released"


def test_stream_series_come_and_go_with_their_session() -> None:
    metrics.STREAM_SESSIONS.labels("gpu-0", "libx264").set(1)
    metrics.STREAM_FPS.labels("sess-1").set(59.8)
    metrics.STREAM_BITRATE.labels("sess-1").set(4_000_000)
    metrics.observe_round_trip("sess-1", 0.021)
    metrics.STREAM_FRAMES.labels("libx264").inc(120)
    live = parse(metrics.exposition()[0].decode())
    assert value(live, "tessera_stream_fps", session="sess-1") == 59.8
    assert value(live, "tessera_stream_bitrate_bits_per_second", session="sess-1") == 4e6
    assert value(live, "tessera_stream_round_trip_seconds", session="sess-1") == 0.021
    assert value(live, "tessera_stream_round_trip_distribution_seconds_count") >= 1
    assert value(live, "tessera_stream_sessions", encoder="libx264") == 1
    metrics.forget_stream_session("sess-1")
    ended = parse(metrics.exposition()[0].decode())
    assert not [n for n, ls in ended if ("session", "sess-1") in ls]


def test_a_worker_metrics_server_serves_on_a_free_port_and_stops() -> None:
    server = metrics.start_metrics_server(0)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", server.url)
        assert value(scrape(server.url), "process_start_time_seconds") < time.time()
    finally:
        server.stop()


def test_redis_away_reads_as_farm_down_not_a_failed_scrape() -> None:
    metrics.register_farm_collector(Settings(redis_url=f"redis://127.0.0.1:{_free_port()}/0"))
    t0 = time.monotonic()
    try:
        farm = parse(metrics.exposition()[0].decode())
    finally:
        metrics.unregister_farm_collector()
    assert value(farm, "tessera_farm_up") == 0
    # within Prometheus' default scrape timeout (10 s), or the scrape fails instead
    assert time.monotonic() - t0 < 10
