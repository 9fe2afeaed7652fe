"""The catalog of apps a stream session can run: built-ins plus a configured JSON/TOML file."""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from farm.errors import BadParameter, NotFound

#: a source that draws frames itself (no X display, no app process)
TESTPATTERN = "testpattern"

#: the bounds a session's size and rate must fall in (H.264 levels, what browsers decode)
MIN_SIZE_PX, MAX_WIDTH_PX, MAX_HEIGHT_PX = 64, 3840, 2160
MIN_FPS, MAX_FPS = 1, 144


@dataclass(frozen=True)
class App:
    """One runnable app: a command started in its own X display, or the test pattern."""

    name: str
    title: str
    command: tuple[str, ...]
    width: int = 1280
    height: int = 720
    fps: int = 60
    network: bool = False
    """The app's sandbox shares the host's network (else it has none at all)."""
    desktop: bool = False
    """A desktop-like app (a shell, a terminal): launched by project admins only."""
    memory_mib: int | None = None
    """Memory limit of the session's sandbox; None = FARM_STREAM_MEMORY_MIB."""
    pids: int | None = None
    """Process limit of the session's sandbox; None = FARM_STREAM_PIDS."""
    cpu_cores: float | None = None
    """CPU limit of the session's sandbox; None = FARM_STREAM_CPU_CORES."""
    audio: bool = False
    """The session sends the app's sound (a sound server in its sandbox; FARM_STREAM_AUDIO=0
    turns it off for every app)."""
    lip_sync: bool = True
    """Viewers hold the picture for the sound (the player's lip sync); False puts the picture's
    latency first (the built-in game). A viewer's ``?lipsync=`` overrides it."""

    @property
    def needs_display(self) -> bool:
        return self.name != TESTPATTERN

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "network": self.network,
            "desktop": self.desktop,
            "audio": self.audio,
            "lip_sync": self.lip_sync,
        }

    def sized(self, width: int | None, height: int | None, fps: int | None) -> App:
        """This app at a session's own size and rate (None keeps the app's), checked."""
        app = replace(
            self,
            width=self.width if width is None else width,
            height=self.height if height is None else height,
            fps=self.fps if fps is None else fps,
        )
        check_geometry(app.width, app.height, app.fps)
        return app


def check_geometry(width: int, height: int, fps: int) -> None:
    for name, value, low, high in (
        ("width", width, MIN_SIZE_PX, MAX_WIDTH_PX),
        ("height", height, MIN_SIZE_PX, MAX_HEIGHT_PX),
        ("fps", fps, MIN_FPS, MAX_FPS),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise BadParameter(f"{name} must be a whole number from {low} to {high}, not {value!r}")
    if width % 2 or height % 2:
        # 4:2:0 video needs even sizes
        raise BadParameter(f"width and height must be even, not {width}x{height}")


#: the fields an app of FARM_STREAM_APPS may have
FIELDS = frozenset(
    {"name", "title", "command", "width", "height", "fps", "network", "desktop", "memory_mib",
     "pids", "cpu_cores", "audio", "lip_sync"}
)  # fmt: skip


def builtin_apps() -> list[App]:
    return [
        App(
            "desktop",
            "Desktop (Openbox + terminal)",
            ("sh", "-c", "openbox & exec xterm -geometry 100x30+40+40"),
            desktop=True,
            audio=True,
        ),
        App(
            "game",
            "Built-in game (arrow keys / WASD, click, gamepad)",
            (sys.executable, "-m", "encoder.game"),
            audio=True,
            lip_sync=False,
        ),
        App(TESTPATTERN, "Test pattern (frame counter and capture time)", ()),
    ]


class Catalog:
    """Apps by name; a configured file's entries replace built-ins of the same name."""

    def __init__(self, apps: list[App]) -> None:
        self.apps = {app.name: app for app in apps}

    @classmethod
    def load(cls, path: Path | None) -> Catalog:
        apps = {app.name: app for app in builtin_apps()}
        if path is not None:
            for app in read_apps(path):
                apps[app.name] = app
        return cls(list(apps.values()))

    def get(self, name: str) -> App:
        app = self.apps.get(name)
        if app is None:
            raise NotFound(
                f"no app {name!r} in the catalog (apps: {', '.join(sorted(self.apps))})", app=name
            )
        return app

    def to_json(self) -> list[dict[str, Any]]:
        return [app.to_json() for app in self.apps.values()]


def read_apps(path: Path) -> list[App]:
    """The apps of a FARM_STREAM_APPS file: a JSON list, or TOML ``[[apps]]`` tables."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadParameter(f"FARM_STREAM_APPS {path} cannot be read: {exc.strerror}") from None
    try:
        raw: Any = tomllib.loads(text).get("apps") if path.suffix == ".toml" else json.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadParameter(f"FARM_STREAM_APPS {path} is not valid: {exc}") from None
    if not isinstance(raw, list):
        raise BadParameter(f"FARM_STREAM_APPS {path} must hold a list of apps")
    return [_app(path, i, entry) for i, entry in enumerate(raw)]


def _app(path: Path, index: int, entry: object) -> App:
    where = f"FARM_STREAM_APPS {path} app #{index}"
    if not isinstance(entry, dict):
        raise BadParameter(f"{where} must be an object")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise BadParameter(f"{where} has unknown field(s) {', '.join(unknown)}")
    name, command = entry.get("name"), entry.get("command")
    if not isinstance(name, str) or not name or name == TESTPATTERN:
        raise BadParameter(f"{where}: name must be a non-empty string other than {TESTPATTERN}")
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(a, str) and a for a in command)
    ):
        raise BadParameter(f"{where} ({name}): command must be a list of strings (argv)")
    app = App(
        name=name,
        title=str(entry.get("title", name)),
        command=tuple(command),
        width=entry.get("width", 1280),
        height=entry.get("height", 720),
        fps=entry.get("fps", 60),
        network=_flag(where, entry, "network"),
        desktop=_flag(where, entry, "desktop"),
        audio=_flag(where, entry, "audio"),
        lip_sync=_flag(where, entry, "lip_sync", default=True),
        memory_mib=_limit(where, entry, "memory_mib", int),
        pids=_limit(where, entry, "pids", int),
        cpu_cores=_limit(where, entry, "cpu_cores", float),
    )
    check_geometry(app.width, app.height, app.fps)
    return app


def _flag(where: str, entry: dict[str, Any], name: str, default: bool = False) -> bool:
    value = entry.get(name, default)
    if not isinstance(value, bool):
        raise BadParameter(f"{where}: {name} must be true or false, not {value!r}")
    return value


def _limit(where: str, entry: dict[str, Any], name: str, kind: type) -> Any:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise BadParameter(f"{where}: {name} must be a number of at least 0, not {value!r}")
    if kind is int and value != int(value):
        raise BadParameter(f"{where}: {name} must be a whole number, not {value!r}")
    return kind(value)
