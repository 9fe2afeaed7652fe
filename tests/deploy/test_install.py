"""The package as an operator installs it: no extras, into a clean venv.

The image runs `pip install .`; a module that imports something only the ``dev`` extra brings
(Pillow once) kills the service at start there while every test here passes. This builds a
fresh venv holding the project and exactly the closure of its declared runtime dependencies
(``[project] dependencies``, no extras, markers evaluated as pip would), then imports every
module of the four packages from it and starts the services' commands.

It proves: every module imports, and every command starts, with only what the declared
dependencies bring in; a dev-only import or an undeclared dependency fails here. The project
itself is built into a wheel (setuptools, its package data) and installed by pip.

It no longer runs pip's resolver over the dependencies (about 40 s, bpy alone is a 300 MB
wheel to unpack): the dependencies' installed files (their RECORD) are hard-linked out of the
environment running the tests, whose versions are only checked against the declared
specifiers, not re-chosen from an index. A resolver conflict would show in `make setup`, which
installs the same requirements with pip.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

PACKAGES = ("farm", "workers", "encoder", "web")
#: what `pip install .` needs of the checkout (pyproject.toml names the README)
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)
#: building and installing the project's own wheel on a loaded 2-core machine
INSTALL_TIMEOUT_S = 300
START_TIMEOUT_S = 60

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
out = {}
for name in sys.argv[1:]:
    package = importlib.import_module(name)
    out[name] = package.__file__
    for info in pkgutil.walk_packages(package.__path__, name + "."):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue  # runs the CLI
        out[info.name] = importlib.import_module(info.name).__file__
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the working tree's package and its runtime dependencies, nothing else."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    venv = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=_env()
    )
    (site,) = (venv / "lib").glob("python3.*/site-packages")
    for dist in _runtime_closure():
        _link_distribution(dist, site)
    wheels = root / "wheels"
    # the project's own wheel, built from the copied sources by its declared build backend
    # (pip's wheel cache holds setuptools: a few seconds)
    _pip(root, "wheel", "--no-deps", "-w", wheels, src)
    # installed by pip into the clean venv: its `farm` command, its package data
    (wheel,) = wheels.glob("*.whl")
    python = venv / "bin" / "python"
    _pip(root, "--python", python, "install", "--no-deps", "--no-index", "--no-compile", wheel)
    return venv


def _pip(cwd: Path, *argv: str | Path) -> None:
    """Run the test environment's pip (the clean venv has none)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check", *argv],
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        env=_env(),
        cwd=cwd,
    )
    assert done.returncode == 0, f"pip {argv[0]} failed:\n{done.stdout}\n{done.stderr}"


def _runtime_closure() -> list[importlib.metadata.Distribution]:
    """The installed distributions `pip install .` would bring: the declared dependencies, no
    extras, and theirs, each with the extras asked of it and markers evaluated for this host."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    todo = [Requirement(line) for line in project["dependencies"]]
    todo = [req for req in todo if req.marker is None or req.marker.evaluate({"extra": ""})]
    seen: set[tuple[str, str]] = set()
    found: dict[str, importlib.metadata.Distribution] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        try:
            dist = found.get(name) or importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{req} is required but not installed here: run `make setup`")
        assert req.specifier.contains(dist.version, prereleases=True), (
            f"{req} is required but {dist.version} is installed here: run `make setup`"
        )
        found[name] = dist
        for extra in ("", *sorted(req.extras)):
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for line in dist.requires or ():
                dep = Requirement(line)
                if dep.marker is None or dep.marker.evaluate({"extra": extra}):
                    todo.append(dep)
    return list(found.values())


def _link_distribution(dist: importlib.metadata.Distribution, site: Path) -> None:
    """Put a distribution's installed files (its RECORD) into ``site`` as hard links: the same
    files pip unpacked here, without unpacking them again (a copy where links fail). Only the
    directories are new: Python writes a .pyc by renaming a new file into place, never into a
    linked one, so the clean venv cannot change the environment it was linked from."""
    origin = Path(str(dist.locate_file("")))
    assert dist.files is not None, f"{dist.metadata['Name']} has no RECORD: cannot copy it"
    for file in dist.files:
        if file.parts[0] == "..":
            continue  # its scripts in bin/: they would run the test's Python, none is needed
        source = origin / file
        if not source.is_file():
            continue  # a .pyc listed but never written
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except FileExistsError:
            continue  # listed twice in its RECORD
        except OSError:
            shutil.copy2(source, target)


def _env(**extra: str) -> dict[str, str]:
    """The environment of a process that must see the clean venv only, not this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, **extra}


def _farm_env(redis_url: str, tmp: Path) -> dict[str, str]:
    return _env(
        FARM_REDIS_URL=redis_url,
        FARM_STORAGE_DIR=str(tmp / "storage"),
        FARM_WORK_DIR=str(tmp / "work"),
        # the web signs stream tokens with it, the stream service refuses to start without it
        FARM_STREAM_SECRET=secrets.token_urlsafe(32),
    )


def test_every_module_imports_without_the_dev_extra(clean_venv: Path, tmp_path: Path) -> None:
    python = clean_venv / "bin" / "python"
    # the dev extra did not come along: what imports below comes from the runtime dependencies
    extra = subprocess.run([python, "-c", "import pytest"], capture_output=True, env=_env())
    assert extra.returncode != 0, "pytest is installed: the venv is not clean"
    done = subprocess.run(
        [python, "-c", _IMPORT_ALL, *PACKAGES],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=tmp_path,  # never the checkout: its packages would shadow the installed ones
        timeout=300,
    )
    assert done.returncode == 0, f"a module does not import from `pip install .`:\n{done.stderr}"
    files = json.loads(done.stdout)
    site = str(clean_venv / "lib")
    assert all(f.startswith(site) for f in files.values()), "imported from outside the venv"
    src = clean_venv.parent / "src"
    expected = {
        ".".join(p.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
        for name in PACKAGES
        for p in (src / name).rglob("*.py")
        if p.name != "__main__.py" and _in_package(p.parent, src)
    }
    assert expected <= set(files), f"not imported: {sorted(expected - set(files))}"


def _in_package(folder: Path, root: Path) -> bool:
    """Whether ``folder`` is a package all the way up (farm/examples holds scripts only)."""
    while folder != root:
        if not (folder / "__init__.py").is_file():
            return False
        folder = folder.parent
    return True


@pytest.mark.parametrize("command", ["worker", "web", "frontdoor", "stream", "up"])
def test_every_service_command_answers_help(clean_venv: Path, command: str) -> None:
    done = subprocess.run(
        [clean_venv / "bin" / "farm", command, "--help"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: farm {command}")


def test_a_worker_starts_serves_its_queue_and_quits(
    clean_venv: Path, redis_url: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [clean_venv / "bin" / "farm", "worker", "--burst", "--name", "clean-venv"],
        capture_output=True,
        text=True,
        env=_farm_env(redis_url, tmp_path),
        cwd=tmp_path,
        timeout=START_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    assert "Listening on tessera-render-cpu" in done.stderr


@pytest.fixture
def started(
    clean_venv: Path, redis_url: str, tmp_path: Path
) -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(
    procs: list[subprocess.Popen[str]], argv: list[str | Path], env: dict[str, str], cwd: Path
) -> tuple[subprocess.Popen[str], str]:
    """Start a service; its URL from the JSON line it prints once listening."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )
    procs.append(proc)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _out, err = proc.communicate()
        pytest.fail(f"{argv[1]} did not start:\n{err}")
    return proc, str(json.loads(line)["url"])


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _stops_cleanly(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=START_TIMEOUT_S)
    assert proc.returncode == 0, err


def test_web_and_stream_service_start_and_answer(
    clean_venv: Path, redis_url: str, tmp_path: Path, started: list[subprocess.Popen[str]]
) -> None:
    farm = clean_venv / "bin" / "farm"
    env = _farm_env(redis_url, tmp_path)
    web, web_url = _start(started, [farm, "web", "--port", "0"], env, tmp_path)
    with urllib.request.urlopen(f"{web_url}/api/openapi.json", timeout=10) as resp:
        assert json.load(resp)["openapi"].startswith("3.")
    stream, stream_url = _start(
        started, [farm, "stream", "--device", "cpu", "--port", "0"], env, tmp_path
    )
    assert _http_status(stream_url) > 0  # it answers HTTP (its routes want a token)
    _stops_cleanly(stream)
    _stops_cleanly(web)
