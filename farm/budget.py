"""A project's budget: an amount (FARM_USAGE_PRICES' currency) per period, part of its policy;
a job whose estimated cost is more than the period has left is refused with the numbers.

What is left = the budget - the cost of the project's leases in the period (farm.alloc.usage)
- what its unfinished jobs' estimates still have to spend (their estimated cost times the share
of their tiles not done). A job without an estimate commits nothing: a project with a budget
has every job estimated at submission (the clients ask for a probe).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from farm import keys, redisclock
from farm.alloc import usage
from farm.errors import BadParameter, OverBudget
from farm.estimate import ClassEstimate, Estimate
from farm.estimaterecords import ESTIMATE_FIELD
from farm.jobstore import JobStore
from farm.redisclient import Redis, guard
from farm.settings import Settings
from farm.states import JOB_FINAL, JobState

#: jobs of the project read for what they commit (its newest; older ones are long done)
ACTIVE_JOBS_READ = 500


@dataclass(frozen=True)
class Budget:
    amount: float
    period_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"amount": self.amount, "period_s": self.period_s, "period": period_text(self)}


def period_text(b: Budget) -> str:
    days = b.period_s / 86400
    return f"{days:g} d" if days >= 1 else f"{b.period_s / 3600:g} h"


def get(conn: Redis, project: str) -> Budget | None:
    stored = guard(conn.hgetall, keys.project_budget(project))
    if not stored:
        return None
    data = {_text(k): float(v) for k, v in stored.items()}
    return Budget(data["amount"], data["period_s"])


def set_budget(conn: Redis, project: str, amount: float | None, period: str = "30d") -> None:
    """Set the project's budget per ``period`` (an age: 30d, 7d, 24h); None removes it."""
    if amount is None:
        guard(conn.delete, keys.project_budget(project))
        return
    if isinstance(amount, bool) or not isinstance(amount, int | float) or amount < 0:
        raise BadParameter(f"a budget must be a number of 0 or more, not {amount!r}")
    now = 1e9
    period_s = now - usage.parse_time(period, now)
    if period_s <= 0:
        raise BadParameter(f"a budget's period must be an age such as 30d or 24h, not {period!r}")
    mapping = {"amount": float(amount), "period_s": period_s}
    guard(conn.hset, keys.project_budget(project), mapping=mapping)


def job_cost(est: Estimate, device_kind: str) -> ClassEstimate | None:
    """The estimate a budget holds a job of ``device_kind`` (cpu or gpu) to: the CPU's, or the
    dearest GPU class shown (any of them may render it); the probe's class where none of the
    kind is online (the job waits for one, and is not let through unpriced)."""
    if device_kind == "cpu":
        return est.on("cpu") or est.on(est.probe_class)
    gpus = [c for c in est.classes if c.device_class != "cpu"]
    return max(gpus, key=lambda c: c.cost) if gpus else est.on(est.probe_class)


@dataclass(frozen=True)
class Standing:
    budget: Budget
    spent: float
    committed: float

    @property
    def left(self) -> float:
        return self.budget.amount - self.spent - self.committed

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.budget.to_dict(),
            "spent": round(self.spent, 4),
            "committed": round(self.committed, 4),
            "left": round(self.left, 4),
        }


def standing(
    store: JobStore, settings: Settings, project: str, now_s: float | None = None
) -> Standing | None:
    """The project's budget and what the period has spent and committed; None without one."""
    b = get(store.conn, project)
    if b is None:
        return None
    now = redisclock.now(store.conn) if now_s is None else now_s
    since = f"{b.period_s:.0f}s"
    spent = usage.project_usage(store.conn, settings, project, since=since, now_s=now)
    committed = 0.0
    for job_id, _created in store.project_job_ids(project, ACTIVE_JOBS_READ):
        committed += _left_to_spend(store, job_id)
    return Standing(b, float(spent["total"]["cost"]), committed)


def _left_to_spend(store: JobStore, job_id: str) -> float:
    state, text = guard(store.conn.hmget, keys.job(job_id), ["state", ESTIMATE_FIELD])
    if not text or state is None or JobState(_text(state)) in JOB_FINAL:
        return 0.0
    status = store.status(job_id)
    shown = job_cost(Estimate.from_dict(json.loads(text)), status.spec.device)
    if shown is None:
        return 0.0
    undone = 1 - status.tiles_done / max(1, status.tiles_total)
    return shown.cost * undone


def check(
    store: JobStore, settings: Settings, project: str, est: Estimate, device_kind: str
) -> Standing | None:
    """Refuse (OverBudget, with the numbers) a job whose estimate is more than is left."""
    found = standing(store, settings, project)
    if found is None:
        return None
    shown = job_cost(est, device_kind)
    cost = shown.cost if shown is not None else 0.0
    if cost > found.left:
        cur = est.currency
        raise OverBudget(
            f"the job's estimated cost is {cost:.2f} {cur} on {device_kind}, more than the "
            f"{max(0.0, found.left):.2f} {cur} left of project {project!r}'s budget of "
            f"{found.budget.amount:.2f} {cur} per {period_text(found.budget)} "
            f"({found.spent:.2f} spent, {found.committed:.2f} committed to unfinished jobs); "
            "render fewer frames or samples, or ask the project's admins to raise the budget",
            project=project,
            estimate=round(cost, 4),
            left=round(found.left, 4),
            budget=found.budget.amount,
            period_s=found.budget.period_s,
            spent=round(found.spent, 4),
            committed=round(found.committed, 4),
            currency=cur,
        )
    return found


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
