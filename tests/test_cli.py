"""`farm` at the command line: bad input is refused in one line with a non-zero exit, and
nothing it started outlives it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.blendscenes import make_scene
from tests.conftest import TESTDATA
from tests.web.conftest import wait_for_worker


def farm(
    *args: str, cwd: Path, timeout_s: float = 180, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`farm ARGS` in ``cwd`` with ``env`` over this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", "farm", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_scene(tmp_path_factory.mktemp("cli") / "scene.blend")


def _refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("farm: error:")]
    assert len(errors) == 1, proc.stderr
    for word in words:
        assert word in errors[0], errors[0]


def test_not_a_blend_file(tmp_path: Path) -> None:
    png = tmp_path / "picture.blend"
    png.write_bytes((TESTDATA / "01_principled_normal.png").read_bytes())
    _refused(farm("render", str(png), cwd=tmp_path), "PNG")
    assert not (tmp_path / "render").exists()


def test_truncated_blend_file(tmp_path: Path, scene: Path) -> None:
    cut = tmp_path / "cut.blend"
    data = (TESTDATA / "12_anim_range_driver.blend").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    _refused(farm("render", str(cut), cwd=tmp_path), "truncated")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--frames", ""], ["frame list is empty"]),
        (["--frames", "9-3"], ["ends before it starts"]),
        (["--samples", "0"], ["samples"]),
        (["--samples", "-5"], ["samples"]),
        (["--tiles", "64x64", "--resolution", "10x10"], ["more tiles than"]),
        (["--tiles", "0x2"], ["tile grid"]),
        (["--resolution", "100000x10"], ["resolution"]),
        (["--formats", "gif"], ["gif"]),
        (["--workers", "0"], ["--workers"]),
        (["--priority", "5000"], ["priority must be -1000 to 1000, not 5000"]),
        (["--max-attempts", "11"], ["max attempts must be 1 to 10"]),
        (["--tile-timeout", "0"], ["tile timeout must be 0.1 to 604800 s"]),
        (["--project", "../x"], ["project name"]),
    ],
)
def test_absurd_parameters_are_refused_before_anything_starts(
    tmp_path: Path, scene: Path, args: list[str], words: list[str]
) -> None:
    started = time.monotonic()
    proc = farm("render", str(scene), *args, cwd=tmp_path)
    _refused(proc, *words)
    # refused by the argument checks alone: no redis-server, no Blender was started
    assert time.monotonic() - started < 10


def test_scene_without_camera(tmp_path: Path) -> None:
    blend = make_scene(tmp_path / "nocam.blend", camera=False)
    _refused(farm("render", str(blend), cwd=tmp_path), "no active camera")
    assert not (tmp_path / "render").exists()


def test_missing_texture_names_the_file(tmp_path: Path) -> None:
    proc = farm("render", str(TESTDATA / "01_missing_textures.blend"), cwd=tmp_path)
    _refused(proc, "MissingTexture.png")


def test_render_writes_frames_and_reports_json(tmp_path: Path, scene: Path) -> None:
    # the embedded farm's workers have the tags the job asks for (else it would wait forever)
    tagged = ("--tags", "big-ram", "--frame-order", "first-last-middle")
    proc = farm("render", str(scene), "--tiles", "2x2", "--output", "out", "--json", *tagged,
                cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["job"]["state"] == "done"
    assert result["job"]["spec"]["tags"] == ["big-ram"]
    assert result["job"]["tiles_done"] == 4
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "frame_0001.exr",
        "frame_0001.png",
        "manifest.json",
    ]


def test_ctrl_c_cancels_and_stops_every_process_it_started(tmp_path: Path) -> None:
    slow = make_scene(tmp_path / "slow.blend", width=160, height=90, samples=5000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm", "render", str(slow), "--workers", "2"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    lines: list[str] = []
    queued = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "tiles " in line:
                queued.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started: set[int] = set()
    deadline = time.monotonic() + 90
    # wait until the job is queued and both workers run a Blender child
    while time.monotonic() < deadline:
        started |= set(_descendants(proc.pid))
        if queued.is_set() and sum(b"workers.blender" in _cmdline(p) for p in started) >= 2:
            break
        time.sleep(0.1)
    else:
        proc.kill()
        raise AssertionError(f"the farm never started rendering: {''.join(lines)}")
    started |= set(_descendants(proc.pid))
    proc.send_signal(signal.SIGINT)
    proc.wait(60)
    reader.join(10)
    proc.stderr.close()
    err = "".join(lines)
    assert proc.returncode == 130, err
    assert "canceled" in err
    alive = [p for p in started if Path(f"/proc/{p}").exists() and _state(p) != "Z"]
    assert alive == [], f"processes left behind: {[_cmdline(p) for p in alive]}"


def _descendants(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    out = []
    for k in kids:
        out.append(int(k))
        out.extend(_descendants(int(k)))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="this machine has an NVIDIA GPU")
def test_gpu_render_without_a_gpu_says_why_and_does_not_loop(tmp_path: Path, scene: Path) -> None:
    started = time.monotonic()
    proc = farm("render", str(scene), "--device", "gpu", cwd=tmp_path)
    assert proc.returncode == 4, proc.stderr
    assert "no GPU for Cycles" in proc.stderr
    assert time.monotonic() - started < 60


def test_shared_farm_commands_submit_watch_status_cancel(
    redis_url: str, tmp_path: Path, scene: Path
) -> None:
    env = {
        "FARM_REDIS_URL": redis_url,
        "FARM_STORAGE_DIR": str(tmp_path / "storage"),
        "FARM_WORK_DIR": str(tmp_path / "work"),
    }
    log = (tmp_path / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "farm", "worker", "--name", "cli-test"],
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # `farm submit` refuses at once while no worker of its device is online
        wait_for_worker(redis_url)
        submitting = ("submit", str(scene), "--tiles", "2x1", "--output", "out", "--json")
        proc = farm(*submitting, cwd=tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        job_id = json.loads(proc.stdout)["id"]
        watched = farm("watch", job_id, "--json", cwd=tmp_path, env=env)
        assert watched.returncode == 0, watched.stderr
        # one event per line, from the job's start to its end
        events = [json.loads(line) for line in watched.stdout.splitlines()]
        assert (events[0]["type"], events[0]["state"]) == ("job_state", "queued")
        assert (events[-1]["type"], events[-1]["state"]) == ("job_state", "done")
        assert [e["frame"] for e in events if e["type"] == "frame_done"] == [1]
        assert sum(e["type"] == "tile_state" and e["state"] == "done" for e in events) == 2
        status = json.loads(farm("status", job_id, "--json", cwd=tmp_path, env=env).stdout)
        assert (status["tiles_done"], status["frames_done"]) == (2, 1)
        assert (tmp_path / "out" / "frame_0001.png").is_file()
        listing = farm("status", cwd=tmp_path, env=env)
        assert job_id in listing.stdout and "done" in listing.stdout
        # a finished job cannot be canceled, and says why: a conflict (1), not Ctrl-C's 130
        late = farm("cancel", job_id, cwd=tmp_path, env=env)
        assert late.returncode == 1, late.stderr
        assert (
            f"farm: error: job {job_id} has already ended: done; only a queued or running job "
            "can be canceled"
        ) in late.stderr.splitlines()
        unknown = farm("status", "no-such-job", cwd=tmp_path, env=env)
        assert unknown.returncode == 3 and "no job" in unknown.stderr
    finally:
        worker.terminate()
        assert worker.wait(30) == 0, (tmp_path / "worker.log").read_text()[-2000:]
        log.close()


def test_watch_json_streams_a_canceled_jobs_events_and_exits_as_canceled(
    redis_url: str, tmp_path: Path
) -> None:
    from farm import jobstore
    from farm.states import JobState
    from tests.web.conftest import make_job, make_web_settings

    job_id = make_job(make_web_settings(redis_url, tmp_path), "A", tmp_path / "out")
    store = jobstore.JobStore(jobstore.connect(redis_url))
    store.end_job(job_id, JobState.CANCELED, "canceled by request")
    store.conn.close()
    watched = farm("watch", job_id, "--json", cwd=tmp_path, env={"FARM_REDIS_URL": redis_url})
    assert watched.returncode == 130, watched.stderr
    *events, error = [json.loads(line) for line in watched.stdout.splitlines()]
    assert [(e["type"], e["state"]) for e in events] == [
        ("job_state", "queued"),
        ("job_state", "canceled"),
    ]
    assert events[-1]["message"] == "canceled by request"
    # then the error object every --json command ends a failure with
    assert error["error"] == "job_canceled"


def test_watch_project_json_streams_the_projects_jobs_only(redis_url: str, tmp_path: Path) -> None:
    import queue

    from farm import jobstore
    from farm.models import TileTask
    from tests.web.conftest import make_job, make_web_settings

    settings = make_web_settings(redis_url, tmp_path)
    store = jobstore.JobStore(jobstore.connect(redis_url))
    before = make_job(settings, "A", tmp_path / "before")  # running when the watch starts
    watcher = subprocess.Popen(
        [sys.executable, "-m", "farm", "watch", "--project", "A", "--json"],
        env={**os.environ, "FARM_REDIS_URL": redis_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert watcher.stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in watcher.stdout or ():
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[dict[str, object]] = []

    def read_until(job_id: str, state: str) -> None:
        """Lines until the job's job_state event of ``state``."""
        while not seen or (seen[-1]["job_id"], seen[-1]["type"], seen[-1]["state"]) != (
            job_id,
            "job_state",
            state,
        ):
            seen.append(json.loads(lines.get(timeout=20)))

    try:
        read_until(before, "queued")  # the running job's events from its start
        other = make_job(settings, "B", tmp_path / "other")
        later = make_job(settings, "A", tmp_path / "later")
        for job_id in (other, later):  # rendered as workers would, in no time
            for frame in (1, 2):
                task = TileTask(job_id, frame, 0, 1)
                store.start_tile(task)
                store.finish_tile(task, 1)
                store.finish_frame(job_id, frame)
        read_until(later, "done")
    finally:
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(30) == 130
        watcher.stdout.close()
        store.conn.close()
    assert {e["job_id"] for e in seen} == {before, later}
    assert [e["frame"] for e in seen if e["type"] == "frame_done"] == [1, 2]
    assert seen[-1]["type"] == "job_state"
    refused = farm("watch", "--project", "A", cwd=tmp_path, env={"FARM_REDIS_URL": redis_url})
    _refused(refused, "--json")


def test_a_job_submitted_with_farm_submit_shows_in_its_projects_web_list(
    redis_url: str, tmp_path: Path, scene: Path
) -> None:
    """The web lists a project's jobs from the index the one acceptance writes: a job from
    `farm submit` is there like one from the web, with its priority."""
    import asyncio

    from tests.farmprocs import WorkerProcess
    from tests.web.conftest import api, bearer, make_tokens, make_web_settings

    tokens = make_tokens(redis_url)
    worker = WorkerProcess(redis_url, tmp_path)  # it inspects the file
    try:
        wait_for_worker(redis_url)
        submitting = ("submit", str(scene), "--project", "A", "--priority", "7", "--tiles", "1x1")
        proc = farm(*submitting, "--output", "out", "--json", cwd=tmp_path, env=worker.env)
        assert proc.returncode == 0, proc.stderr
        job_id = json.loads(proc.stdout)["id"]
    finally:
        worker.stop()

    async def listed(token: str) -> list[dict[str, object]]:
        async with api(make_web_settings(redis_url, tmp_path)) as client:
            resp = await client.get("/api/jobs", headers=bearer(token))
            assert resp.status == 200, await resp.text()
            jobs: list[dict[str, object]] = (await resp.json())["jobs"]
            return jobs

    jobs = asyncio.run(listed(tokens.alice))
    assert [(j["job_id"], j["project"], j["priority"], j["name"]) for j in jobs] == [
        (job_id, "A", 7, "scene")
    ]
    assert asyncio.run(listed(tokens.bob)) == [], "project B's member sees none of A's jobs"
