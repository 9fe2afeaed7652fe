"""`farm`: the command line, and the composition root that starts each service from its command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from farm import controlcli, operatorcli
from farm.errors import BadParameter, Conflict, FarmError
from farm.models import JOB_OPTIONS, JobOption
from farm.settings import DEVICE_KINDS, ENV, Settings
from farm.terminal import safe

# Each command imports what it needs when it runs: `farm worker` starts its Blender child
# before anything heavy (rq, redis, numpy) is imported, so `import bpy` overlaps them.
if TYPE_CHECKING:
    from farm import jobstore, submission
    from farm.accept import Quoted


def _job_options(p: argparse.ArgumentParser) -> None:
    """The blend file, and a flag for each job option of ``JOB_OPTIONS`` (the fields the web
    API takes, with the same defaults and bounds)."""
    p.add_argument("blend", type=Path, help="the .blend file to render")
    for option in JOB_OPTIONS.values():
        if bool in option.types:
            # off by default: the flag turns it on; on by default: --no-... turns it off
            on = bool(option.default)
            p.add_argument(
                option.cli_flag,
                dest=option.name,
                action="store_false" if on else "store_true",
                help=f"do not {option.help}" if on else option.help,
            )
            continue
        shown = option.help
        if option.setting:
            shown += f" (default: {ENV[option.setting][0]}, else {option.default})"
        elif option.default is not None:
            shown += f" (default {option.default})"
        metavar = option.cli_flag.removeprefix("--").replace("-", "_").upper()
        p.add_argument(
            option.cli_flag, dest=option.name, type=_flag_type(option), metavar=metavar, help=shown
        )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _flag_type(option: JobOption) -> type:
    if float in option.types:
        return float
    if int in option.types and str not in option.types:
        return int
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="farm", description="Tessera: render .blend files on a farm of Blender workers."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("render", help="render a .blend on an embedded farm (no setup needed)")
    _job_options(p)
    p.add_argument(
        "--output",
        help="folder or s3://BUCKET/PREFIX for the frames and manifest.json (default: render/NAME)",
    )
    p.add_argument("--workers", type=int, default=1, help="local worker processes (default 1)")
    p.add_argument("--keep-logs", type=Path, help="copy the workers' logs into this folder")

    p = sub.add_parser("submit", help="submit a .blend to the farm at FARM_REDIS_URL")
    _job_options(p)
    p.add_argument(
        "--output", required=True, help="folder or s3://BUCKET/PREFIX the frames are delivered to"
    )
    p.add_argument("--wait", action="store_true", help="watch the job until it ends")
    p.add_argument(
        "--estimate",
        action="store_true",
        help="only estimate the job (time per frame, wall time, device-hours, cost, kWh, "
        "CO2e on each device class) from a probe render; nothing is queued",
    )

    p = sub.add_parser("status", help="show one job, or the latest jobs")
    p.add_argument("job", nargs="?")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("watch", help="show a job's progress until it ends")
    p.add_argument("job", nargs="?")
    p.add_argument(
        "--json",
        action="store_true",
        help="print each event of the job as one JSON object per line, as it happens",
    )
    p.add_argument(
        "--project",
        help="with --json, instead of JOB: the events of the project's running jobs and of "
        "those submitted later, until Ctrl-C",
    )

    p = sub.add_parser("cancel", help="cancel a job")
    p.add_argument("job")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("gpus", help="devices in the pool: capacity, use and leases")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("workers", help="render workers and stream services: state, task, beats")
    p.add_argument("--json", action="store_true")
    wk = p.add_subparsers(dest="workers_command")
    for verb, what in (("disable", "drain a worker: it finishes its task, takes no new ones"),
                       ("enable", "let a disabled worker take tasks again")):  # fmt: skip
        t = wk.add_parser(verb, help=what)
        t.add_argument("name")
        t.add_argument("--json", action="store_true")

    p = sub.add_parser("usage", help="a project's GPU-hours, kWh, cost and CO2e")
    p.add_argument("--project", help="the project (default: every project with usage)")
    p.add_argument("--since", help="from a date (2026-11-01, 2026-11-01T12:00) or age (7d, 24h)")
    p.add_argument("--until", help="up to a date or age (default: now)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "worker", help="serve a device's render queue (one per GPU, or one CPU worker)"
    )
    p.add_argument("--device", choices=DEVICE_KINDS, help="overrides FARM_DEVICE")
    p.add_argument("--gpu-index", type=int, help="overrides FARM_GPU_INDEX")
    p.add_argument("--name", help="worker name (default host-device-pid)")
    p.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    p.add_argument(
        "--local-files",
        type=Path,
        metavar="DIR",
        help="the caller's own file set its Blender child starts with, so the first task on "
        "it keeps the child (`farm render` passes the .blend's folder)",
    )
    p.add_argument("--project", default="", help="the project --local-files belongs to")

    p = sub.add_parser(
        "stream", help="serve stream sessions on one device (one per GPU, or the CPU device)"
    )
    p.add_argument("--device", choices=DEVICE_KINDS, help="overrides FARM_DEVICE")
    p.add_argument("--gpu-index", type=int, help="overrides FARM_GPU_INDEX")
    p.add_argument("--port", type=int, help="overrides FARM_STREAM_PORT (0: a free port)")

    p = sub.add_parser(
        "stream-token", help="print an operator's stream token, signed with FARM_STREAM_SECRET"
    )
    p.add_argument("--ttl", type=float, default=3600.0, help="its lifetime, s (default 3600)")

    p = sub.add_parser("policy", help="which device classes each role of a project may lease")
    pol = p.add_subparsers(dest="policy_command", required=True)
    t = pol.add_parser("show", help="every role's device classes in the project")
    t.add_argument("project")
    t.add_argument("--json", action="store_true")
    t = pol.add_parser("set", help="the device classes a role may lease (none: nothing)")
    t.add_argument("project")
    t.add_argument("role", help="admin, member or viewer")
    t.add_argument("classes", nargs="*", help="device classes (cpu, t4, a100, ...; gpu: any GPU)")
    t.add_argument("--json", action="store_true")
    t = pol.add_parser("budget", help="the project's budget per period (jobs over it are refused)")
    t.add_argument("project")
    t.add_argument("amount", nargs="?", type=float, help="in FARM_USAGE_CURRENCY (none: show)")
    t.add_argument("--period", default="30d", help="an age: 30d, 7d, 24h (default 30d)")
    t.add_argument("--clear", action="store_true", help="remove the project's budget")
    t.add_argument("--json", action="store_true")

    p = sub.add_parser("web", help="serve the web UI and API (FARM_WEB_HOST:FARM_WEB_PORT)")
    p.add_argument("--host", help="overrides FARM_WEB_HOST")
    p.add_argument("--port", type=int, help="overrides FARM_WEB_PORT (0: a free port)")

    p = sub.add_parser(
        "frontdoor",
        help="one address for a farm split in cells: each request to its cell's web "
        "(FARM_CELLS, FARM_CONTROL_REDIS_URL; FARM_WEB_HOST:FARM_WEB_PORT)",
    )
    p.add_argument("--host", help="overrides FARM_WEB_HOST")
    p.add_argument("--port", type=int, help="overrides FARM_WEB_PORT (0: a free port)")

    p = sub.add_parser(
        "up", help="the whole local stack: Redis, web on 127.0.0.1:8080, workers, streams"
    )
    p.add_argument(
        "--data",
        type=Path,
        help="data folder (default FARM_DATA_DIR, else ~/.local/share/tessera or $XDG_DATA_HOME)",
    )
    p.add_argument("--port", type=int, help="web port (default 8080; 0: a free port)")

    p = sub.add_parser("token", help="create or revoke API tokens (farm admins)")
    tok = p.add_subparsers(dest="token_command", required=True)
    t = tok.add_parser("create", help="a new API token for a user (printed once)")
    t.add_argument("--user", required=True)
    t.add_argument("--project", help="add the user to this project (created if new)")
    t.add_argument("--role", default="member", help="admin, member or viewer (default member)")
    t.add_argument("--admin", action="store_true", help="the user administers the whole farm")
    t.add_argument(
        "--cell", default="", help="a new project's cell in a farm of cells (default FARM_CELL)"
    )
    t.add_argument("--json", action="store_true")
    t = tok.add_parser("revoke", help="revoke a token by its id")
    t.add_argument("token_id")
    controlcli.add_parsers(sub)
    operatorcli.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    try:
        settings = Settings.from_env()
        logging.basicConfig(
            level=settings.log_level,
            stream=sys.stderr,
            format="%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
        )
        result = COMMANDS[args.command](settings, args)
    except FarmError as exc:
        if as_json:
            print(json.dumps(exc.to_dict()))
        # one line a user can act on; details (log tails) follow on their own lines
        print(f"farm: error: {safe(exc.message)}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("farm: interrupted", file=sys.stderr)
        return 130
    if as_json and result is not None:
        print(json.dumps(result, indent=2, default=str))
    return 0


def _request(
    args: argparse.Namespace, settings: Settings, output: Path | str
) -> submission.RenderRequest:
    from farm import submission

    values = {name: getattr(args, name) for name in JOB_OPTIONS}
    return submission.request_from(values, output, settings)


def cmd_render(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import embedded

    if args.workers < 1 or args.workers > 64:
        raise BadParameter(f"--workers must be 1 to 64, not {args.workers}")
    output = args.output or str(Path("render") / args.blend.stem)
    req = _request(args, settings, output)
    outcome = embedded.render(
        settings, args.blend, req, args.workers, sys.stderr, keep_dir=args.keep_logs
    )
    job = outcome.job
    print(
        f"farm: {job.frames_done} frame(s) of {args.blend.name} written to {job.spec.output} "
        f"in {outcome.elapsed_s:.1f} s",
        file=sys.stderr,
    )
    print(f"farm: file list with sizes, sha256 and links: {job.spec.output}/manifest.json",
          file=sys.stderr)  # fmt: skip
    if not args.json:
        return None
    return {
        "job": job.to_dict(),
        "warnings": outcome.warnings,
        "inspection": outcome.report.to_dict(),
        "elapsed_s": outcome.elapsed_s,
        "worker_restarts": outcome.worker_restarts,
    }


def cmd_submit(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import jobstore, queue, submission
    from farm.accept import accept, estimate_job
    from farm.alloc.allocator import SlotAllocator
    from farm.blendfile import check_blend
    from farm.storage.base import sha256_file
    from farm.storage.factory import farm_storage
    from farm.uploadrecords import bytes_locked

    req = _request(args, settings, args.output)
    # refused before the file is stored
    submission.check_request(req)
    check_blend(args.blend)
    _require_worker(settings, req.device)
    store = jobstore.JobStore(
        jobstore.connect(settings.redis_url), settings.lease_ttl_s, cell=settings.cell
    )
    render_queue = queue.RenderQueue(queue.connect(settings.redis_url), req.device)
    allocator = SlotAllocator(store.conn, ttl_s=settings.lease_ttl_s)
    sha256 = sha256_file(args.blend)
    # A project deleting an upload of the same bytes removes them unless a job renders them
    # (farm.uploadrecords.delete): their lock is held until this job exists.
    with bytes_locked(store.conn, sha256, "a project is deleting an upload of the same file; "
                      "nothing was submitted, try again"):  # fmt: skip
        storage = farm_storage(settings)
        try:
            source = storage.put_upload(args.blend, sha256=sha256)
        finally:
            storage.close()
        if args.estimate:
            quoted = estimate_job(settings, store, render_queue, req, source, allocator)
            return _print_estimate(quoted, args.json)
        accepted = accept(settings, store, render_queue, req, source, allocator=allocator)
    for w in accepted.warnings:
        print(f"farm: warning: {safe(w)}", file=sys.stderr)
    if args.wait:
        _watch(store, accepted.job_id)
    if args.json:
        return store.status(accepted.job_id).to_dict()
    print(accepted.job_id)
    return None


def _print_estimate(quoted: Quoted, as_json: bool) -> dict[str, Any] | None:
    """`farm submit --estimate`'s table (or JSON): the job is not queued."""
    from farm.estimate import render_text

    standing = quoted.budget
    if as_json:
        return {
            "estimate": quoted.estimate.to_dict(),
            "budget": None if standing is None else standing.to_dict(),
            "warnings": quoted.warnings,
        }
    print(render_text(quoted.estimate))
    if standing is not None:
        cur = quoted.estimate.currency
        print(f"budget: {standing.left:.2f} {cur} left of {standing.budget.amount:.2f} {cur} "
              f"({standing.spent:.2f} spent, {standing.committed:.2f} committed)")  # fmt: skip
    print("farm: estimate only; nothing was queued", file=sys.stderr)
    return None


def _require_worker(settings: Settings, device: str) -> None:
    """Refuse at once, saying why, when no worker of ``device`` would take the inspection
    (not after FARM_INSPECT_TIMEOUT_S of waiting for one)."""
    from farm import jobstore, queuewhy, workerstate

    conn = jobstore.connect(settings.redis_url)
    try:
        queuewhy.require_worker(workerstate.registry_for(conn, settings).list(), device)
    finally:
        conn.close()


def cmd_status(settings: Settings, args: argparse.Namespace) -> Any:
    from farm import estimaterecords, jobstore, redisclock

    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    if args.job is None:
        jobs = [store.status(j) for j in store.job_ids()]
        if args.json:
            return [j.to_dict() for j in jobs]
        print(f"{'JOB':<26} {'STATE':<11} {'TILES':>11} {'FRAMES':>9}  NAME")
        for j in jobs:
            print(
                f"{j.id:<26} {j.state:<11} {j.tiles_done:>5}/{j.tiles_total:<5} "
                f"{j.frames_done:>4}/{j.frames_total:<4}  {safe(j.spec.name)}"
            )
        return None
    now = redisclock.now(store.conn)  # the clock the job's times are on
    job = estimaterecords.settled(store.conn, store.status(args.job), now,
                                  settings.estimate_errors_max)  # fmt: skip
    if args.json:
        return job.to_dict()
    started = job.started_s or job.created_s
    took = (job.finished_s or now) - started
    print(f"job {job.id} ({safe(job.spec.name)}): {job.state}")
    print(
        f"  tiles {job.tiles_done}/{job.tiles_total}, frames {job.frames_done}/{job.frames_total}, "
        f"failed attempts {job.tile_failures}, {took:.1f} s"
    )
    print(f"  output {safe(job.spec.output)}")
    if job.reason:
        print(f"  reason: {safe(job.reason)}")
    if job.scripts_blocked:
        print("  the file wanted to run Python scripts; they were blocked")
    for w in job.warnings:
        print(f"  warning: {safe(w)}")
    if job.estimate is not None:
        print(f"  {_estimate_line(job.estimate, job.estimate_actual, job.spec.device)}")
    return None


def _estimate_line(est: dict[str, Any], actual: dict[str, Any] | None, device: str) -> str:
    """Estimate against actual render device-seconds, as `farm status` prints them."""
    if actual is not None:
        return (
            f"estimate {actual['estimated_s']:.1f} s of rendering on {actual['device_class']}, "
            f"actual {actual['actual_s']:.1f} s (error {actual['error'] * 100:+.0f} %)"
        )
    shown = [c for c in est["classes"] if device == "cpu" and c["device_class"] == "cpu"]
    shown = shown or [c for c in est["classes"] if c["device_class"] != "cpu"] or est["classes"]
    parts = [f"{c['render_s']:.1f} s on {c['device_class']}" for c in shown]
    return f"estimate {', '.join(parts)} of rendering; actual once the job is done"


def _watch(store: jobstore.JobStore, job_id: str) -> None:
    from farm import embedded
    from farm.progress import ProgressBar

    status = store.status(job_id)
    bar = ProgressBar(sys.stderr, status.tiles_total, status.frames_total)
    embedded.watch(store, job_id, bar)


def cmd_watch(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import jobstore

    if (args.job is None) == (args.project is None):
        raise BadParameter("give a JOB, or --project P with --json")
    if args.project is not None and not args.json:
        raise BadParameter("--project streams JSON lines: add --json")
    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    if not args.json:
        _watch(store, args.job)
        return None
    from farm import jobevents

    # JSON lines, each job's events from its start; a job's last is its end (job_state)
    if args.project is not None:
        for event in jobevents.follow_project(store, args.project):  # until Ctrl-C
            print(json.dumps(event.to_dict()), flush=True)
        return None
    for event in jobevents.follow(store, args.job):
        print(json.dumps(event.to_dict()), flush=True)
    jobevents.outcome(store, args.job)
    return None


def cmd_cancel(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import jobstore
    from farm.states import JobState

    store = jobstore.JobStore(jobstore.connect(settings.redis_url))
    store.status(args.job)  # NotFound for an unknown id
    outcome = store.end_job(args.job, JobState.CANCELED, "canceled by request")
    if outcome != "ok":
        state = outcome.removeprefix("job_")
        if state != JobState.CANCELED.value:
            # a finished job is a conflict with the request, not a Ctrl-C (JobCanceled, 130)
            raise Conflict(
                f"job {args.job} has already ended: {state}; only a queued or running job can "
                "be canceled",
                job_id=args.job,
                state=state,
            )
    if args.json:
        return store.status(args.job).to_dict()
    print(f"job {args.job} canceled", file=sys.stderr)
    return None


def _device_changes(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a worker's or stream service's --device and --gpu-index override."""
    changes: dict[str, Any] = {}
    if args.device:
        changes["device"] = args.device
    if args.gpu_index is not None:
        changes["gpu_index"] = args.gpu_index
    return changes


def cmd_worker(settings: Settings, args: argparse.Namespace) -> None:
    from workers.child import BlenderChild

    settings = settings.with_(**_device_changes(args))
    name = args.name or settings.worker_name()
    # Blender starts first and imports bpy while this process imports the worker (rq, numpy).
    child = BlenderChild.for_settings(settings, name)
    if args.local_files is not None:
        # started seeing only these files: a task of another project or file set switches it
        child.use(args.project or None, args.local_files.resolve(), local=True)
    child.start(wait=False)
    try:
        from workers.worker import serve

        serve(settings, name=name, burst=args.burst, child=child)
    finally:
        child.kill()


def cmd_gpus(settings: Settings, args: argparse.Namespace) -> Any:
    from farm import jobstore
    from farm.alloc.allocator import SlotAllocator

    allocator = SlotAllocator(jobstore.connect(settings.redis_url), ttl_s=settings.lease_ttl_s)
    devices = allocator.devices()
    if args.json:
        return [dataclasses.asdict(d) for d in devices]
    if not devices:
        print("no devices registered: start a worker (`farm worker`) or `farm up`")
        return None
    print(
        f"{'DEVICE':<28} {'CLASS':<8} {'HOST':<16} {'STATE':<12} {'VRAM MiB':>15} "
        f"{'ENC':>7} {'SLOTS':>7} {'LEASES':>6}"
    )
    for d in devices:
        state = "ok" if d.alive and d.available else ("silent" if not d.alive else "unavailable")
        print(
            f"{d.id[:28]:<28} {d.device_class:<8} {d.host[:16]:<16} {state:<12} "
            f"{d.used_vram_mib:>7}/{d.vram_mib:<7} {d.used_encoder_sessions:>3}/"
            f"{d.encoder_sessions:<3} {d.used_render_slots:>3}/{d.render_slots:<3} "
            f"{len(d.leases):>6}"
        )
        if d.unavailable_reason:
            print(f"    unavailable: {d.unavailable_reason}")
        if d.unexplained_vram_mib:
            print(f"    {d.unexplained_vram_mib} MiB in use that no lease explains (held back)")
        if d.unexplained_encoder_sessions:
            print(f"    {d.unexplained_encoder_sessions} encoder session(s) open that no lease "
                  "explains (held back)")  # fmt: skip
        for lease in d.leases:
            print(
                f"    {lease.get('kind', '?'):<6} {lease.get('holder', '?'):<30} "
                f"vram {lease.get('vram', 0)} MiB, enc {lease.get('enc', 0)}, "
                f"slots {lease.get('slots', 0)}, token {lease.get('token', '?')}"
            )
    return None


def cmd_workers(settings: Settings, args: argparse.Namespace) -> Any:
    from farm import jobstore, redisclock, workerstate

    conn = jobstore.connect(settings.redis_url)
    try:
        registry = workerstate.registry_for(conn, settings)
        if args.workers_command in ("disable", "enable"):
            worker = registry.set_disabled(args.name, args.workers_command == "disable", "cli")
            if args.json:
                return worker.to_dict()
            print(f"{worker.name}: {worker.state.value}")
            return None
        workers = registry.list()
        now = redisclock.now(conn)
    finally:
        conn.close()
    if args.json:
        return [w.to_dict() for w in workers]
    if not workers:
        print("no worker has reported: start one with `farm worker` (or `farm up`)")
        return None
    print("\n".join(workerstate.render_text(workers, now)))
    return None


def cmd_stream(settings: Settings, args: argparse.Namespace) -> None:
    import asyncio
    import signal

    from encoder.app import serve_forever

    changes = _device_changes(args)
    if args.port is not None:
        changes["stream_port"] = args.port
    settings = settings.with_(**changes)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_forever(settings, stop)

    asyncio.run(run())


def cmd_usage(settings: Settings, args: argparse.Namespace) -> Any:
    from farm import jobstore
    from farm.alloc import usage

    conn = jobstore.connect(settings.redis_url)
    names = [args.project] if args.project else usage.projects(conn)
    summaries = [
        usage.project_usage(conn, settings, name, args.since, args.until) for name in names
    ]
    if args.json:
        return summaries[0] if args.project else summaries
    if not summaries:
        print("no usage recorded yet")
        return None
    print("\n\n".join(usage.render_text(s) for s in summaries))
    return None


def _web_address(settings: Settings, args: argparse.Namespace) -> Settings:
    """FARM_WEB_HOST and FARM_WEB_PORT, with --host and --port over them."""
    changes: dict[str, Any] = {}
    if args.host is not None:
        changes["web_host"] = args.host
    if args.port is not None:
        changes["web_port"] = args.port
    return settings.with_(**changes)


def cmd_web(settings: Settings, args: argparse.Namespace) -> None:
    from web.serve import serve

    serve(_web_address(settings, args))


def cmd_frontdoor(settings: Settings, args: argparse.Namespace) -> None:
    from web.serve import serve_frontdoor

    serve_frontdoor(_web_address(settings, args))


def cmd_up(settings: Settings, args: argparse.Namespace) -> None:
    from farm.stack import up

    up(settings.with_(web_port=settings.web_port if args.port is None else args.port), args.data)


def cmd_token(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import jobstore
    from farm.accounts import Accounts, check_role

    conn = jobstore.connect(settings.accounts_redis_url)
    try:
        accounts = Accounts(conn, cell=settings.cell)
        if args.token_command == "revoke":
            accounts.revoke_token(args.token_id)
            print(f"token {args.token_id} revoked", file=sys.stderr)
            return None
        accounts.ensure_user(args.user, admin=args.admin)
        if args.project:
            accounts.set_role(args.user, args.project, check_role(args.role), args.cell)
        issued = accounts.create_token(args.user)
    finally:
        conn.close()
    if args.json:
        return {"token": issued.token, "token_id": issued.token_id, "user": issued.user}
    print(issued.token)
    print(f"token id {issued.token_id} for {issued.user} (shown once; keep it)", file=sys.stderr)
    return None


def cmd_policy(settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import jobstore
    from farm.alloc.allocator import SlotAllocator

    conn = jobstore.connect(settings.redis_url)
    try:
        allocator = SlotAllocator(conn, ttl_s=settings.lease_ttl_s)
        if args.policy_command == "budget":
            return _budget(conn, settings, args)
        if args.policy_command == "set":
            allocator.set_policy(args.project, args.role, args.classes)
        policy = allocator.policy(args.project)
    finally:
        conn.close()
    if args.json:
        return {"project": args.project, "policy": {r: list(c) for r, c in policy.items()}}
    for role, classes in policy.items():
        print(f"{role:<8} {', '.join(classes) or '(none)'}")
    return None


def _budget(conn: Any, settings: Settings, args: argparse.Namespace) -> dict[str, Any] | None:
    from farm import budget, jobstore

    if args.clear:
        budget.set_budget(conn, args.project, None)
    elif args.amount is not None:
        budget.set_budget(conn, args.project, args.amount, args.period)
    standing = budget.standing(jobstore.JobStore(conn), settings, args.project)
    if args.json:
        return {"project": args.project, "budget": standing and standing.to_dict()}
    if standing is None:
        print(f"project {args.project} has no budget")
        return None
    cur = settings.usage_currency
    print(f"{standing.budget.amount:.2f} {cur} per {budget.period_text(standing.budget)}: "
          f"{standing.spent:.2f} spent, {standing.committed:.2f} committed, "
          f"{standing.left:.2f} left")  # fmt: skip
    return None


def cmd_stream_token(settings: Settings, args: argparse.Namespace) -> None:
    from farm import streamauth

    streamauth.check_secret(settings.stream_secret)
    print(streamauth.operator_token(settings.stream_secret, args.ttl))


COMMANDS = {
    "render": cmd_render,
    "submit": cmd_submit,
    "status": cmd_status,
    "watch": cmd_watch,
    "cancel": cmd_cancel,
    "worker": cmd_worker,
    "gpus": cmd_gpus,
    "workers": cmd_workers,
    "usage": cmd_usage,
    "stream": cmd_stream,
    "stream-token": cmd_stream_token,
    "policy": cmd_policy,
    "web": cmd_web,
    "frontdoor": cmd_frontdoor,
    "up": cmd_up,
    "token": cmd_token,
    **controlcli.COMMANDS,
    **operatorcli.COMMANDS,
}
