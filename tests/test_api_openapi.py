"""`/openapi.json` describes the running API, and fuzzing every endpoint it lists, with
bodies drawn from its own schemas and with junk, never yields a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_harness import ThreadNode, seed_rows, thread_node

SEEDED = [f"https://shop.example/p/{i:07d}" for i in range(20)]
JSON_503 = {"/v1/claims", "/readyz", "/prerender_admin/queue-state"}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp("fuzz")
    seed_rows(directory / "node.sqlite", len(SEEDED))
    with thread_node(directory) as running:
        running.wait_published()
        yield running


@pytest.fixture(scope="module")
def document(node: ThreadNode) -> dict[str, Any]:
    with node.client() as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200
    found: dict[str, Any] = response.json()
    return found


def test_the_document_lists_every_endpoint(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.")
    operations = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    assert operations >= {
        ("POST", "/v1/claims"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/leases/renew"),
        ("POST", "/v1/schedule"),
        ("GET", "/v1/schedule"),
        ("PUT", "/v1/routes/{route}"),
        ("GET", "/v1/routes"),
        ("PUT", "/v1/settings"),
        ("GET", "/prerender_admin/queue-state"),
        ("GET", "/prerender_admin/explain"),
        ("GET", "/prerender_admin/overview"),
        ("GET", "/metrics"),
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/openapi.json"),
    }
    claim = document["components"]["schemas"]["ClaimRequest"]
    assert claim["required"] == ["max", "worker"]
    assert claim["properties"]["max"] == {"type": "integer", "minimum": 1, "maximum": 1000}


# --- strategies from JSON Schema ----------------------------------------------------------


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        return st.deferred(
            lambda: from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components)
        )
    if "anyOf" in schema:
        return st.one_of([from_schema(option, components) for option in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = {
            name: from_schema(properties[name], components) for name in schema.get("required", [])
        }
        optional = {
            name: from_schema(sub, components)
            for name, sub in properties.items()
            if name not in required
        }
        if not properties:
            return st.dictionaries(st.text(max_size=5), json_values, max_size=3)
        return st.fixed_dictionaries(required, optional=optional)
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(
            from_schema(schema.get("items", {}), components),
            min_size=low,
            max_size=max(low, min(schema.get("maxItems", 4), 4)),
        )
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        low = schema.get("minLength", 0)
        return st.one_of(
            st.sampled_from(SEEDED),
            st.text(min_size=low, max_size=max(low, min(schema.get("maxLength", 40), 40))),
        )
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return json_values


json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def operations() -> list[tuple[str, str]]:
    from api.endpoints import ENDPOINTS

    return [(endpoint.method, endpoint.path) for endpoint in ENDPOINTS] + [("GET", "/openapi.json")]


def short_poll(body: Any) -> Any:
    """Long polls are cut to 0.2 s so the fuzz run stays quick."""
    wait = body.get("wait_s") if isinstance(body, dict) else None
    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait > 0.2:
        return {**body, "wait_s": 0.2}
    return body


def check(response: httpx.Response, path: str) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text}"
    if response.status_code >= 400 and not (response.status_code == 503 and path in JSON_503):
        assert response.headers["content-type"] == "application/problem+json", response.text


@pytest.mark.parametrize(("method", "path"), operations())
def test_fuzz_never_a_5xx(
    node: ThreadNode, document: dict[str, Any], method: str, path: str
) -> None:
    operation = document["paths"][path][method.lower()]
    components = document["components"]["schemas"]
    body_schema = (
        operation.get("requestBody", {})
        .get("content", {})
        .get("application/json", {})
        .get("schema")
    )
    text = st.text(max_size=30) | st.sampled_from(SEEDED)
    query = st.fixed_dictionaries(
        {p["name"]: text for p in operation.get("parameters", []) if p["in"] == "query"}
    )
    path_values = st.fixed_dictionaries(
        {
            p["name"]: st.text(min_size=1, max_size=30).filter(
                lambda v: "/" not in v and v not in (".", "..")
            )
            | st.sampled_from(["product", "article"])
            for p in operation.get("parameters", [])
            if p["in"] == "path"
        }
    )
    bodies: st.SearchStrategy[Any] = st.none()
    if body_schema is not None:
        bodies = st.one_of(
            from_schema(body_schema, components).map(lambda b: ("json", b)),
            json_values.map(lambda b: ("json", b)),
            st.binary(max_size=200).map(lambda b: ("raw", b)),
        )

    @settings(
        max_examples=60,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        database=None,
    )
    @given(query=query, path_values=path_values, body=bodies)
    def run(query: dict[str, str], path_values: dict[str, str], body: Any) -> None:
        url = path
        for name, value in path_values.items():
            url = url.replace("{" + name + "}", quote(value, safe=""))
        kwargs: dict[str, Any] = {"params": query}
        if body is not None:
            kind, value = body
            if kind == "json":
                kwargs["content"] = json.dumps(short_poll(value)).encode()
            else:
                kwargs["content"] = value
            kwargs["headers"] = {"content-type": "application/json"}
        check(client.request(method, url, **kwargs), path)

    with node.client() as client:
        run()
