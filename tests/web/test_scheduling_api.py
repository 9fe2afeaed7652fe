"""The scheduling options and a job's blocklist through the web API: bad tags and dependencies
refused with a 400 naming them, the blocklist shown to the job's project and cleared by a
member (another project's job is 404, a viewer may not clear it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from farm import blocklist, jobstore, keys
from farm.settings import Settings
from tests.web.conftest import SHA, Tokens, api, bearer, make_job, scene_report
from web import intake
from web.intake import Stored


def _uploaded(settings: Settings, project: str) -> None:
    """An upload of ``project`` with its inspection report cached: a job can be submitted."""
    conn = jobstore.connect(settings.redis_url)
    try:
        stored = Stored(SHA, 100, "blend", f"uploads/{SHA}/upload.blend", "b.blend", [])
        intake.record(conn, project, stored, "b.blend", "alice")
        conn.set(keys.inspection(SHA), json.dumps(scene_report().to_dict()))
    finally:
        conn.close()


async def test_tags_dependencies_and_frame_order_through_the_api(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    foreign = make_job(web_settings, "B", tmp_path / "b")
    first = make_job(web_settings, "A", tmp_path / "a")
    unknown = "20261201-000000-00000000"
    _uploaded(web_settings, "A")
    async with api(web_settings) as client:
        alice = bearer(tokens.alice)
        cases: list[tuple[dict[str, Any], str]] = [
            ({"tags": "Big RAM"}, "tag 'Big RAM' must be 1 to 32 lower-case"),
            ({"depends_on": [foreign]}, f"there is no job {foreign} in project A"),
            ({"depends_on": unknown}, f"there is no job {unknown} in project A"),
            ({"depends_on": "not-a-job"}, "'not-a-job' is not a job id"),
            ({"frame_order": "backwards"}, "frame order 'backwards'"),
        ]
        for extra, says in cases:
            body = {"project": "A", "upload_id": SHA, **extra}
            resp = await client.post("/api/jobs", json=body, headers=alice)
            assert resp.status == 400, await resp.text()
            assert says in (await resp.json())["error"]["message"]
        good: dict[str, Any] = {"project": "A", "upload_id": SHA, "tags": ["big", "lic"]}
        good.update(depends_on=[first], frame_order="first-last-middle")
        resp = await client.post("/api/jobs", json=good, headers=alice)
        assert resp.status == 201, await resp.text()
        job = await resp.json()
        assert job["state"] == "waiting"
        assert (job["spec"]["tags"], job["spec"]["depends_on"]) == (["big", "lic"], [first])
        assert job["spec"]["frame_order"] == "first-last-middle"
        waiting = await (await client.get("/api/jobs?state=waiting", headers=alice)).json()
        assert [j["job_id"] for j in waiting["jobs"]] == [job["job_id"]]


async def test_the_blocklist_is_shown_to_the_project_and_cleared_by_a_member(
    web_settings: Settings, tokens: Tokens, tmp_path: Path
) -> None:
    job_id = make_job(web_settings, "A", tmp_path / "o")
    conn = jobstore.connect(web_settings.redis_url)
    try:
        for _ in range(web_settings.blocklist_failures):
            blocklist.record_failure(conn, job_id, "host-cpu-1", web_settings.blocklist_failures)
        blocklist.record_failure(conn, job_id, "host-cpu-2", web_settings.blocklist_failures)
    finally:
        conn.close()
    path = f"/api/jobs/{job_id}/blocklist"
    async with api(web_settings) as client:
        shown = await (await client.get(path, headers=bearer(tokens.vera))).json()
        assert shown["failures_to_block"] == 3
        assert [(w["worker"], w["failures"], w["blocklisted"]) for w in shown["workers"]] == [
            ("host-cpu-1", 3, True),
            ("host-cpu-2", 1, False),
        ]
        assert (await client.get(path, headers=bearer(tokens.bob))).status == 404
        assert (await client.delete(path, headers=bearer(tokens.bob))).status == 404
        assert (await client.delete(path, headers=bearer(tokens.vera))).status == 403
        cleared = await client.delete(path, headers=bearer(tokens.alice))
        assert cleared.status == 200
        body = await cleared.json()
        assert (body["cleared"], body["workers"]) == (1, [])
        logs = await (
            await client.get(f"/api/jobs/{job_id}/logs", headers=bearer(tokens.alice))
        ).json()
        assert any("blocklist cleared by alice" in line for line in logs["lines"])
