"""The operator commands of the CLI: `farm uploads` (list, delete) and `farm blocklist JOB`."""

from __future__ import annotations

import argparse
import getpass
import sys
import time
from typing import Any

from farm.errors import BadParameter
from farm.settings import Settings


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("uploads", help="a project's uploads; delete one (its file too)")
    p.add_argument("--project", help="the project the uploads belong to")
    p.add_argument("--json", action="store_true")
    up = p.add_subparsers(dest="uploads_command")
    t = up.add_parser("delete", help="delete an upload (refused while an unfinished job uses it)")
    t.add_argument("upload", metavar="UPLOAD", help="the upload's id (its sha256)")
    t.add_argument("--yes", action="store_true", help="confirm: its stored file goes too")
    # also after the upload (a subparser's own dest: its default would hide the parent's)
    t.add_argument("--project", dest="delete_project", help="the project the upload belongs to")
    t.add_argument("--json", action="store_true")

    p = sub.add_parser("blocklist", help="the workers blocklisted for a job; clear them")
    p.add_argument("job", metavar="JOB")
    p.add_argument("--clear", nargs="?", const="", default=None, metavar="WORKER",
                   help="clear the job's blocklist (only WORKER's entry when named)")  # fmt: skip
    p.add_argument("--json", action="store_true")


def cmd_uploads(settings: Settings, args: argparse.Namespace) -> Any:
    from farm import jobstore, uploadrecords
    from farm.storage.factory import farm_storage

    project = getattr(args, "delete_project", None) or args.project
    if not project:
        raise BadParameter("say which project: farm uploads --project P [delete UPLOAD --yes]")
    conn = jobstore.connect(settings.redis_url)
    try:
        if args.uploads_command == "delete":
            if not args.yes:
                raise BadParameter(f"deleting upload {args.upload} removes its stored file: "
                                   "confirm it with --yes")  # fmt: skip
            storage = farm_storage(settings)
            try:
                gone = uploadrecords.delete(conn, storage, project, args.upload)
            finally:
                storage.close()
            if args.json:
                return {"upload_id": gone.upload_id, "project": gone.project, "deleted": True,
                        "objects": gone.objects, "kept": gone.kept}  # fmt: skip
            kept = f"; its file is kept: {gone.kept}" if gone.kept else ""
            print(f"upload {gone.upload_id} deleted ({gone.objects} stored objects removed{kept})",
                  file=sys.stderr)  # fmt: skip
            return None
        records = uploadrecords.listing(conn, project)
    finally:
        conn.close()
    shown = [{k: v for k, v in r.items() if k != "location"} for r in records]
    if args.json:
        return shown
    if not shown:
        print(f"project {project} has no uploads")
        return None
    for r in shown:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(r.get("created", 0))))
        print(f"{r['upload_id']}  {int(r.get('size', 0)):>12,d} B  {when}  {r.get('name', '')}")
    return None


def cmd_blocklist(settings: Settings, args: argparse.Namespace) -> Any:
    from farm import blocklist, jobstore, queue

    store = jobstore.JobStore(jobstore.connect(settings.redis_url), settings.lease_ttl_s)
    conn = store.conn
    try:
        spec = store.spec(args.job)  # NotFound for a job that is not there
        cleared = None
        if args.clear is not None:
            who = f"{getpass.getuser()} (cli)"
            cleared = blocklist.clear(conn, args.job, who, args.clear)
            if cleared:
                # idle workers look at the queue again: the tiles they passed over may be theirs
                queue.RenderQueue(queue.connect(settings.redis_url), spec.device).ring()
        entries = blocklist.entries(conn, args.job)
    finally:
        conn.close()
    if args.json:
        out: dict[str, Any] = {"job_id": args.job,
                               "failures_to_block": settings.blocklist_failures,
                               "workers": [e.to_dict() for e in entries]}  # fmt: skip
        if cleared is not None:
            out["cleared"] = cleared
        return out
    if cleared is not None:
        print(f"job {args.job}: {cleared} blocklisted worker(s) cleared", file=sys.stderr)
    if not entries:
        print(f"job {args.job}: no worker failed its tiles")
        return None
    for e in entries:
        state = "blocklisted" if e.blocklisted else "allowed"
        print(f"{e.worker}  {state}  {e.failures} failed tile(s)")
    return None


COMMANDS = {"uploads": cmd_uploads, "blocklist": cmd_blocklist}
