"""shm/keys.py and the C hash under it: SipHash-2-4 keyed by the store's secret.

A key's hash is persisted (the lease snapshot stores each slot's key hash, and a
restored table is probed with the hash a worker computes for the key now) and shared
(every node of a cluster divides the keys by it). A hash that changed, even for one
length, would leave every restored lease on a key no claimant can find and split the
cluster's ownership. So the values are pinned here (the reference SipHash-2-4
vectors, and URLs under a fixed secret as first shipped), and the C is compared with
a Python rendering of the published algorithm over arbitrary bytes and secrets.

The test session hashes under the secret tests/conftest.py sets; what a process does
before any secret, or under another one, runs in a child process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm import key_hash, key_hashes
from shm._atomics import key_hashes_into, key_site_hashes_into, siphash24
from shm.keys import (
    NO_SITE,
    SECRET_BYTES,
    SITE_MAX_BYTES,
    SecretConflict,
    fingerprint,
    key_site_hash,
    key_site_hashes,
    keyed_site_hash,
    secret_in_use,
    site_hash,
    site_of,
    site_pattern,
    use_secret,
)

_M = (1 << 64) - 1


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _M


def _rounds(v: list[int], n: int) -> None:
    for _ in range(n):
        v[0] = (v[0] + v[1]) & _M
        v[1] = _rotl(v[1], 13) ^ v[0]
        v[0] = _rotl(v[0], 32)
        v[2] = (v[2] + v[3]) & _M
        v[3] = _rotl(v[3], 16) ^ v[2]
        v[0] = (v[0] + v[3]) & _M
        v[3] = _rotl(v[3], 21) ^ v[0]
        v[2] = (v[2] + v[1]) & _M
        v[1] = _rotl(v[1], 17) ^ v[2]
        v[2] = _rotl(v[2], 32)


def reference_siphash24(secret: bytes, data: bytes) -> int:
    """SipHash-2-4, 64-bit output, from the published specification."""
    k0 = int.from_bytes(secret[:8], "little")
    k1 = int.from_bytes(secret[8:16], "little")
    v = [
        0x736F6D6570736575 ^ k0,
        0x646F72616E646F6D ^ k1,
        0x6C7967656E657261 ^ k0,
        0x7465646279746573 ^ k1,
    ]
    whole = len(data) - len(data) % 8
    for at in range(0, whole, 8):
        m = int.from_bytes(data[at : at + 8], "little")
        v[3] ^= m
        _rounds(v, 2)
        v[0] ^= m
    last = (len(data) & 0xFF) << 56 | int.from_bytes(data[whole:], "little")
    v[3] ^= last
    _rounds(v, 2)
    v[0] ^= last
    v[2] ^= 0xFF
    _rounds(v, 4)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


# The reference implementation's vectors (SipHash-2-4, 64-bit output): key 00..0f, input
# i bytes 00..i-1 for i = 0..63, each hash as its 8 little-endian bytes.
VECTOR_KEY = bytes(range(16))
VECTORS = """
310e0edd47db6f72 fd67dc93c539f874 5a4fa9d909806c0d 2d7efbd796666785
b7877127e09427cf 8da699cd64557618 cee3fe586e46c9cb 37d1018bf50002ab
6224939a79f5f593 b0e4a90bdf82009e f3b9dd94c5bb5d7a a7ad6b22462fb3f4
fbe50e86bc8f1e75 903d84c02756ea14 eef27a8e90ca23f7 e545be4961ca29a1
db9bc2577fcc2a3f 9447be2cf5e99a69 9cd38d96f0b3c14b bd6179a71dc96dbb
98eea21af25cd6be c7673b2eb0cbf2d0 883ea3e395675393 c8ce5ccd8c030ca8
94af49f6c650adb8 eab8858ade92e1bc f315bb5bb835d817 adcf6b0763612e2f
a5c91da7acaa4dde 716595876650a2a6 28ef495c53a387ad 42c341d8fa92d832
ce7cf2722f512771 e37859f94623f3a7 381205bb1ab0e012 ae97a10fd434e015
b4a31508beff4d31 81396229f0907902 4d0cf49ee5d4dcca 5c73336a76d8bf9a
d0a704536ba93e0e 925958fcd6420cad a915c29bc8067318 952b79f3bc0aa6d4
f21df2e41d4535f9 87577519048f53a9 10a56cf5dfcd9adb eb75095ccd986cd0
51a9cb9ecba312e6 96afadfc2ce666c7 72fe52975a4364ee 5a1645b276d592a1
b274cb8ebf87870a 6f9bb4203de7b381 eaecb2a30b22a87f 9924a43cc1315724
bd838d3aafbf8db7 0b1a2a3265d51aea 135079a3231ce660 932b2846e4d70666
e1915f5cb1eca46c f325965ca16d629f 575ff28e60381be5 724506eb4c328a95
"""
REFERENCE = [int.from_bytes(bytes.fromhex(word), "little") for word in VECTORS.split()]


def test_the_reference_vectors() -> None:
    assert len(REFERENCE) == 64
    for length, expected in enumerate(REFERENCE):
        data = bytes(range(length))
        assert siphash24(VECTOR_KEY, data) == expected, f"{length} bytes"
        assert reference_siphash24(VECTOR_KEY, data) == expected, "the reference itself drifted"


# Keys as the queue sees them, under a fixed secret: each length class of the algorithm
# (empty, a tail of 1 to 7 bytes, whole words, several words) and URLs.
PINNED_SECRET = bytes.fromhex("5a0c1e7f3b9d2468ace0f1b2c3d4e5f6")
PINNED = [
    (b"", 0x4654761CA6339FC9),
    (b"a", 0x0ABD168C430FA554),
    (b"abc", 0x580D50A840FC8D12),
    (b"\xff" * 7, 0x9EE3AF1097A138AE),
    (b"01234567", 0x5C13CF596C0CC110),
    (b"0123456789abcdef0123456789abcdef0", 0x74235463F16EB12E),
    (bytes(range(256)), 0x708E7215A60CB72E),
    (b"https://shop.example.com/item/1", 0x17BCCA6C44A11298),
    (b"https://shop.example.com/category/shoes?page=2&sort=price", 0x23A525D59A4924F6),
    (("https://example.org/" + "x" * 100).encode(), 0xFE65571F89E0C952),
]


@pytest.mark.parametrize(("key", "expected"), PINNED, ids=[f"{len(k)}B" for k, _ in PINNED])
def test_pinned_hashes_under_a_fixed_secret(key: bytes, expected: int) -> None:
    assert siphash24(PINNED_SECRET, key) == expected
    assert reference_siphash24(PINNED_SECRET, key) == expected, "the reference itself drifted"


def test_key_hash_is_siphash_under_the_process_secret_with_0_mapped_to_1() -> None:
    secret = secret_in_use()
    assert secret is not None, "tests/conftest.py sets the session's secret"
    keys = [k for k, _ in PINNED]
    want = [siphash24(secret, k) or 1 for k in keys]
    assert [key_hash(k) for k in keys] == want
    assert key_hashes(keys).tolist() == want


def test_any_contiguous_buffer_hashes_as_its_bytes() -> None:
    key = PINNED[-1][0]
    expected = key_hash(key)
    assert key_hash(bytearray(key)) == expected
    assert key_hash(memoryview(key)) == expected
    array: Any = np.frombuffer(key, dtype=np.uint8)  # a buffer, though numpy's stubs say not
    assert key_hash(array) == expected
    assert key_hash(bytearray()) == key_hash(b"")


def test_key_hashes_into_checks_its_output() -> None:
    with pytest.raises(ValueError, match="one word per key"):
        key_hashes_into([b"a", b"b"], np.empty(1, dtype=np.uint64))
    not_a_key: Any = 3
    with pytest.raises(TypeError):
        key_hashes_into([b"a", not_a_key], np.empty(2, dtype=np.uint64))


def test_two_secrets_give_different_hashes() -> None:
    other = bytes(reversed(PINNED_SECRET))
    keys = [k for k, _ in PINNED] + [b"/p/%d" % i for i in range(1000)]
    ours = [siphash24(PINNED_SECRET, k) for k in keys]
    theirs = [siphash24(other, k) for k in keys]
    assert all(a != b for a, b in zip(ours, theirs, strict=True))
    # One bit of the secret is enough.
    flipped = bytes([PINNED_SECRET[0] ^ 1]) + PINNED_SECRET[1:]
    assert all(siphash24(flipped, k) != h for k, h in zip(keys, ours, strict=True))


_CHILD = """
import json, sys
from shm import keys
secret, data, then = json.loads(sys.stdin.read())
if secret is not None:
    keys.use_secret(bytes.fromhex(secret))
if then is not None:  # a harness closes its node and hosts the next, on another store
    keys.key_hash(b"/first node")
    keys.forget_secret()
    if then:
        keys.use_secret(bytes.fromhex(then))
try:
    print(json.dumps([keys.key_hash(bytes.fromhex(k)) for k in data]))
except RuntimeError as exc:
    print(json.dumps(str(exc)))
"""


def _hash_in_a_child(secret: bytes | None, keys: list[bytes], then: bytes | None = None) -> Any:
    """`then`: forget `secret` after one hash and take this one (b"": none)."""
    ask = json.dumps(
        [
            None if secret is None else secret.hex(),
            [k.hex() for k in keys],
            None if then is None else then.hex(),
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], input=ask, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_the_same_secret_hashes_alike_in_two_processes() -> None:
    keys = [k for k, _ in PINNED]
    first = _hash_in_a_child(PINNED_SECRET, keys)
    second = _hash_in_a_child(PINNED_SECRET, keys)
    assert first == second == [siphash24(PINNED_SECRET, k) or 1 for k in keys]
    other = _hash_in_a_child(bytes(16), keys)
    assert all(a != b for a, b in zip(first, other, strict=True))


def test_a_process_without_a_secret_hashes_nothing() -> None:
    message = _hash_in_a_child(None, [b"/a"])
    assert isinstance(message, str) and "use_secret" in message


def test_a_process_that_forgets_its_secret_hashes_nothing_until_it_takes_another() -> None:
    assert "use_secret" in _hash_in_a_child(PINNED_SECRET, [b"/a"], then=b"")
    other = bytes(range(16))
    assert _hash_in_a_child(PINNED_SECRET, [b"/a"], then=other) == [siphash24(other, b"/a") or 1]


def test_a_process_hashes_under_one_secret() -> None:
    secret = secret_in_use()
    assert secret is not None
    use_secret(secret)  # the same again is a no-op
    with pytest.raises(SecretConflict, match=f"{fingerprint(secret):016x}"):
        use_secret(bytes(SECRET_BYTES))
    assert secret_in_use() == secret


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 17, "0123456789abcdef", None])
def test_a_secret_is_16_bytes(bad: Any) -> None:
    with pytest.raises(ValueError, match="hash secret"):
        use_secret(bad)
    with pytest.raises(ValueError, match="16 bytes"):
        siphash24(b"x" * 15, b"")


def test_the_fingerprint_names_a_secret_without_showing_it() -> None:
    assert fingerprint(PINNED_SECRET) == fingerprint(bytes(PINNED_SECRET))
    assert fingerprint(PINNED_SECRET) != fingerprint(bytes(16))
    printed = fingerprint(PINNED_SECRET).to_bytes(8, "little")
    assert printed not in PINNED_SECRET and PINNED_SECRET[:8] != printed


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=16, max_size=16), st.lists(st.binary(max_size=200), max_size=8))
def test_the_c_hash_is_the_published_algorithm(secret: bytes, keys: list[bytes]) -> None:
    assert [siphash24(secret, k) for k in keys] == [reference_siphash24(secret, k) for k in keys]


@pytest.mark.parametrize(
    ("key", "site"),
    [
        (b"https://www.Example.COM/p/1", b"example.com"),
        (b"https://example.com", b"example.com"),
        (b"http://user:pw@shop.example.com:8080/a?b#c", b"shop.example.com"),
        (b"https://example.com./x", b"example.com"),
        (b"https://example.com?q=1", b"example.com"),
        (b"https://[2001:db8::1]:443/x", b"[2001:db8::1]"),
        (b"https://wwwexample.com/", b"wwwexample.com"),
        (b"product:123", b""),
        (b"/relative/path", b""),
    ],
)
def test_a_keys_site_is_its_host_without_www_port_or_credentials(key: bytes, site: bytes) -> None:
    assert site_of(key) == site


def test_site_hashes_are_keyed_apart_from_key_hashes() -> None:
    secret = bytes(range(SECRET_BYTES))
    assert keyed_site_hash(secret, b"") == NO_SITE
    assert keyed_site_hash(secret, b"example.com") == keyed_site_hash(secret, b"example.com")
    assert keyed_site_hash(secret, b"example.com") != keyed_site_hash(secret, b"example.org")
    # The same bytes as a key and as a site name hash apart.
    assert keyed_site_hash(secret, b"example.com") != (siphash24(secret, b"example.com") or 1)
    assert keyed_site_hash(secret, b"example.com") != keyed_site_hash(
        bytes(reversed(range(SECRET_BYTES))), b"example.com"
    )


def test_site_hash_is_keyed_site_hash_under_the_process_secret() -> None:
    secret = secret_in_use()
    assert secret is not None
    assert site_hash(b"example.com") == keyed_site_hash(secret, b"example.com")
    assert site_hash(b"") == NO_SITE


# The C site hash follows site_of's rules step by step: each edge of them, and the bytes
# around each, where a C rendering can go wrong (bounds, order of the steps, case).
SITE_CORPUS = [
    b"",
    b":",
    b"://",
    b"https://",
    b"https:///path",
    b"https://?q",
    b"https://#f",
    b"https://@",
    b"https://@/",
    b"https://a@",
    b"https://a@b@c.example/x",
    b"https://user:pw@Shop.Example.COM:8080/a?b#c",
    b"https://www.Example.COM/p/1",
    b"https://WWW.example.com",
    b"https://www./x",
    b"https://www../x",
    b"https://www.www.example.com/",
    b"https://www.a./",
    b"https://wwwexample.com/",
    b"https://ww.example.com/",
    b"https://example.com./x",
    b"https://example.com.../x",
    b"https://.../x",
    b"https://example.com:/x",
    b"https://example.com:8080",
    b"https://example.com?q=http://other.example/",
    b"https://example.com#frag/x",
    b"https://[2001:db8::1]:443/x",
    b"https://[2001:DB8::1]/",
    b"https://[::1",
    b"https://[abc.",
    b"https://user@[::1]:80/",
    b"HTTPS://Example.com/",
    b"/relative/path",
    b"/path?u=http://Inner.Example/x",
    b"product:123",
    b"a://b",
    b"x" * 3000,
    b"https://" + b"a" * 300 + b"/x",
    b"https://www." + b"B" * 260,
    b"https://" + b"c" * 252 + b"..",
    b"https://\xc3\xa9xample.com/\xff",
    b"https://exa\x00mple.com/",
    b"https://\x80\x81.example/",
]


def test_the_c_site_hash_is_site_hash_of_site_of() -> None:
    want = [site_hash(site_of(k)) for k in SITE_CORPUS]
    assert [key_site_hash(k) for k in SITE_CORPUS] == want
    assert key_site_hashes(SITE_CORPUS).tolist() == want
    assert key_site_hash(b"/relative/path") == NO_SITE
    assert key_site_hash(b"https://www.Example.COM/p/1") == site_hash(b"example.com")
    long_site = site_of(b"https://www." + b"B" * 260)
    assert len(long_site) == SITE_MAX_BYTES


_URL_PIECES = st.sampled_from(
    [
        b"https://",
        b"http://",
        b"://",
        b"www.",
        b"WWW.",
        b"@",
        b":",
        b"/",
        b"?",
        b"#",
        b".",
        b"[",
        b"]",
        b"::1",
        b"Example",
        b"com",
        b"8080",
        b"\xc3\xa9",
        b"a",
        b"-",
    ]
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(_URL_PIECES, st.binary(max_size=6)), max_size=14))
def test_the_c_site_hash_agrees_on_url_like_bytes(pieces: list[bytes]) -> None:
    key = b"".join(pieces)
    assert key_site_hash(key) == site_hash(site_of(key)), key


def test_key_site_hashes_into_checks_its_output() -> None:
    with pytest.raises(ValueError, match="one word per key"):
        key_site_hashes_into([b"a", b"b"], np.empty(1, dtype=np.uint64))
    not_a_key: Any = 3
    with pytest.raises(TypeError):
        key_site_hashes_into([b"a", not_a_key], np.empty(2, dtype=np.uint64))
    assert key_site_hash(bytearray(b"https://x.example/")) == site_hash(b"x.example")
    assert key_site_hash(memoryview(b"https://x.example/")) == site_hash(b"x.example")


# A route's site pattern: `*.NAME` names NAME for NAME and every host under it (after
# site_of's own rules), any other host its own; a plain NAME names every key of the route.
@pytest.mark.parametrize(
    ("key", "pattern", "site"),
    [
        (b"https://a.example.com/x", b"*.example.com", b"example.com"),
        (b"https://b.a.Example.COM:8080/x", b"*.example.com", b"example.com"),
        (b"https://example.com/", b"*.example.com", b"example.com"),
        (b"https://www.example.com/", b"*.example.com", b"example.com"),
        (b"https://user@x.example.com./", b"*.example.com", b"example.com"),
        (b"https://badexample.com/", b"*.example.com", b"badexample.com"),
        (b"https://example.com.evil.org/", b"*.example.com", b"example.com.evil.org"),
        (b"https://xample.com/", b"*.example.com", b"xample.com"),
        (b"https://other.org/", b"*.example.com", b"other.org"),
        (b"/relative/path", b"*.example.com", b""),
        (b"https://a.example.com/x", b"customer-a", b"customer-a"),
        (b"/relative/path", b"customer-a", b"customer-a"),
        (b"https://a.example.com/x", b"", b"a.example.com"),
    ],
)
def test_a_route_pattern_names_the_site(key: bytes, pattern: bytes, site: bytes) -> None:
    assert site_of(key, pattern) == site
    assert key_site_hash(key, pattern) == site_hash(site)


_PATTERNS = (b"", b"*.example.com", b"*.a.example", b"example.com", b"c.example")


def test_the_c_site_hash_follows_each_pattern_as_site_of_does() -> None:
    corpus = [
        *SITE_CORPUS,
        b"https://A.Example.com/",
        b"https://a.example/",
        b"https://x.a.example/",
        b"https://.example.com/",
        b"https://example.com/",
    ]
    for pattern in _PATTERNS:
        want = [site_hash(site_of(k, pattern)) for k in corpus]
        assert [key_site_hash(k, pattern) for k in corpus] == want, pattern
    # A batch, each key under its own pattern: one C call.
    which = np.arange(len(corpus), dtype=np.int32) % len(_PATTERNS)
    want = [site_hash(site_of(k, _PATTERNS[w])) for k, w in zip(corpus, which, strict=True)]
    assert key_site_hashes(corpus, _PATTERNS, which).tolist() == want


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(_URL_PIECES, st.binary(max_size=6)), max_size=14),
    st.sampled_from(_PATTERNS),
)
def test_the_c_site_hash_agrees_under_patterns(pieces: list[bytes], pattern: bytes) -> None:
    key = b"".join(pieces)
    assert key_site_hash(key, pattern) == site_hash(site_of(key, pattern)), key


def test_key_site_hashes_into_checks_its_patterns() -> None:
    out = np.empty(2, dtype=np.uint64)
    with pytest.raises(ValueError, match="out of range"):
        key_site_hashes_into([b"a", b"b"], out, (b"",), np.array([0, 1], np.int32))
    with pytest.raises(ValueError, match="int32"):
        key_site_hashes_into([b"a", b"b"], out, (b"",), np.zeros(2, np.int64))
    not_a_pattern: Any = "x.example"
    with pytest.raises(TypeError):
        key_site_hashes_into([b"a", b"b"], out, (not_a_pattern,), np.zeros(2, np.int32))
    with pytest.raises(TypeError):
        key_site_hash(b"https://a.example/", not_a_pattern)


@pytest.mark.parametrize(
    "pattern", ["*.example.com", "example.com", "customer-a", "*.co.uk", "a_b.example", "x"]
)
def test_a_valid_site_pattern_is_taken_as_written(pattern: str) -> None:
    assert site_pattern(pattern) == pattern.encode()


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("", "NAME a host name"),
        ("*", "NAME a host name"),
        ("*.", "NAME a host name"),
        ("**.example.com", "NAME a host name"),
        ("*.*.example.com", "NAME a host name"),
        ("a.*.example.com", "NAME a host name"),
        ("*example.com", "NAME a host name"),
        ("Example.com", "lower-case"),
        ("example.com.", "single dots"),
        ("a..example.com", "single dots"),
        (".example.com", "single dots"),
        ("example.com:8080", "NAME a host name"),
        ("example.com/path", "NAME a host name"),
        ("user@example.com", "NAME a host name"),
        ("exa mple.com", "NAME a host name"),
        ("[::1]", "NAME a host name"),
        ("éxample.com", "NAME a host name"),
        ("x" * 254, "at most 253"),
        ("www.example.com", "use 'example.com'"),
        ("*.www.example.com", "use '*.example.com'"),
        ("*.com", "not a top-level domain"),
    ],
)
def test_a_bad_site_pattern_is_refused_saying_why(pattern: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        site_pattern(pattern)


_SITE_CHILD = """
import json, sys
from shm import keys
secret, then = json.loads(sys.stdin.read())
key = b"https://www.example.com/x"
out = []
for step in ("first", "then"):
    try:
        out.append(keys.key_site_hash(key))
    except RuntimeError as exc:
        out.append(str(exc))
    if step == "first":
        if secret is not None:
            keys.use_secret(bytes.fromhex(secret))
            out.append(keys.key_site_hash(key))
            keys.forget_secret()
        if then is not None:
            keys.use_secret(bytes.fromhex(then))
print(json.dumps(out))
"""


def test_a_process_hashes_sites_only_under_its_secret() -> None:
    other = bytes(range(16))
    ask = json.dumps([PINNED_SECRET.hex(), other.hex()])
    done = subprocess.run(
        [sys.executable, "-c", _SITE_CHILD], input=ask, capture_output=True, text=True, check=True
    )
    before, under, after = json.loads(done.stdout)
    assert isinstance(before, str) and "use_secret" in before
    assert under == keyed_site_hash(PINNED_SECRET, b"example.com")
    assert after == keyed_site_hash(other, b"example.com")
    # After forget_secret, with no new secret: refused again.
    ask = json.dumps([PINNED_SECRET.hex(), None])
    done = subprocess.run(
        [sys.executable, "-c", _SITE_CHILD], input=ask, capture_output=True, text=True, check=True
    )
    assert "use_secret" in json.loads(done.stdout)[2]
