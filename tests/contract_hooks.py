"""What schemathesis needs to know about `/openapi.json` that JSON Schema cannot say, loaded
into its CLI by tests/schemathesis.toml's `hooks` for tests/test_api_contract.py.

- A key is at most MAX_KEY_BYTES bytes of UTF-8 as well as that many characters (the
  document's `x-maxUtf8Bytes`). The fuzzer cannot judge that rule, so a case holding a
  string within the characters but past the bytes is not sent: it would call it valid (and
  the node's 422 a failure) or invalid for another reason it did not mean.
  tests/test_api_openapi.py holds the node to the byte rule itself.
- The sitemap upload's body is a sitemap document: the document states a urlset for its
  XML types and only "the gzip of it" for its gzip types, which no generator can build.
  Valid ones are drawn here, in the kind each media type names (any URL imports: the
  default route rules).
- Claims' `wait_s` is cut to 0.2 s, in every phase: a long poll with nothing due waits it
  out, and a run of 30 s waits would only measure sleeping. A `wait_s` past the limit is
  sent as drawn.
"""

from __future__ import annotations

import gzip
from typing import Any
from xml.sax.saxutils import escape

import schemathesis
from hypothesis import strategies as st

from store.rows import MAX_KEY_BYTES
from wire.schemas import MAX_WAIT_S

LONGEST_POLL_S = 0.2


def _past_the_bytes_only(value: Any) -> bool:
    """A string the JSON Schema keywords allow by length but the byte rule refuses."""
    if isinstance(value, str):
        return len(value) <= MAX_KEY_BYTES < len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return any(_past_the_bytes_only(item) for item in value.values())
    if isinstance(value, list):
        return any(_past_the_bytes_only(item) for item in value)
    return False


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    return not _past_the_bytes_only(body)


@schemathesis.hook
def filter_query(context: Any, query: Any) -> bool:
    return not _past_the_bytes_only(query)


# XML 1.0 cannot carry most control characters, so a <loc> is drawn from printable text.
paths = st.text(
    alphabet=st.characters(min_codepoint=0x21, exclude_categories=("Cs", "Cc")), max_size=40
)


@st.composite
def sitemaps(draw: st.DrawFn) -> bytes:
    locations = draw(st.lists(paths, max_size=5, unique=True))
    urls = "".join(
        f"<url><loc>{escape('https://fuzz.example/' + path)}</loc></url>" for path in locations
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">{urls}</urlset>'
    ).encode()


for media_type in ("application/xml", "text/xml"):
    schemathesis.openapi.media_type(media_type, sitemaps())
for media_type in ("application/gzip", "application/x-gzip"):
    schemathesis.openapi.media_type(media_type, sitemaps().map(gzip.compress))


def _wait_cut(path: str | None, body: Any) -> Any:
    if path == "/v1/claims" and isinstance(body, dict):
        wait = body.get("wait_s")
        # Only a valid wait is cut: one past the limit stays, to be refused.
        if (
            isinstance(wait, int | float)
            and not isinstance(wait, bool)
            and LONGEST_POLL_S < wait <= MAX_WAIT_S
        ):
            return {**body, "wait_s": LONGEST_POLL_S}
    return body


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    operation = context.operation
    return _wait_cut(None if operation is None else operation.path, body)


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    # The coverage phase's cases are not drawn through map_body. Only a claim's body is
    # set again: setting one resets what schemathesis knows of how the case was drawn (a
    # sitemap drawn for its media type would count as a body that breaks the schema).
    if case.operation.path == "/v1/claims":
        case.body = _wait_cut(case.operation.path, case.body)
