"""Estimates on a real farm: the inspection's probe prices a job before it is submitted (API
and CLI), a project's budget refuses a job over what is left (API 402, CLI exit 5), and a done
job's estimate is checked against its tasks' render times."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess
from tests.test_cli import farm
from tests.web.conftest import Tokens, api, bearer, wait_for_worker
from tests.web.test_render_api import RENDER_TIMEOUT_S, read_events

#: one device-second costs one unit: costs read as seconds
PRICES = '{"cpu": 3600}'


async def test_estimate_budget_and_estimate_against_actual(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    settings = web_settings.with_(usage_prices=PRICES)
    blend = make_scene(tmp_path / "scene.blend", frame_end=2, samples=16)
    env = {"FARM_ESTIMATE_PROBE_S": "0.3", "FARM_USAGE_PRICES": PRICES}
    worker = WorkerProcess(settings.redis_url, tmp_path, name="estimates", **env)
    alice, root = bearer(tokens.alice), bearer(tokens.admin)
    try:
        wait_for_worker(settings.redis_url)
        async with api(settings) as client:
            sent = await client.put(
                "/api/uploads/scene.blend?project=A", data=blend.read_bytes(), headers=alice
            )
            upload = await sent.json()
            body = {"project": "A", "upload_id": upload["upload_id"], "tiles": "2x1"}
            resp = await client.post("/api/jobs/estimate", json=body, headers=alice)
            assert resp.status == 200, await resp.text()
            quoted = await resp.json()
            (cpu,) = quoted["estimate"]["classes"]
            assert quoted["estimate"]["probe_class"] == "cpu" and quoted["estimate"]["frames"] == 2
            assert cpu["frame_s"] > 0 and cpu["devices"] == 1 and cpu["wall_s"] > 0
            assert cpu["cost"] == pytest.approx(cpu["device_s"], abs=1e-3)
            assert cpu["energy_kwh"] > 0 and cpu["co2e_kg"] > 0
            assert quoted["budget"] is None

            # a budget below the estimate: refused with the numbers, nothing queued
            small = cpu["cost"] / 2
            limit = {"amount": small, "period": "30d"}
            put = await client.put("/api/projects/A/budget", json=limit, headers=root)
            assert put.status == 200, await put.text()
            refused = await client.post("/api/jobs", json=body, headers=alice)
            assert refused.status == 402, await refused.text()
            err = (await refused.json())["error"]
            assert err["code"] == "over_budget"
            assert err["estimate"] == pytest.approx(cpu["cost"], rel=0.01)
            assert err["left"] == pytest.approx(small, rel=0.01)
            assert "budget" in err["message"]
            listed = await (await client.get("/api/jobs?project=A", headers=alice)).json()
            assert listed["jobs"] == []

            # the CLI: the estimate table, then the same refusal as exit 5
            cli_env = {**worker.env, **env, "FARM_LOG_LEVEL": "WARNING"}
            args = ("--project", "A", "--tiles", "2x1", "--output", str(tmp_path / "cli-out"))
            shown = await asyncio.to_thread(
                farm, "submit", str(blend), *args, "--estimate", cwd=tmp_path, env=cli_env
            )
            assert shown.returncode == 0, shown.stderr
            assert "cpu" in shown.stdout and "s/FRAME" in shown.stdout
            assert "left of" in shown.stdout and "nothing was queued" in shown.stderr
            over = await asyncio.to_thread(
                farm, "submit", str(blend), *args, cwd=tmp_path, env=cli_env
            )
            assert over.returncode == 5, over.stderr
            assert "farm: error: the job's estimated cost" in over.stderr
            assert "budget" in over.stderr

            # room in the budget: queued, rendered, and its estimate checked
            await client.put("/api/projects/A/budget", json={"amount": 1e6}, headers=root)
            made = await client.post("/api/jobs", json=body, headers=alice)
            assert made.status == 201, await made.text()
            job_id = (await made.json())["job_id"]
            async with client.get(f"/api/jobs/{job_id}/events", headers=alice) as events:
                await asyncio.wait_for(read_events(events), RENDER_TIMEOUT_S)
            job = await (await client.get(f"/api/jobs/{job_id}", headers=alice)).json()
            assert job["state"] == "done", worker.log_text()
            assert job["estimate"]["classes"][0]["render_s"] == pytest.approx(cpu["render_s"])
            actual = job["estimate_actual"]
            assert actual["device_class"] == "cpu" and actual["actual_s"] > 0
            assert actual["error"] == pytest.approx(
                (actual["estimated_s"] - actual["actual_s"]) / actual["actual_s"], abs=1e-3
            )
            assert math.isfinite(actual["error"])
            errors = await (await client.get("/api/estimates/errors", headers=alice)).json()
            (row,) = errors["errors"]
            assert row["job"] == job_id and float(row["error"]) == pytest.approx(actual["error"])
            # Bob, of another project, sees none of A's records
            other = await client.get("/api/estimates/errors", headers=bearer(tokens.bob))
            assert (await other.json())["errors"] == []
            status = await asyncio.to_thread(
                farm, "status", job_id, "--json", cwd=tmp_path, env=cli_env
            )
            assert json.loads(status.stdout)["estimate_actual"] == actual
    finally:
        worker.stop()
