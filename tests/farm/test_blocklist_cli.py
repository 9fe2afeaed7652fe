"""`farm blocklist JOB`: the workers that failed a job's tiles, and clearing all or one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from farm import blocklist, cli, jobstore
from tests.web.conftest import make_job, make_web_settings


def test_the_cli_lists_a_jobs_blocklist_and_clears_one_worker_then_all(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("FARM_REDIS_URL", redis_url)
    settings = make_web_settings(redis_url, tmp_path)
    job_id = make_job(settings, "A", tmp_path / "out")
    conn = jobstore.connect(redis_url)
    try:
        for worker in ("host-cpu-1", "host-cpu-2"):
            for _ in range(settings.blocklist_failures):
                blocklist.record_failure(conn, job_id, worker, settings.blocklist_failures)
    finally:
        conn.close()

    def shown(*extra: str) -> dict[str, object]:
        assert cli.main(["blocklist", job_id, "--json", *extra]) == 0
        out: dict[str, object] = json.loads(capsys.readouterr().out)
        return out

    listed = shown()
    assert [(w["worker"], w["blocklisted"]) for w in listed["workers"]] == [  # type: ignore[attr-defined]
        ("host-cpu-1", True), ("host-cpu-2", True)]  # fmt: skip
    one = shown("--clear", "host-cpu-1")
    assert one["cleared"] == 1
    assert [w["worker"] for w in one["workers"]] == ["host-cpu-2"]  # type: ignore[attr-defined]
    assert cli.main(["blocklist", job_id, "--clear"]) == 0
    assert "1 blocklisted worker(s) cleared" in capsys.readouterr().err
    assert cli.main(["blocklist", job_id]) == 0
    assert "no worker failed its tiles" in capsys.readouterr().out
    assert cli.main(["blocklist", "20261201-000000-00000000"]) == 3, "no such job"
