"""The one HTTP form of the farm's errors, for the web API and the stream services alike: each
error class's status, the ``{"error": {...}}`` body, and the headers that go with them.

Two choices the table makes. NeverFits is 422 ``never_fits``: the request is well formed but no
device could ever hold it (too large, no encoder), so asking again cannot help, a client error
distinct from a malformed one (400). NoCapacity is 503 ``no_capacity`` with Retry-After: the farm
is full *now* and will have room once leases end, which is what 503 and Retry-After say (409
would claim the request conflicts with something the client can change).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from farm.errors import (
    Conflict,
    FarmError,
    Forbidden,
    InputError,
    NeverFits,
    NoCapacity,
    NotFound,
    OverBudget,
    OverLimit,
    QueueError,
    StorageError,
    StreamError,
    TooLarge,
    Unauthorized,
    WrongCell,
)

#: seconds a client told 503 (no capacity now) or 429 (a project at one of its limits) waits
#: before it asks again
RETRY_AFTER_S = 5

#: HTTP status of each kind of farm error, most specific first (the first match wins; any
#: other FarmError is a 500)
STATUS: tuple[tuple[type[FarmError], int], ...] = (
    (Unauthorized, 401),
    (Forbidden, 403),
    (NotFound, 404),
    (WrongCell, 421),
    (Conflict, 409),
    (TooLarge, 413),
    (NeverFits, 422),
    (OverBudget, 402),
    (OverLimit, 429),
    (InputError, 400),
    (NoCapacity, 503),
    (StreamError, 503),
    (QueueError, 503),
    (StorageError, 503),
)
#: errors that end by themselves: the answer says when to ask again
RETRY_LATER: tuple[type[FarmError], ...] = (NoCapacity, OverLimit)


@dataclass(frozen=True)
class HttpError:
    """What an API answers for one error: status, JSON body and extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str]


def status_of(exc: FarmError) -> int:
    for cls, status in STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def error_body(code: str, message: str, **fields: Any) -> dict[str, Any]:
    """``{"error": {fields..., "code", "message"}}``; a field JSON cannot hold goes as text,
    and no field may replace the code or the message."""
    return {"error": {**_jsonable(fields), "code": code, "message": message}}


def http_error(exc: FarmError) -> HttpError:
    status = status_of(exc)
    headers = {}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="tessera"'
    if isinstance(exc, RETRY_LATER):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return HttpError(status, error_body(exc.code, exc.message, **exc.fields), headers)


def _jsonable(fields: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in fields.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = str(v)
    return out
