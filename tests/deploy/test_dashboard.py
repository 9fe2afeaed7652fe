"""deploy/grafana: the dashboard queries only metrics Tessera exports, and shows each of them."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from farm import metrics
from tests.deploy.consistency import DEPLOY

_NAME = re.compile(r"\b((?:tessera|process)_[a-z0-9_]+)")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data = json.loads((DEPLOY / "grafana" / "tessera-dashboard.json").read_text())
    assert isinstance(data, dict)
    return data


def _exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_query_names_an_exported_metric(dashboard: dict[str, Any]) -> None:
    exported = metrics.exported_names()
    used = {name for expr in _exprs(dashboard) for name in _NAME.findall(expr)}
    assert used, "the dashboard queries nothing"
    assert used <= exported, f"not exported by farm.metrics: {sorted(used - exported)}"


def test_the_dashboard_shows_render_device_gpu_stream_and_usage_metrics(
    dashboard: dict[str, Any],
) -> None:
    text = " ".join(_exprs(dashboard))
    for name in (
        "tessera_queue_depth", "tessera_tiles_rendered_total", "tessera_tiles_failed_total",
        "tessera_tile_duration_seconds_bucket", "tessera_job_duration_seconds_bucket",
        "tessera_device_vram_used_bytes", "tessera_device_encoder_sessions_used",
        "tessera_device_leases", "tessera_gpu_utilization_percent",
        "tessera_gpu_memory_used_bytes", "tessera_gpu_power_watts", "tessera_gpu_energy_joules",
        "tessera_stream_sessions", "tessera_stream_fps", "tessera_stream_bitrate_bits_per_second",
        "tessera_stream_round_trip_distribution_seconds_bucket",
        "tessera_usage_device_seconds_total", "tessera_usage_energy_joules_total",
    ):  # fmt: skip
        assert re.search(rf"\b{name}\b", text), f"no panel shows {name}"


def test_panels_fit_the_grid_and_grafana_provisions_the_dashboard(
    dashboard: dict[str, Any],
) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        mine = {(x, y) for x in xs for y in ys}
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "tessera.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
