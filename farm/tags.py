"""Tags: which workers may render a job (a worker needs every tag of the job) and the farm-wide
limits on how many tiles of a tag render at once."""

from __future__ import annotations

import re

from farm.errors import BadParameter

#: a tag: 1 to 32 lower-case letters, digits, ``_ . -``, starting with a letter or digit (no
#: ``+`` or ``~``: they join tags into the name of a tag set's queue)
TAG_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,31}")
#: tags one job may require
MAX_JOB_TAGS = 8
#: tags one worker may have
MAX_WORKER_TAGS = 32
#: the largest limit of one tag (a limit above the farm's workers limits nothing)
MAX_TAG_LIMIT = 100_000


def parse_tags(text: str, what: str = "tags", most: int = MAX_JOB_TAGS) -> tuple[str, ...]:
    """The tags of a comma-separated list, sorted and once each; refuses a bad name or more
    than ``most``."""
    names = sorted({p.strip() for p in text.split(",") if p.strip()})
    for name in names:
        if not TAG_RE.fullmatch(name):
            raise BadParameter(
                f"{what}: tag {name[:40]!r} must be 1 to 32 lower-case letters, digits, _ . or -,"
                " starting with a letter or digit",
                field="tags",
                tag=name[:40],
            )
    if len(names) > most:
        raise BadParameter(f"{what}: at most {most} tags, not {len(names)}", field="tags")
    return tuple(names)


def worker_tags(text: str) -> frozenset[str]:
    """FARM_WORKER_TAGS as a set (refused with the variable's name when malformed)."""
    return frozenset(parse_tags(text, "FARM_WORKER_TAGS", MAX_WORKER_TAGS))


def tag_limits(text: str) -> dict[str, int]:
    """FARM_TAG_LIMITS (JSON ``{"tag": K}``) as a dict; blank: no limits."""
    from farm.settings import json_object

    data = json_object(text, "FARM_TAG_LIMITS", 'of tag -> most tiles at once, {"lic": 4}')
    out: dict[str, int] = {}
    for name, k in data.items():
        parse_tags(name, "FARM_TAG_LIMITS")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_TAG_LIMIT:
            raise BadParameter(
                f"FARM_TAG_LIMITS: the limit of {name!r} must be a whole number 1 to "
                f"{MAX_TAG_LIMIT}, not {k!r}"
            )
        out[name] = k
    return out


def band_suffix(tags: tuple[str, ...]) -> str:
    """What a queue's name gets for the tiles of jobs with ``tags`` (``~a+b``; none: empty).
    A worker's pick reads the tag set back from the name (farm.queue)."""
    return "~" + "+".join(sorted(tags)) if tags else ""
