"""The farm-wide metrics (read from Redis) come from the one web that is told to export them:
with several web replicas each would export them and sums would count them once per replica."""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from farm.metrics import FARM_FAMILIES
from farm.settings import Settings
from web.app import create_app

TOKEN = "scrape-secret"


async def _scrape(settings: Settings) -> str:
    async with TestClient(TestServer(create_app(settings))) as client:
        resp = await client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert resp.status == 200
        return await resp.text()


def test_only_a_web_with_farm_metrics_on_exports_them(redis_url: str, tmp_path: Path) -> None:
    settings = Settings().with_(
        redis_url=redis_url, storage_dir=tmp_path, work_dir=tmp_path, metrics_token=TOKEN
    )
    exporter = asyncio.run(_scrape(settings))
    replica = asyncio.run(_scrape(settings.with_(web_farm_metrics="off")))
    exported = {name for name in FARM_FAMILIES if f"# TYPE {name}" in exporter}
    assert exported == set(FARM_FAMILIES), exporter
    assert not [name for name in FARM_FAMILIES if name in replica], replica
    # the replica's own metrics are still there
    assert "process_cpu_seconds_total" in replica
