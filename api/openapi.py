"""`/openapi.json`, generated from the endpoint table and the msgspec Structs it names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from api.problems import PROBLEM_TYPE, Problem

if TYPE_CHECKING:
    from api.endpoints import Endpoint

REF = "#/components/schemas/{name}"
VERSION = "1"


def _schema_of(type_: type, refs: dict[type, dict[str, Any]]) -> dict[str, Any]:
    if type_ is dict:
        return {"type": "object", "additionalProperties": True}
    return refs[type_]


def openapi_document(endpoints: Sequence[Endpoint]) -> dict[str, Any]:
    types: list[type] = [Problem]
    for endpoint in endpoints:
        for type_ in (endpoint.body, endpoint.response, endpoint.unavailable):
            if type_ is not None and type_ is not dict and type_ not in types:
                types.append(type_)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    refs = dict(zip(types, schemas, strict=True))
    problem = {PROBLEM_TYPE: {"schema": refs[Problem]}}
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in endpoints:
        operation: dict[str, Any] = {
            "operationId": f"{endpoint.method.lower()}{endpoint.path}".replace("/", "_")
            .replace("{", "")
            .replace("}", "")
            .replace("-", "_"),
            "summary": endpoint.summary,
            "responses": {},
        }
        parameters = [
            {
                "name": p.name,
                "in": "query",
                "required": p.required,
                "description": p.description,
                "schema": {"type": "string"},
            }
            for p in endpoint.query
        ] + [
            {
                "name": p.name,
                "in": "path",
                "required": True,
                "description": p.description,
                "schema": {"type": "string"},
            }
            for p in endpoint.path_params
        ]
        if parameters:
            operation["parameters"] = parameters
        if endpoint.body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[endpoint.body]}},
            }
        responses = operation["responses"]
        if endpoint.response is not None:
            responses["200"] = {
                "description": "OK",
                "content": {"application/json": {"schema": _schema_of(endpoint.response, refs)}},
            }
        else:
            responses["200"] = {
                "description": "OK",
                "content": {endpoint.media_type: {"schema": {"type": "string"}}},
            }
        if endpoint.body is not None or endpoint.query or endpoint.path_params:
            responses["422"] = {"description": "Invalid input", "content": problem}
        if endpoint.body is not None:
            responses["400"] = {"description": "Malformed JSON", "content": problem}
            responses["413"] = {"description": "Body too large", "content": problem}
        if endpoint.scope != "public":
            responses["401"] = {"description": "Missing or unknown token", "content": problem}
            responses["403"] = {"description": "Token lacks the scope", "content": problem}
        for status in endpoint.errors:
            responses[str(status)] = {"description": "Error", "content": problem}
        if endpoint.unavailable is not None:
            responses["503"] = {
                "description": "Not ready; see Retry-After",
                "content": {"application/json": {"schema": _schema_of(endpoint.unavailable, refs)}},
            }
        if endpoint.scope != "public":
            operation["security"] = [{"bearer": []}]
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = operation
    paths["/openapi.json"] = {
        "get": {
            "operationId": "get_openapi",
            "summary": "This document.",
            "responses": {"200": {"description": "OK"}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "renderqueue",
            "version": VERSION,
            "description": "A render queue node: claims for the fleet, the schedule, admin.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
