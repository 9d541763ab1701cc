"""`/openapi.json`, generated from the endpoint table, the msgspec types it names and the
node's own settings (its body limit, its lease cap).

Every constraint the server enforces is stated where the type that enforces it is made
(wire.schemas); what an operation can answer follows from what its handler does: a body
is read (400, 413, 422), a parameter is checked (422), a token is asked for (401, 403),
the store is used (503 when it is busy or unreachable) or written (507 when its disk is
full), each with the problem+json shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import UnionType
from typing import Any, get_args

import msgspec

from api.endpoints import Endpoint
from api.node import ApiSettings
from api.params import Param
from api.problems import PROBLEM_TYPE, Problem
from wire import schemas as wire_schemas
from wire.schemas import LEASE_CAP_KEYWORD

REF = "#/components/schemas/{name}"
VERSION = "1"
OPENAPI_PATH = "/openapi.json"
# The body limit, on each request body: JSON Schema cannot bound a body's size in bytes.
BODY_LIMIT_KEYWORD = "x-maxBodyBytes"
OPEN_OBJECT = {"type": "object", "additionalProperties": True}
# Every 503 and 507 the node sends carries it (api.app, api.claims, api.admin, api.cluster).
RETRY_AFTER = {
    "description": "Seconds to wait.",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9]+$"},
}


def operation_id(method: str, path: str) -> str:
    name = f"{method.lower()}{path}"
    for old, new in (("/", "_"), ("{", ""), ("}", ""), ("-", "_"), (".", "_")):
        name = name.replace(old, new)
    return name


def _components(
    endpoints: Sequence[Endpoint], settings: ApiSettings
) -> tuple[dict[type, dict[str, Any]], dict[str, Any]]:
    types: list[type] = [Problem]
    unions: list[Any] = []
    for endpoint in endpoints:
        for type_ in (endpoint.body, endpoint.response, endpoint.unavailable):
            if type_ is None or type_ is dict:
                continue
            # A response that is one of several Structs: each is a component, and the
            # response is any of them (msgspec takes a union of Structs only if tagged).
            members = get_args(type_) if isinstance(type_, UnionType) else (type_,)
            if len(members) > 1 and type_ not in unions:
                unions.append(type_)
            types.extend(m for m in members if m not in types)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    refs: dict[Any, Any] = dict(zip(types, schemas, strict=True))
    for union in unions:
        refs[union] = {"anyOf": [refs[member] for member in get_args(union)]}
    # A rule across fields, stated on the Struct itself (wire.schemas.ScheduleRequest), on
    # a body's type or on one it holds (wire.schemas.CompletionItem).
    for name, component in components.items():
        extra = getattr(getattr(wire_schemas, name, None), "json_schema_extra", None)
        if extra:
            component.update(extra)
    caps = {"max_lease_s": settings.max_lease_s, "site_permits_max": settings.site_permits_max}
    _cap_by_settings(components, caps)
    return refs, components


def _cap_by_settings(schema: Any, caps: dict[str, int]) -> None:
    """A value this node refuses past one of its settings (max_lease_s for a lease's
    length, site_permits_max for a site's max in flight) is stated with that cap."""
    if isinstance(schema, dict):
        setting = schema.get(LEASE_CAP_KEYWORD)
        if setting in caps and "maximum" in schema:
            schema["maximum"] = min(schema["maximum"], caps[setting])
        for value in schema.values():
            _cap_by_settings(value, caps)
    elif isinstance(schema, list):
        for value in schema:
            _cap_by_settings(value, caps)


def _problem(description: str, problem: dict[str, Any], **headers: str) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {PROBLEM_TYPE: problem}}
    if headers:
        response["headers"] = {
            name: {"description": text, "schema": {"type": "string"}}
            for name, text in headers.items()
        }
    return response


def _parameters(endpoint: Endpoint) -> list[dict[str, Any]]:
    return [
        {
            "name": param.name,
            "in": where,
            "required": param.default is None and not param.optional,
            "description": param.description,
            "schema": _param_schema(param),
        }
        for where, params in (("path", endpoint.path_params), ("query", endpoint.query))
        for param in params
    ]


def _param_schema(param: Param) -> dict[str, Any]:
    schema: dict[str, Any] = msgspec.json.schema(param.schema)
    if param.default is not None:
        schema["default"] = msgspec.convert(param.default, param.schema, strict=False)
    return schema


def _request_body(
    endpoint: Endpoint, refs: dict[type, Any], components: dict[str, Any], limit: int
) -> dict[str, Any]:
    if endpoint.raw_body:
        content = {}
        for media_type, schema in endpoint.raw_body.items():
            # A titled schema is a component, so media types that share it share one model.
            if "title" in schema:
                components[schema["title"]] = schema
                schema = {"$ref": f"#/components/schemas/{schema['title']}"}
            content[media_type] = {"schema": schema}
        what = (
            "The document itself as the body, in one of these media types (another: 415); "
            "bytes that are not one are refused (422)"
        )
    else:
        assert endpoint.body is not None
        content = {"application/json": {"schema": refs[endpoint.body]}}
        what = "JSON. An integer field takes an integer-valued number (`300.0`) as the integer"
    return {
        "required": True,
        "description": f"{what}. At most {limit} bytes (413 beyond).",
        "content": content,
        BODY_LIMIT_KEYWORD: limit,
    }


def _responses(
    endpoint: Endpoint, refs: dict[type, Any], problem: dict[str, Any]
) -> dict[str, Any]:
    if endpoint.response is not None:
        schema = OPEN_OBJECT if endpoint.response is dict else refs[endpoint.response]
        ok = {"description": "OK", "content": {"application/json": {"schema": schema}}}
    else:
        ok = {"description": "OK", "content": {endpoint.media_type: {"schema": {"type": "string"}}}}
    responses: dict[str, Any] = {"200": ok}
    has_body = endpoint.body is not None or bool(endpoint.raw_body)
    if has_body:
        malformed = "not JSON, " if endpoint.body is not None else ""
        responses["400"] = _problem(
            f"The body is {malformed}empty, or its Content-Length is not a number.", problem
        )
    if endpoint.scope != "public":
        challenge = "The bearer challenge (RFC 6750)."
        responses["401"] = _problem(
            "No bearer token, or one this node does not know.",
            problem,
            **{"WWW-Authenticate": challenge},
        )
        responses["403"] = _problem(
            "The token does not open this endpoint.", problem, **{"WWW-Authenticate": challenge}
        )
    if 404 in endpoint.errors:
        responses["404"] = _problem("No row has that key.", problem)
    if has_body:
        responses["413"] = _problem("The body is over the node's limit.", problem)
    if endpoint.raw_body:
        responses["415"] = _problem(
            f"The Content-Type is none of {', '.join(endpoint.raw_body)}.", problem
        )
    if has_body or endpoint.query or endpoint.path_params:
        responses["422"] = _problem(
            "A field or parameter breaks the schema or a rule stated beside it; `field` names "
            "it. Nothing was changed.",
            problem,
        )
    if endpoint.writes_store:
        responses["507"] = _problem(
            "The store's disk is full or failing: nothing was written. Claims and reads go "
            "on; retry after Retry-After.",
            problem,
        )
        responses["507"]["headers"] = {"Retry-After": RETRY_AFTER}
    unavailable: dict[str, Any] = {}
    if endpoint.uses_store:
        unavailable[PROBLEM_TYPE] = problem
    if endpoint.unavailable is not None:
        schema = OPEN_OBJECT if endpoint.unavailable is dict else refs[endpoint.unavailable]
        unavailable["application/json"] = {"schema": schema}
    if unavailable:
        responses["503"] = {
            "description": "Not now: the node is not ready, or its store is busy or "
            "unreachable (problem+json). Nothing was changed; retry after Retry-After.",
            "headers": {"Retry-After": RETRY_AFTER},
            "content": unavailable,
        }
    return responses


def openapi_document(endpoints: Sequence[Endpoint], settings: ApiSettings) -> dict[str, Any]:
    refs, components = _components(endpoints, settings)
    problem = {"schema": refs[Problem]}
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        operation: dict[str, Any] = {
            "operationId": operation_id(endpoint.method, endpoint.path),
            "summary": endpoint.summary,
        }
        parameters = _parameters(endpoint)
        if parameters:
            operation["parameters"] = parameters
        if endpoint.body is not None or endpoint.raw_body:
            operation["requestBody"] = _request_body(
                endpoint, refs, components, settings.max_body_bytes
            )
        operation["responses"] = _responses(endpoint, refs, problem)
        if endpoint.scope != "public":
            operation["security"] = [{"bearer": []}]
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = operation
    paths[OPENAPI_PATH] = {
        "get": {
            "operationId": "get_openapi",
            "summary": "This document.",
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": OPEN_OBJECT}},
                }
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "renderqueue",
            "version": VERSION,
            "description": "A render queue node: claims for the fleet, the schedule, admin. "
            "A method a path does not serve is answered 405 with `Allow` listing those it "
            "does. Errors are application/problem+json (RFC 9457).",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
