"""A failed tile's own log (Blender's log tail, server detail) is read by the job's project only."""

from __future__ import annotations

import asyncio
from pathlib import Path

from farm import jobstore
from farm.accounts import Accounts
from farm.settings import Settings
from farm.storage.layout import tile_log_key
from farm.storage.local import LocalStorage
from tests.web.conftest import api, bearer, make_job


def test_a_tile_log_is_read_by_the_jobs_project_and_nobody_else(
    redis_url: str, tmp_path: Path
) -> None:
    settings = Settings().with_(
        redis_url=redis_url, storage_dir=tmp_path / "storage", work_dir=tmp_path / "work"
    )
    conn = jobstore.connect(redis_url)
    accounts = Accounts(conn)
    accounts.set_role("alice", "A", "member")
    accounts.set_role("bob", "B", "member")
    alice, bob = accounts.create_token("alice").token, accounts.create_token("bob").token
    conn.close()
    job_id = make_job(settings, "A", tmp_path / "out")
    story = "Blender's log (last lines):\nRead blend: /var/lib/tessera/blends/ab/files/x.blend\n"
    LocalStorage(settings.storage_dir).put_bytes(tile_log_key(job_id, 1, 0, 1), story.encode())
    url = f"/api/jobs/{job_id}/tiles/1/0/attempts/1/log"

    async def go() -> None:
        async with api(settings) as client:
            mine = await client.get(url, headers=bearer(alice))
            assert mine.status == 200 and await mine.text() == story
            assert mine.content_type == "text/plain"
            # another project's member: as though the job did not exist
            theirs = await client.get(url, headers=bearer(bob))
            assert theirs.status == 404
            assert "x.blend" not in await theirs.text()
            assert (await client.get(url)).status == 401
            attempt_2 = await client.get(url.replace("/1/log", "/2/log"),
                                         headers=bearer(alice))  # fmt: skip
            assert attempt_2.status == 404 and "once it ended" in await attempt_2.text()
            bad = await client.get(url.replace("/1/log", "/x/log"), headers=bearer(alice))
            assert bad.status == 400

    asyncio.run(go())
