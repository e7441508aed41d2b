"""Routes that describe themselves: one table gives both the aiohttp routes and ``GET /openapi.json``.

An app lists its routes as :class:`Route` rows (method, path, handler, who may call
it, request and answer models). The same rows register the handlers, tell the auth
middleware which paths are open, and build an OpenAPI 3.1 document from the
pydantic models, so the published description cannot drift from what is served.
Clients, gateways and API fuzzers read it; it is served without credentials, as
it holds no state.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Access = Literal["open", "generation", "admin"]

OPENAPI_PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message"],
            "properties": {"message": {"type": "string"}},
        }
    },
}


@dataclass(frozen=True, slots=True)
class Route:
    """One method on one path, and what the API description says about it."""

    method: str
    path: str
    handler: Handler
    summary: str
    access: Access = "admin"
    body: type[BaseModel] | None = None
    """The JSON request body (``POST``/``PUT``); an empty body means every default."""
    query: type[BaseModel] | None = None
    """Query parameters (each field a string, as a query carries it)."""
    answer: type[BaseModel] | None = None
    """The JSON answer on success; ``None``: a JSON object not described further."""
    answer_status: int = 200
    media_type: str = "application/json"
    """The answer's media type (the Prometheus text format for ``/metrics``)."""

    def route_def(self, expect_handler: ExpectHandler | None = None) -> web.RouteDef:
        if expect_handler is None:
            return web.route(self.method, self.path, self.handler)
        return web.route(self.method, self.path, self.handler, expect_handler=expect_handler)

    @property
    def operation_id(self) -> str:
        name = self.path.strip("/").replace("/", "_").replace("{", "").replace("}", "") or "root"
        return f"{self.method.lower()}_{name}"


#: aiohttp's handler of a request's ``Expect`` header, run before any middleware.
ExpectHandler = Callable[[web.Request], Awaitable[web.StreamResponse | None]]


def route_defs(table: Iterable[Route], expect_handler: ExpectHandler | None = None) -> list[web.RouteDef]:
    return [route.route_def(expect_handler) for route in table]


def paths_with_access(table: Iterable[Route], access: Access) -> list[str]:
    return sorted({route.path for route in table if route.access == access})


def _parameters(route: Route) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for name in _path_names(route.path)
    ]
    if route.query is not None:
        for name, field in route.query.model_fields.items():
            params.append(
                {
                    "name": field.alias or name,
                    "in": "query",
                    "required": field.is_required(),
                    "schema": {"type": "string"},
                    "description": field.description or "",
                }
            )
    return params


def _path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


def _operation(route: Route, schemas: dict[Any, dict[str, Any]], secured: bool) -> dict[str, Any]:
    answer_schema = schemas[(route.answer, "serialization")] if route.answer is not None else {"type": "object"}
    if route.media_type != "application/json":
        answer_schema = {"type": "string"}
    op: dict[str, Any] = {
        "operationId": route.operation_id,
        "summary": route.summary,
        "tags": [route.access],
        "responses": {
            str(route.answer_status): {
                "description": "success",
                "content": {route.media_type: {"schema": answer_schema}},
            },
            "4XX": {
                "description": "refused; nothing changed",
                "content": {"application/json": {"schema": _ERROR_SCHEMA}},
            },
        },
    }
    params = _parameters(route)
    if params:
        op["parameters"] = params
    if route.body is not None:
        op["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": schemas[(route.body, "validation")]}},
        }
    if secured and route.access != "open":
        op["security"] = [{"bearer": []}]
    return op


def openapi_document(title: str, version: str, table: Sequence[Route], *, description: str = "") -> dict[str, Any]:
    """The OpenAPI 3.1 description of ``table`` (models under ``components/schemas``)."""
    wanted: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = []
    for route in table:
        if route.body is not None:
            wanted.append((route.body, "validation"))
        if route.answer is not None:
            wanted.append((route.answer, "serialization"))
    unique = list(dict.fromkeys(wanted))
    keyed, components = models_json_schema(unique, ref_template=_REF) if unique else ({}, {})
    schemas: dict[Any, dict[str, Any]] = dict(keyed)
    paths: dict[str, dict[str, Any]] = {}
    secured = any(route.access != "open" for route in table)
    for route in table:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schemas, secured)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": components.get("$defs", {})},
    }
    if secured:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def openapi_route(title: str, version: str, table: Sequence[Route], *, description: str = "") -> Route:
    """``GET /openapi.json`` for ``table`` (built once, when the app is built)."""
    body = json.dumps(openapi_document(title, version, table, description=description)).encode()

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    return Route("GET", OPENAPI_PATH, serve, "This API's OpenAPI 3.1 description", access="open")
