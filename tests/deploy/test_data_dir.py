"""`farm up` keeps its data in the user's data folder, never in the folder it was started in
(a checkout collected ./tessera-data); the checkout ignores that folder all the same."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from farm.settings import Settings, default_data_dir
from farm.stack import data_folder
from tests.conftest import REPO

START_TIMEOUT_S = 120


def test_the_data_folder_is_given_configured_or_the_xdg_data_home() -> None:
    assert default_data_dir({"HOME": "/home/ann"}) == Path("/home/ann/.local/share/tessera")
    assert default_data_dir({"HOME": "/home/ann", "XDG_DATA_HOME": "/data"}) == Path(
        "/data/tessera"
    )
    configured = Settings.from_env({"FARM_DATA_DIR": "/srv/farm"})
    assert data_folder(configured, None) == Path("/srv/farm")
    assert data_folder(configured, Path("/given")) == Path("/given")
    assert data_folder(Settings(), None) == default_data_dir()


def test_farm_up_writes_nothing_where_it_is_started(tmp_path: Path) -> None:
    cwd, home = tmp_path / "checkout", tmp_path / "home"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FARM_", "XDG_"))}
    env["HOME"] = str(home)
    proc = subprocess.Popen(
        [sys.executable, "-m", "farm", "up", "--port", "0"],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the web serves
        assert line, f"farm up ended early:\n{proc.communicate(timeout=30)[1]}"
        url = json.loads(line)["url"]
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{url}/healthz", timeout=30) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert list(cwd.iterdir()) == [], "farm up wrote into the folder it was started in"
    data = home / ".local" / "share" / "tessera"
    assert (data / "logs").is_dir() and (data / "redis").is_dir()
    assert str(data) in err


def test_the_checkout_ignores_a_local_data_folder() -> None:
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "tessera-data/redis/appendonly.aof"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert ignored.returncode == 0, "tessera-data/ is not in .gitignore"
