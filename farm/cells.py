"""A farm split in cells: names, the ids that carry them, and where a project lives.

A cell is a whole farm (its Redis, web, workers and stream services) for a pool of hosts. Its
jobs are its own: their ids begin with the cell's name (``c2-20261207-101500-0123abcd``), so a
front door (web/frontdoor.py) sends a request about a job to its cell by the id alone. A project
is pinned to one cell, recorded with the project in the control Redis that every cell shares
for accounts; its jobs, uploads, streams, limits and usage all live in that cell.
"""

from __future__ import annotations

import re
import secrets
from urllib.parse import urlsplit

from farm.errors import BadParameter

CELL_RE = re.compile(r"[a-z][a-z0-9]{0,7}")
#: a job id as farm.jobstore makes them, with its cell's name in front in a farm of cells
JOB_ID_RE = re.compile(r"(?:[a-z][a-z0-9]{0,7}-)?\d{8}-\d{6}-[0-9a-f]{8}")


def check_cell(name: str) -> str:
    if not CELL_RE.fullmatch(name):
        raise BadParameter(
            f"cell name {name!r} must be a lowercase letter, then up to 7 lowercase letters or "
            "digits (FARM_CELL)"
        )
    return name


def parse_cells(text: str) -> dict[str, str]:
    """FARM_CELLS: ``name=url`` pairs, comma-separated, in order (the first is the default)."""
    cells: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not url:
            raise BadParameter(f"FARM_CELLS: {item!r} is not name=url")
        check_cell(name)
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise BadParameter(f"FARM_CELLS: cell {name}'s web {url!r} is not an http(s) URL")
        if name in cells:
            raise BadParameter(f"FARM_CELLS: cell {name} is listed twice")
        cells[name] = url
    if not cells:
        raise BadParameter("FARM_CELLS lists no cell (name=url, comma-separated)")
    return cells


def named(cell: str, ident: str) -> str:
    """``ident`` as a cell's id: ``<cell>-<ident>`` in a farm of cells, itself in one of one."""
    return f"{cell}-{ident}" if cell else ident


def new_id(cell: str, hex_digits: int) -> str:
    """A random id of ``hex_digits`` that names its cell (an upload session, a stream session):
    the front door sends a request about it to its cell by the id alone."""
    return named(cell, secrets.token_hex((hex_digits + 1) // 2)[:hex_digits])


def cell_in(ident: str) -> str | None:
    """The cell an id names (``c2`` for ``c2-20261207-...`` or ``c2-0123abcd``), None for an
    id that names none (a farm of one cell's: a job id begins with digits)."""
    head, sep, _ = ident.partition("-")
    return head if sep and CELL_RE.fullmatch(head) else None
