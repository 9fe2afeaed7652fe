"""GET /api/openapi.json: the OpenAPI 3.1 description, generated from the route table itself."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from aiohttp import web

from web.appkeys import ROUTES

if TYPE_CHECKING:
    from web.routes import Route

ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
            "required": ["code", "message"],
        }
    },
}


def _operation(route: Route) -> dict[str, Any]:
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", route.path)
    ]
    params += [
        {"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
        for name in route.query
    ]
    op: dict[str, Any] = {
        "summary": route.summary,
        "operationId": f"{route.handler.__module__.rsplit('.')[-1]}.{route.handler.__name__}",
        "tags": list(route.tags),
        "responses": {
            "200": {"description": "OK"},
            "4XX": {
                "description": "an error the client can fix",
                "content": {"application/json": {"schema": ERROR}},
            },
        },
    }
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {
                        "type": "object",
                        "properties": route.body,
                        "additionalProperties": False,
                    }
                }
            },
        }
    elif route.body_type is not None:
        op["requestBody"] = {
            "content": {route.body_type: {"schema": {"type": "string", "format": "binary"}}}
        }
    if route.public:
        op["security"] = []
    else:
        op["responses"]["401"] = {
            "description": "no valid token or session",
            "content": {"application/json": {"schema": ERROR}},
        }
    return op


def build(routes: list[Route]) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Tessera", "version": "1"},
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "cookie": {"type": "apiKey", "in": "cookie", "name": "tessera_session"},
            }
        },
        "security": [{"bearer": []}, {"cookie": []}],
        "paths": paths,
    }


async def spec(request: web.Request) -> web.Response:
    return web.json_response(build(list(request.app[ROUTES].values())))
