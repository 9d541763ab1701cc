"""`/openapi.json` is a valid OpenAPI 3.1 document that says what the node does: the rules
it states are the ones the node enforces (keys, integer-valued numbers, the body limit,
the lease cap), and a 405 names every method a path serves. The fuzzer's side of this is
tests/test_api_contract.py; a client built from the document, test_api_generated_client.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from node_harness import (
    ADMIN_TOKEN,
    ThreadNode,
    api_settings_for,
    now_ms,
    seed_rows,
    thread_node,
)
from openapi_spec_validator import OpenAPIV31SpecValidator

from api.endpoints import ENDPOINTS
from api.openapi import BODY_LIMIT_KEYWORD, openapi_document
from store.rows import MAX_KEY_BYTES
from wire.schemas import MAX_UTF8_BYTES_KEYWORD

SEEDED = 20
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp("openapi")
    seed_rows(directory / "node.sqlite", SEEDED)
    with thread_node(directory, tokens=True, max_body_bytes=LIMIT) as running:
        running.wait_published()
        yield running


@pytest.fixture(scope="module")
def client(node: ThreadNode) -> Iterator[httpx.Client]:
    with node.client(ADMIN_TOKEN) as opened:
        yield opened


@pytest.fixture(scope="module")
def document(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    found: dict[str, Any] = response.json()
    return found


def test_the_document_is_valid_openapi_3_1(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0"
    errors = [error.message for error in OpenAPIV31SpecValidator(document).iter_errors()]
    assert errors == []


def test_the_document_lists_every_endpoint(document: dict[str, Any]) -> None:
    operations = {
        (method.upper(), path) for path, item in document["paths"].items() for method in item
    }
    assert operations == {(e.method, e.path) for e in ENDPOINTS} | {("GET", "/openapi.json")}
    claim = document["components"]["schemas"]["ClaimRequest"]
    assert claim["required"] == ["max", "worker"]
    assert claim["properties"]["max"] == {"type": "integer", "minimum": 1, "maximum": 1000}


def test_every_error_an_operation_answers_is_problem_json(document: dict[str, Any]) -> None:
    problem = {"schema": {"$ref": "#/components/schemas/Problem"}}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            endpoint = next(
                (e for e in ENDPOINTS if (e.method, e.path) == (method.upper(), path)), None
            )
            responses = operation["responses"]
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    content = response["content"]
                    assert content.get("application/problem+json") == problem or (
                        status == "503" and endpoint is not None and endpoint.unavailable
                    ), (method, path, status)
            if endpoint is None:
                continue
            expected = {"200"}
            takes_body = endpoint.body is not None or bool(endpoint.raw_body)
            if takes_body:
                expected |= {"400", "413", "422"}
            if endpoint.raw_body:
                expected.add("415")
            if endpoint.query or endpoint.path_params:
                expected.add("422")
            if endpoint.scope != "public":
                expected |= {"401", "403"}
            if endpoint.uses_store or endpoint.unavailable:
                expected.add("503")
            if endpoint.writes_store:
                expected.add("507")
            expected |= {str(status) for status in endpoint.errors}
            assert set(responses) == expected, (method, path)


def test_the_sitemap_upload_states_its_body_and_its_400(document: dict[str, Any]) -> None:
    operation = document["paths"]["/v1/sitemaps"]["post"]
    assert set(operation["requestBody"]["content"]) == {
        "application/xml",
        "text/xml",
        "application/gzip",
        "application/x-gzip",
    }
    assert {"400", "415", "422"} <= set(operation["responses"])


def _parameter(document: dict[str, Any], method: str, path: str, name: str) -> dict[str, Any]:
    parameters: list[dict[str, Any]] = document["paths"][path][method]["parameters"]
    (found,) = [p for p in parameters if p["name"] == name]
    return found


def _document_takes_key(schema: dict[str, Any], key: str) -> bool:
    """The document's verdict: its JSON Schema keywords, and its byte limit beside them."""
    try:
        jsonschema.Draft202012Validator(schema).validate(key)
    except jsonschema.ValidationError:
        return False
    limit: int = schema[MAX_UTF8_BYTES_KEYWORD]
    return len(key.encode("utf-8")) <= limit


KEY_PROBES = [
    "",
    "ok",
    "a\x00b",
    "k" * MAX_KEY_BYTES,
    "k" * (MAX_KEY_BYTES + 1),
    "\u00e9" * (MAX_KEY_BYTES // 2),
    "\u00e9" * (MAX_KEY_BYTES // 2 + 1),  # within the characters, past the bytes
]


@pytest.mark.parametrize("path", ["/v1/schedule", "/prerender_admin/explain"])
def test_a_key_parameter_is_refused_exactly_when_the_document_refuses_it(
    document: dict[str, Any], client: httpx.Client, path: str
) -> None:
    parameter = _parameter(document, "get", path, "key")
    # Without a key the schedule lists its rows; explain needs one.
    required = path != "/v1/schedule"
    assert parameter["required"] is required and parameter["in"] == "query"
    verdicts = []
    for key in KEY_PROBES:
        response = client.get(path, params={"key": key})
        assert response.status_code in (200, 404, 422), response.text
        refused = response.status_code == 422
        if refused:
            assert response.json()["field"] == "key"
        verdicts.append((repr(key)[:12], _document_takes_key(parameter["schema"], key), refused))
    assert [(key, takes) for key, takes, refused in verdicts if takes == refused] == []
    assert client.get(path).status_code == (422 if required else 200)


def test_a_route_in_the_path_is_refused_exactly_when_the_document_refuses_it(
    document: dict[str, Any], client: httpx.Client
) -> None:
    schema = _parameter(document, "put", "/v1/routes/{route}", "route")["schema"]
    for route in ("product", "a.b-c_d", "Upper", "-lead", "x" * 64, "x" * 65, "sp ace"):
        response = client.put(f"/v1/routes/{route}", json={})
        takes = jsonschema.Draft202012Validator(schema).is_valid(route)
        assert response.status_code == (200 if takes else 422), (route, response.text)


def test_a_site_pattern_is_refused_exactly_when_the_document_refuses_it(
    document: dict[str, Any], client: httpx.Client
) -> None:
    body = document["components"]["schemas"]["RouteUpdate"]
    schema = {**body["properties"]["site_pattern"], "components": document["components"]}
    patterns = [
        "*.example.com",
        "example.com",
        "customer-a",
        "*.co.uk",
        "www",
        "wwwx.example",
        "*.wwwx.example",
        "x" * 253,
        "*." + "x" * 249 + ".io",
        "x" * 254,
        "*.com",
        "*",
        "*.",
        "**.a.com",
        "a.*.example",
        "Example.com",
        "example.com.",
        "a..b",
        ".a",
        "www.example.com",
        "*.www.example.com",
        "a:80",
        "a b",
        "",
    ]
    for pattern in patterns:
        response = client.put("/v1/routes/patterned", json={"site_pattern": pattern})
        takes = jsonschema.Draft202012Validator(schema).is_valid(pattern)
        assert response.status_code == (200 if takes else 422), (pattern, response.text)


def test_integer_valued_numbers_are_taken_as_integers_on_every_endpoint(
    client: httpx.Client,
) -> None:
    due_at = float(now_ms() - 1000)
    written = client.post(
        "/v1/schedule",
        json={
            "upsert": [{"key": "k-int", "route": "r", "cadence_s": 60.0, "next_render_at": due_at}]
        },
    )
    assert written.status_code == 200, written.text
    row = client.get("/v1/schedule", params={"key": "k-int"}).json()
    assert (row["cadence_s"], row["next_render_at"]) == (60, int(due_at))
    route = client.put("/v1/routes/r", json={"default_cadence_s": 900.0})
    assert route.json()["default_cadence_s"] == 900
    settings = client.put("/v1/settings", json={"default_cadence_s": 7200.0})
    assert settings.json() == {"default_cadence_s": 7200}

    claimed = client.post("/v1/claims", json={"max": 1.0, "worker": "w", "lease_s": 30.0})
    assert claimed.status_code == 200, claimed.text
    (lease,) = claimed.json()["leases"]
    assert lease["lease_expires_at"] - now_ms() <= 30_000
    renewed = client.post(
        "/v1/leases/renew",
        json={"items": [{"key": lease["key"], "token": lease["token"], "lease_s": 600.0}]},
    ).json()["results"]
    assert renewed[0]["ok"] is True and renewed[0]["lease_expires_at"] - now_ms() > 500_000
    later = float(now_ms() + 3_600_000)
    item = {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
    done = client.post("/v1/completions", json={"items": [{**item, "next_render_at": later}]})
    assert done.json()["results"][0]["ok"] is True
    assert client.get("/v1/schedule", params={"key": lease["key"]}).json()["next_render_at"] == int(
        later
    )


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/claims", {"max": 1.5, "worker": "w"}, "$.max"),
        ("/v1/settings", {"default_cadence_s": 60.25}, "$.default_cadence_s"),
        ("/v1/claims", {"max": True, "worker": "w"}, "$.max"),
        ("/v1/claims", {"max": 1, "worker": 3.0}, "$.worker"),
    ],
)
def test_a_number_that_is_not_an_integer_is_still_refused(
    client: httpx.Client, path: str, body: dict[str, Any], field: str
) -> None:
    method = client.put if path == "/v1/settings" else client.post
    response = method(path, json=body)
    assert response.status_code == 422 and response.json()["field"] == field


def test_a_405_lists_every_method_the_path_serves(
    document: dict[str, Any], client: httpx.Client
) -> None:
    for path, item in document["paths"].items():
        url = path.replace("{route}", "product")
        served = {method.upper() for method in item}
        if "GET" in served:
            served.add("HEAD")  # starlette answers HEAD wherever it answers GET
        response = client.request("DELETE", url)
        assert response.status_code == 405, path
        assert response.headers["content-type"] == "application/problem+json"
        allowed = {method.strip() for method in response.headers["allow"].split(",")}
        assert allowed == served, path


def test_the_body_limit_is_stated_and_kept(document: dict[str, Any], client: httpx.Client) -> None:
    for path, item in document["paths"].items():
        for operation in item.values():
            if "requestBody" in operation:
                assert operation["requestBody"][BODY_LIMIT_KEYWORD] == LIMIT, path
    keys = [f"k{i:06d}" for i in range(LIMIT // 10)]
    response = client.post("/v1/schedule", json={"delete": keys[:1000]})
    assert response.status_code == 200
    response = client.post("/v1/schedule", json={"delete": keys})
    assert response.status_code == 413 and "must be at most" in response.json()["detail"]


def test_the_document_states_this_nodes_lease_cap() -> None:
    def lease_maxima(max_lease_s: int) -> list[int]:
        settings = api_settings_for(max_lease_s=max_lease_s)
        schemas = openapi_document(ENDPOINTS, settings)["components"]["schemas"]
        found = []
        for name in ("ClaimRequest", "RenewItem"):
            (integer,) = [
                option
                for option in schemas[name]["properties"]["lease_s"]["anyOf"]
                if option.get("type") == "integer"
            ]
            found.append(integer["maximum"])
        return found

    assert lease_maxima(3600) == [3600, 3600]
    assert lease_maxima(120) == [120, 120]


def test_a_site_in_the_path_is_refused_exactly_when_the_document_refuses_it(
    document: dict[str, Any], client: httpx.Client
) -> None:
    for method in ("get", "put"):
        schema = _parameter(document, method, "/v1/sites/{site}", "site")["schema"]
        for site in (
            "example.com",
            "WWW.Example.com:8080",
            "xn--bcher-kva.example",
            "a_b-c",
            ".lead",
            "port:",
            "x" * 259,
            "x" * 260,
            "sp ace",
            "caf\u00e9.example",
        ):
            response = client.request(method.upper(), f"/v1/sites/{site}", json={})
            takes = jsonschema.Draft202012Validator(schema).is_valid(site)
            assert response.status_code == (200 if takes else 422), (site, response.text)


def test_the_document_states_this_nodes_site_permits() -> None:
    def maximum(permits: int) -> int:
        settings = api_settings_for(site_permits_max=permits)
        schemas = openapi_document(ENDPOINTS, settings)["components"]["schemas"]
        (integer,) = [
            option
            for option in schemas["SiteUpdate"]["properties"]["max_in_flight"]["anyOf"]
            if option.get("type") == "integer"
        ]
        return int(integer["maximum"])

    assert maximum(64) == 64 and maximum(4096) == 4096
