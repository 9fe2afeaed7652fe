"""What the stream benchmarks share: the arms' services beside a private Redis, and their run.

Not a benchmark itself (`make bench` runs only the bench/*.py that are scripts); the stream
benchmarks import it as ``bench.streambench`` after putting the repository on sys.path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from farm.redisserver import RedisServer
from tests.encoder.serviceprocess import ServiceProcess, ours_command, plain_command
from tests.encoder.tokens import STREAM_SECRET

#: the latency probe app: a time code drawn by the app itself at its own frame clock
TIMECODE_APP = {
    "name": "timecode",
    "title": "Latency probe (frame counter and drawing time)",
    "command": [sys.executable, "-m", "encoder.timecode"],
}


def add_arm_options(parser: argparse.ArgumentParser) -> None:
    """--plain-source (how plain aiortc is fed) and --arms (which services run)."""
    parser.add_argument(
        "--plain-source",
        choices=("live", "pull"),
        default="live",
        help="plain aiortc's source: live (frames at the source's clock, queued per viewer, as "
        "aiortc's MediaPlayer/MediaRelay) or pull (painted when the encoder asks)",
    )
    parser.add_argument("--arms", default="ours,plain", help="which arms to run (smoke tests)")


@contextmanager
def arm_services(
    arms: list[str], plain_source: str, cpu_encode_sessions: int, prefix: str
) -> Iterator[dict[str, ServiceProcess]]:
    """Each arm's service (``ours``: `farm stream`; ``plain``: plain aiortc) started beside a
    private Redis, stopped at the end; on an error, each service's log tail goes to stderr."""
    with (
        tempfile.TemporaryDirectory(prefix=prefix) as tmp,
        RedisServer(Path(tmp) / "redis", unix_socket=False) as redis_server,
    ):
        # the timecode probe app (encoder/timecode.py) beside the built-ins, for ours; plain
        # aiortc knows it too (tests/encoder/plainservice.py)
        apps = Path(tmp) / "apps.json"
        apps.write_text(json.dumps([TIMECODE_APP]))
        env = {
            "FARM_STREAM_APPS": str(apps),
            "FARM_REDIS_URL": redis_server.url,
            "FARM_STREAM_PORT": "0",
            "FARM_STREAM_HOST": "127.0.0.1",
            "FARM_CPU_ENCODE_SESSIONS": str(cpu_encode_sessions),
            "FARM_LOG_LEVEL": "WARNING",
            # the benches call the service as its operator (tests/encoder/tokens.py)
            "FARM_STREAM_SECRET": STREAM_SECRET,
        }
        commands = {"ours": ours_command(), "plain": plain_command(plain_source)}
        services = {
            arm: ServiceProcess(commands[arm], env, Path(tmp) / f"{arm}.log") for arm in arms
        }
        try:
            for service in services.values():
                service.start()
            yield services
        except BaseException:
            for name, service in services.items():
                if service.log is not None and service.log.exists():
                    tail = service.log.read_text(errors="replace").splitlines()[-15:]
                    print(f"--- {name} log tail:\n" + "\n".join(tail), file=sys.stderr)
            raise
        finally:
            for service in services.values():
                service.stop()


def spread(values: list[float]) -> str:
    """A figure over the runs: median [min..max]."""
    return f"{statistics.median(values):7.2f} [{min(values):.2f}..{max(values):.2f}]"


def run_bench(
    main_async: Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]],
    args: argparse.Namespace,
) -> None:
    """Run the benchmark; print its figures, with its wall time, as the one JSON line."""
    started = time.monotonic()
    figures = asyncio.run(main_async(args))
    figures["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(figures))
