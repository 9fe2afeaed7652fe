"""The Blender add-on: its HTTP client against the real web app, its zip, its install in bpy."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import redis
from aiohttp import web

from farm import jobstore
from farm.redisserver import RedisServer
from farm.settings import Settings
from tests.blendscenes import make_scene
from tests.farmprocs import WorkerProcess
from tests.web.conftest import wait_for_worker

REPO = Path(__file__).resolve().parents[2]
ADDON = REPO / "addon"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# the add-on's client is pure Python: it is tested as Blender will load it, from its own folder
client = _load("tessera_addon_client", ADDON / "tessera_submit" / "client.py")
build_zip = _load("tessera_addon_build", ADDON / "build_zip.py")


class LiveWeb:
    """The real web app on 127.0.0.1:<free port>, served by a thread running its own event loop.

    Everything asyncio happens in that thread, so callers may run their own loop (Playwright's
    sync API does) in the main thread.
    """

    def __init__(
        self,
        settings: Settings,
        start_timeout_s: float = 30,
        app: Callable[[Settings], web.Application] | None = None,
    ) -> None:
        self.settings = settings
        #: the app to serve: the web (default), or the front door of a farm in cells
        self.app = app
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="live-web", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout_s):
            raise AssertionError(f"the web app did not start within {start_timeout_s} s")
        if self._error is not None:
            self._thread.join(10)
            raise self._error

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        from web.app import create_app

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        runner = web.AppRunner((self.app or create_app)(self.settings))
        try:
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        except BaseException as e:
            self._error = e
            self._ready.set()
            await runner.cleanup()
            return
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def member_token(redis_url: str, user: str = "blender-artist", project: str = "shorts") -> str:
    from farm.accounts import Accounts

    conn = jobstore.connect(redis_url)
    try:
        accounts = Accounts(conn)
        accounts.set_role(user, project, "member")
        return accounts.create_token(user).token
    finally:
        conn.close()


@pytest.fixture(scope="module")
def farm(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveWeb, str, Path]]:
    """Web app + one real render worker (it runs inspections) + a member token + a tiny scene."""
    tmp = tmp_path_factory.mktemp("addon-farm")
    conn = redis.Redis.from_url(redis_server.url)
    conn.flushall()
    blend = make_scene(tmp / "shot.blend", width=48, height=32, samples=2, frame_end=3)
    worker = WorkerProcess(redis_server.url, tmp)
    try:
        wait_for_worker(redis_server.url)
        live = LiveWeb(worker.settings)
        try:
            yield live, member_token(redis_server.url), blend
        finally:
            live.close()
    finally:
        worker.stop()
        conn.flushall()
        conn.close()


def test_frames_text_is_the_scenes_range_in_farm_syntax() -> None:
    assert client.frames_text(1, 250) == "1-250"
    assert client.frames_text(1, 250, 5) == "1-250x5"
    assert client.frames_text(7, 7) == "7"
    assert client.frames_text(-5, 5) == "-5..5"
    with pytest.raises(ValueError, match="ends before it starts"):
        client.frames_text(10, 1)


def test_bad_farm_url_and_empty_token_are_refused_before_any_request() -> None:
    with pytest.raises(client.FarmClientError, match="not an http"):
        client.FarmClient("farm.example:8080", "tok")
    with pytest.raises(client.FarmClientError, match="no access token"):
        client.FarmClient("http://farm.example", "  ")


def test_wrong_token_is_told_apart_from_an_unreachable_farm(
    farm: tuple[LiveWeb, str, Path],
) -> None:
    live, _token, _blend = farm
    with pytest.raises(client.FarmClientError, match="refused the access token") as bad:
        client.FarmClient(live.url, "tsr_not-a-token").me()
    assert bad.value.status == 401
    # a port nothing listens on (discard, 9): the farm is down, not the token wrong
    with pytest.raises(client.FarmClientError, match="cannot reach the farm") as gone:
        client.FarmClient("http://127.0.0.1:9", "tsr_x", timeout_s=5).me()
    assert gone.value.code == "unreachable"


def test_upload_in_chunks_resumes_where_the_server_is(
    farm: tuple[LiveWeb, str, Path], tmp_path: Path
) -> None:
    live, token, blend = farm
    path = tmp_path / "renamed.blend"
    path.write_bytes(blend.read_bytes())
    size = path.stat().st_size
    farm_client = client.FarmClient(live.url, token)
    seen: list[int] = []
    # a session whose first chunk already arrived (as after a dropped connection) ...
    session = farm_client.request(
        "POST",
        "/api/uploads/sessions",
        json_body={"project": "shorts", "name": path.name, "size": size},
    )
    sid = session["session_id"]
    farm_client.request(
        "PATCH",
        f"/api/uploads/sessions/{sid}",
        data=path.read_bytes()[:10_000],
        headers={"Upload-Offset": "0"},
    )
    # ... is resumed from byte 0 by a client that does not know: the server's 409 puts it right
    upload = farm_client.resume_upload(
        str(path), sid, 0, lambda _s, done, _t: seen.append(done), chunk_bytes=32_768
    )
    assert upload["upload_id"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert upload["size"] == size and upload["name"] == "renamed.blend"
    assert seen[0] == 10_000 + 32_768 and seen[-1] == size


def test_submit_blend_uploads_inspects_and_queues_the_scenes_frames(
    farm: tuple[LiveWeb, str, Path],
) -> None:
    live, token, blend = farm
    farm_client = client.FarmClient(live.url, token)
    stages: list[str] = []
    options = client.SubmitOptions(frames="1-3", tiles="2x1", samples=2, formats="png", priority=3)
    done = farm_client.submit_blend(
        str(blend), options, progress=lambda stage, _d, _t: stages.append(stage)
    )
    assert stages[0] == "upload" and stages[-2:] == ["inspect", "submit"]
    assert done.job_url == f"{live.url}/jobs/{done.job_id}"
    job = farm_client.job(done.job_id)
    assert job["spec"]["frames"] == [1, 2, 3]
    assert job["spec"]["tiles"] == "2x1"
    assert job["spec"]["project"] == "shorts"
    assert job["priority"] == 3
    farm_client.request("POST", f"/api/jobs/{done.job_id}/cancel")


def test_built_zip_holds_the_package_at_its_root(tmp_path: Path) -> None:
    out = build_zip.build(tmp_path / "dist" / "tessera_submit.zip")
    with zipfile.ZipFile(out) as zf:
        names = sorted(zf.namelist())
        init = zf.read("tessera_submit/__init__.py").decode()
    assert names == ["tessera_submit/__init__.py", "tessera_submit/client.py"]
    assert "bl_info" in init and '"category": "Render"' in init


_IN_BLENDER = r"""
import json, sys
import bpy  # first: importing bpy puts Blender's own modules (addon_utils) on the path
import addon_utils

zip_path, blend, url, token = sys.argv[1:5]
assert bpy.ops.preferences.addon_install(filepath=zip_path) == {"FINISHED"}
addon_utils.enable("tessera_submit", default_set=True, handle_error=None)
bpy.ops.wm.open_mainfile(filepath=blend)
prefs = bpy.context.preferences.addons["tessera_submit"].preferences
prefs.farm_url, prefs.token = url, token
scene = bpy.context.scene
scene.frame_start, scene.frame_end = 2, 3
scene.tessera.tiles, scene.tessera.formats = "1x2", "png"
result = bpy.ops.tessera.submit()
print("RESULT " + json.dumps({
    "result": sorted(result),
    "job_url": scene.tessera.last_job_url,
    "panel": hasattr(bpy.types, "TESSERA_PT_submit"),
}))
"""


def test_addon_installs_in_blender_and_submits_the_open_file(
    farm: tuple[LiveWeb, str, Path], tmp_path: Path
) -> None:
    live, token, blend = farm
    zip_path = build_zip.build(tmp_path / "tessera_submit.zip")
    work = tmp_path / "shot.blend"
    work.write_bytes(blend.read_bytes())
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "BLENDER_USER_SCRIPTS": str(tmp_path / "scripts"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", _IN_BLENDER, str(zip_path), str(work), live.url, token],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["result"] == ["FINISHED"] and out["panel"]
    assert (tmp_path / "scripts" / "addons" / "tessera_submit" / "client.py").is_file()
    job_id = out["job_url"].rsplit("/", 1)[1]
    job = client.FarmClient(live.url, token).job(job_id)
    # the scene's frame range as edited (and saved) in Blender, and the panel's settings
    assert job["spec"]["frames"] == [2, 3]
    assert job["spec"]["tiles"] == "1x2"
    assert job["spec"]["formats"] == ["png"]
    assert job["spec"]["source"]["name"] == "shot.blend"
    client.FarmClient(live.url, token).request("POST", f"/api/jobs/{job_id}/cancel")
