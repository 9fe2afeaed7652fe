"""JSON in and out of the API: strict request bodies, and errors as {"error": {...}} bodies."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from aiohttp import web

from farm.errors import BadParameter, FarmError, TooLarge
from farm.httperrors import error_body, http_error, status_of

log = logging.getLogger("tessera.web")

#: largest JSON body a route reads (uploads stream their bodies, they never come here)
MAX_JSON_BYTES = 1 << 20


def error_response(exc: FarmError) -> web.Response:
    """The error's one HTTP form (farm.httperrors), as the stream services answer it too."""
    err = http_error(exc)
    return web.json_response(err.body, status=err.status, headers=err.headers)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Farm errors and aiohttp's own HTTP errors become JSON error bodies; the server goes on."""
    try:
        return await handler(request)
    except FarmError as exc:
        status = status_of(exc)
        level = logging.WARNING if status >= 500 else logging.INFO
        log.log(level, "event=request_failed method=%s path=%s status=%d code=%s message=%r",
                request.method, request.path, status, exc.code, exc.message)  # fmt: skip
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400 or not request.path.startswith("/api/"):
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            exc.status, "http_error"
        )
        return web.json_response(error_body(code, exc.reason), status=exc.status)
    except Exception:
        log.exception("event=request_crashed method=%s path=%s", request.method, request.path)
        if not request.path.startswith("/api/"):
            raise
        return web.json_response(
            error_body("internal", "the server failed on this request; it is logged"), status=500
        )


async def read_object(
    request: web.Request,
    fields: Mapping[str, type | tuple[type, ...]],
    required: Iterable[str] = (),
) -> dict[str, Any]:
    """The JSON object of the body, its fields checked against ``fields`` (name -> type).

    Unknown fields, a wrong type or a missing required field are a 400 naming the field; a
    field given as ``null`` counts as not given.
    """
    if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
        raise TooLarge(f"a JSON body may be at most {MAX_JSON_BYTES} bytes")
    raw = await request.content.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise TooLarge(f"a JSON body may be at most {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadParameter(f"the body is not valid JSON: {exc}", code_detail="bad_json") from None
    if not isinstance(data, dict):
        raise BadParameter(f"the body must be a JSON object, not {type(data).__name__}")
    return check_fields(data, fields, required)


def check_fields(
    data: dict[str, Any],
    fields: Mapping[str, type | tuple[type, ...]],
    required: Iterable[str] = (),
) -> dict[str, Any]:
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise BadParameter(
            f"unknown field(s): {', '.join(unknown)}; known: {', '.join(sorted(fields))}",
            fields=unknown,
        )
    out = {}
    for name, value in data.items():
        if value is None:
            continue
        want = fields[name]
        types = want if isinstance(want, tuple) else (want,)
        if not _is_instance(value, types):
            names = " or ".join(_type_name(t) for t in types)
            raise BadParameter(
                f"field {name!r} must be {names}, not {type(value).__name__}", field=name
            )
        out[name] = float(value) if float in types and int not in types else value
    missing = [r for r in required if r not in out]
    if missing:
        raise BadParameter(f"missing field(s): {', '.join(missing)}", fields=missing)
    return out


def _is_instance(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _type_name(t: type) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            list: "a list", dict: "an object"}.get(t, t.__name__)  # fmt: skip
