"""Why a job waits: the workers of its device kind as the registry sees them, against its queue
position and its project's device policy; and which kind of worker may inspect a file now."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from farm.alloc import policy
from farm.errors import NoWorker
from farm.settings import DEVICE_KINDS
from farm.workerstate import WorkerInfo, WorkerState


@dataclass(frozen=True)
class Why:
    """A queued job's reason, as a code (for scripts) and a sentence (for people)."""

    reason: str  # no_worker | policy | all_disabled | busy | starting | not_queued
    message: str
    device: str
    workers_online: int = 0
    workers_idle: int = 0
    workers_busy: int = 0
    workers_disabled: int = 0
    #: tasks of the device kind waiting before the job's first waiting tile (None: not known)
    tasks_ahead: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def label(kind: str) -> str:
    return kind.upper()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _all(n: int, kind: str) -> str:
    return f"the only {label(kind)} worker" if n == 1 else f"all {n} {label(kind)} workers"


def _are(n: int) -> str:
    return "is" if n == 1 else "are"


def render_workers(workers: Sequence[WorkerInfo], kind: str) -> list[WorkerInfo]:
    """The live render workers serving the queue of ``kind`` (cpu, gpu)."""
    return [w for w in workers if w.kind == "render" and w.queue == kind and w.alive]


def explain(
    kind: str,
    workers: Sequence[WorkerInfo],
    allowed: Sequence[str] | None = None,
    tasks_ahead: int | None = None,
) -> Why:
    """Why a queued job of ``kind`` has not started. ``allowed``: the device classes its
    submitter's role may lease (None: not checked); ``tasks_ahead``: its queue position."""
    mine = render_workers(workers, kind)
    if not mine:
        others = [w for k in DEVICE_KINDS if k != kind for w in render_workers(workers, k)]
        idle = [w for w in others if w.state is WorkerState.IDLE]
        if others:
            other = "/".join(sorted({label(w.queue) for w in others}))
            tail = f"{_plural(len(idle), other + ' worker')} idle"
        else:
            tail = "no render worker is online at all"
        start = f"`farm worker --device {kind}`"
        return Why("no_worker", f"no {label(kind)} worker online: {tail}; the job starts when "
                   f"a {label(kind)} worker ({start}) comes up", kind)  # fmt: skip
    disabled = [w for w in mine if w.disabled]
    counts = {
        "workers_online": len(mine),
        "workers_idle": sum(1 for w in mine if w.state is WorkerState.IDLE),
        "workers_busy": sum(1 for w in mine if w.busy),
        "workers_disabled": len(disabled),
    }
    if allowed is not None:
        permitted = [w for w in mine if policy.permits(allowed, w.device_class)]
        if not permitted:
            classes = ", ".join(sorted({w.device_class for w in mine}))
            shown = ", ".join(allowed) or "none"
            return Why("policy", f"the project's device policy lets the submitter's role use "
                       f"{shown}; the online {label(kind)} workers are {classes}", kind,
                       **counts)  # fmt: skip
        mine = permitted
    taking = [w for w in mine if not w.disabled]
    if not taking:
        return Why("all_disabled", f"{_all(len(mine), kind)} online {_are(len(mine))} disabled "
                   "by an operator; the job starts when one is enabled", kind,
                   **counts)  # fmt: skip
    if all(w.busy for w in taking):
        ahead = "" if tasks_ahead is None else f"; {_plural(tasks_ahead, 'task')} ahead of it"
        return Why("busy", f"{_all(len(taking), kind)} {_are(len(taking))} busy{ahead}", kind,
                   tasks_ahead=tasks_ahead, **counts)  # fmt: skip
    free = sum(1 for w in taking if not w.busy)
    return Why("starting", f"{_plural(free, label(kind) + ' worker')} idle: its tiles start "
               "within seconds", kind, tasks_ahead=tasks_ahead, **counts)  # fmt: skip


def inspecting_kind(workers: Sequence[WorkerInfo], wanted: str | None) -> str:
    """The device kind whose workers should inspect a file now (the report is the same on
    every device): ``wanted`` when one of its workers takes work, preferring a kind with an
    idle one; NoWorker at once, with the reason, when no worker would take it."""
    order = [wanted] if wanted else []
    order += [k for k in DEVICE_KINDS if k != wanted]
    taking = {k: [w for w in render_workers(workers, k) if not w.disabled] for k in order}
    for kind in order:
        if any(not w.busy for w in taking[kind]):
            return kind
    for kind in order:
        if taking[kind]:
            return kind
    why = explain(wanted or DEVICE_KINDS[0], workers)
    raise NoWorker(
        f"no render worker can inspect the file now ({why.message}); nothing was queued",
        reason=why.reason,
    )


def require_worker(workers: Sequence[WorkerInfo], kind: str) -> None:
    """NoWorker at once (the reason in it) unless a worker of ``kind`` would take a task:
    a client about to wait for one (`farm submit`'s inspection) is told now, not in 120 s."""
    if any(not w.disabled for w in render_workers(workers, kind)):
        return
    why = explain(kind, workers)
    raise NoWorker(f"{why.message}; nothing was queued", reason=why.reason)
