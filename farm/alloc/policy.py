"""The device policy of projects: which device classes each role of a project may lease.

One vocabulary, the allocator's: a policy names device classes as agents register them
(``cpu``, ``t4``, ``a100``, or a class FARM_DEVICE_OVERRIDES gives) and ``gpu``, which stands
for every class but ``cpu`` (so a policy set before a farm's GPUs are known still means
something). A role the project sets nothing for gets DEFAULT's. The acquire script applies the
policy to every request that names a role (farm.alloc.scripts renders DEFAULT into it); the
checks here answer the same question in Python, where a caller picks a device before asking.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from farm.accounts import ROLES, check_role
from farm.alloc.devices import CPU_CLASS
from farm.errors import BadParameter, Forbidden

#: the name that stands for every GPU class
GPU = "gpu"
#: what each role may use where its project sets nothing: viewers watch, they never lease
DEFAULT: dict[str, tuple[str, ...]] = {
    "admin": (CPU_CLASS, GPU),
    "member": (CPU_CLASS, GPU),
    "viewer": (),
}
#: a device class as a policy may name it (a comma would split it in the stored list)
CLASS_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

assert set(DEFAULT) == set(ROLES), "every role needs a default policy"


def check_classes(classes: Iterable[str]) -> tuple[str, ...]:
    """The classes, each once and in order; BadParameter for a name no device can have."""
    out: list[str] = []
    for name in classes:
        if not isinstance(name, str) or not CLASS_RE.fullmatch(name):
            raise BadParameter(
                f"device class {name!r} must be 1 to 64 letters, digits or . _ - (a class as "
                f"`farm gpus` lists it: cpu, t4, a100, ...; or {GPU} for every GPU class)",
                device_class=str(name),
            )
        if name not in out:
            out.append(name)
    return tuple(out)


def parse(stored: str) -> tuple[str, ...]:
    return tuple(c for c in stored.split(",") if c)


def resolve(stored: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Every role's classes: what the project stored (role -> csv) over DEFAULT."""
    out = dict(DEFAULT)
    for role, classes in stored.items():
        if role in out:
            out[role] = parse(classes)
    return out


def permits(allowed: Iterable[str], device_class: str) -> bool:
    """Whether ``allowed`` covers ``device_class``; asked of ``gpu`` itself (a job for any GPU):
    whether it covers some GPU class."""
    allowed = tuple(allowed)
    if device_class == GPU:
        return any(c != CPU_CLASS for c in allowed)
    return device_class in allowed or (GPU in allowed and device_class != CPU_CLASS)


def refusal(project: str, role: str, allowed: Iterable[str], asked: str) -> Forbidden:
    """The error of a request the policy refuses, naming what the role may use instead."""
    allowed = tuple(allowed)
    shown = ", ".join(allowed) or "none"
    return Forbidden(
        f"in project {project!r} the {role} role may use device classes: {shown}; not "
        f"{asked!r} (the project's device policy; its admins change it)",
        project=project,
        role=role,
        device_class=asked,
        allowed=list(allowed),
    )


def check(project: str, role: str, allowed: Iterable[str], device_class: str) -> None:
    if not permits(allowed, device_class):
        raise refusal(project, check_role(role), allowed, device_class)
