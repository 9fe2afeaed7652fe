"""The job control commands of the CLI: `farm suspend|resume|requeue|archive|delete JOB...`."""

from __future__ import annotations

import argparse
import getpass
import re
import sys
from typing import Any

from farm.errors import BadParameter, FarmError
from farm.settings import Settings

_TASK = re.compile(r"(-?\d+):(\d+)")


def add_parsers(sub: Any) -> None:
    helps = {
        "suspend": "start no more tiles of jobs (those rendering finish)",
        "resume": "run suspended jobs again",
        "requeue": "render and deliver frames or tasks of jobs again, also of ended jobs",
        "archive": "hide ended jobs from the default jobs list (kept)",
        "delete": "delete jobs with their records and files (a running one is canceled)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("jobs", nargs="+", metavar="JOB")
        p.add_argument("--json", action="store_true")
        if name == "requeue":
            p.add_argument("--frames", help="frames like 1-3,7 (every task of each)")
            p.add_argument("--tasks", help="tasks as frame:index, comma-separated (3:0,3:1)")
        if name == "delete":
            p.add_argument("--yes", action="store_true", help="confirm: the files go too")


def cmd_control(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    """The action named by the command on each job; the first error stops it (exit status of
    that error), after the jobs before it were done."""
    from farm import jobstore, queue
    from farm.frames import parse_frames
    from farm.jobcontrol import JobControl
    from farm.storage.factory import farm_storage

    store = jobstore.JobStore(jobstore.connect(settings.redis_url), settings.lease_ttl_s)
    ctl = JobControl(store, settings, farm_storage(settings), queue.connect(settings.redis_url))
    who = f"{getpass.getuser()} (cli)"
    frames = parse_frames(args.frames) if getattr(args, "frames", None) else []
    tasks = _tasks(getattr(args, "tasks", None) or "")
    results: dict[str, Any] = {}
    for job_id in args.jobs:
        try:
            results[job_id] = _one(ctl, args.command, job_id, who, frames, tasks, args)
        except FarmError as exc:
            exc.fields.setdefault("job_id", job_id)
            raise
        if not args.json:
            print(f"job {job_id}: {results[job_id]['said']}", file=sys.stderr)
    return results if args.json else None


def _one(ctl: Any, command: str, job_id: str, who: str, frames: list[int],
         tasks: list[tuple[int, int]], args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    if command == "suspend":
        return {"state": ctl.suspend(job_id, who).state, "said": "suspended"}
    if command == "resume":
        status, pushed = ctl.resume(job_id, who)
        return {"state": status.state, "resumed_tiles": pushed,
                "said": f"resumed ({pushed} held tiles queued)"}  # fmt: skip
    if command == "requeue":
        done = ctl.requeue(job_id, who, frames, tasks)
        return {"state": done.status.state, "requeued_tiles": len(done.tiles),
                "redelivered_frames": done.redelivered,
                "said": f"{len(done.tiles)} tiles requeued"}  # fmt: skip
    if command == "archive":
        return {"state": ctl.archive(job_id, who).state, "said": "archived"}
    gone = ctl.delete(job_id, who, args.yes)
    return {"deleted": True, "objects": gone.objects,
            "said": f"deleted ({gone.objects} stored objects removed)"}  # fmt: skip


def _tasks(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _TASK.fullmatch(part)
        if m is None:
            raise BadParameter(f"task {part!r} is not frame:index (like 3:0)")
        out.append((int(m[1]), int(m[2])))
    return out


COMMANDS = dict.fromkeys(("suspend", "resume", "requeue", "archive", "delete"), cmd_control)
