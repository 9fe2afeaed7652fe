"""What the deployment files are checked against: the CLI's commands, the settings' variables,
and compose's ``${VAR:-default}`` interpolation."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from farm.cli import build_parser
from farm.settings import ENV, Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

#: variables a farm process reads that are not FARM_* settings (boto3's credentials chain)
#: (REDIS_PASSWORD: the Kubernetes pods build FARM_REDIS_URL from it)
OUTSIDE_SETTINGS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "POD_IP", "REDIS_PASSWORD"}

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def cli_commands() -> set[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def setting_names() -> set[str]:
    return {name for name, _kind, _minimum in ENV.values()}


def interpolate(value: str) -> str:
    """Compose's substitution with no variables set: defaults, and ``$$`` for ``$``."""
    return _VAR.sub(lambda m: m[2] or "", value).replace("$$", "$")


def check_farm_command(where: str, command: list[str]) -> None:
    assert command[:1] == ["farm"], f"{where}: runs {command}, not a farm command"
    assert command[1] in cli_commands(), (
        f"{where}: `farm {command[1]}` is not a command of farm.cli ({sorted(cli_commands())})"
    )


def check_env(where: str, env: Mapping[str, str]) -> Settings:
    """Every variable is a setting (or a known outside one) and the settings build from them."""
    unknown = {k for k in env if k not in setting_names() and k not in OUTSIDE_SETTINGS}
    assert not unknown, f"{where}: {sorted(unknown)} are not FARM_* settings (farm/settings.py)"
    return Settings.from_env({k: interpolate(str(v)) for k, v in env.items()})


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname and parts.port, f"{url} names no host and port"
    return parts.hostname, parts.port


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
