"""Which route a URL belongs to: ordered URL-pattern rules, from a TOML file.

    # route-rules.toml
    default_route = "page"        # when no rule matches; leave out to skip such URLs

    [[rules]]
    route = "home"
    path = "/"                    # a glob on the URL's path

    [[rules]]
    route = "product"
    path = "/products/*"          # * stays inside one path segment, ** crosses them
    cadence_s = 86400             # used when an entry has no usable changefreq

    [[rules]]
    route = "search"
    regex = "[?&]q="              # re.search on the whole URL
    host = "shop.example"         # optional: only URLs on this host

The first matching rule wins. A path glob matches the path only (no query), and a
trailing slash is significant, as it is to the site.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import msgspec

from store.validate import check_route_name


class RouteRulesError(ValueError):
    """The rules file cannot be used; the message names the rule and the problem."""


class RouteRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    route: str
    path: str | None = None
    regex: str | None = None
    host: str | None = None
    cadence_s: int | None = None


class RouteRulesFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    default_route: str | None = None
    default_cadence_s: int | None = None
    rules: list[RouteRule] = []


class RouteMatch(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    cadence_s: int | None  # the rule's fallback cadence, if it gives one


def glob_to_regex(glob: str) -> re.Pattern[str]:
    """`**` any run of characters, `*` any run without "/", `?` one character but "/"."""
    out: list[str] = []
    i = 0
    while i < len(glob):
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
        elif glob[i] == "*":
            out.append("[^/]*")
            i += 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return re.compile("".join(out))


class _CompiledRule(msgspec.Struct, frozen=True):
    rule: RouteRule
    path: re.Pattern[str] | None
    regex: re.Pattern[str] | None
    host: str | None


def _valid_route(route: str, where: str) -> None:
    try:
        check_route_name(route, where=where)
    except ValueError as exc:
        raise RouteRulesError(str(exc)) from None


def _valid_cadence(value: int | None, where: str) -> None:
    if value is not None and value <= 0:
        raise RouteRulesError(f"{where}: cadence_s must be a positive number of seconds")


class RouteRules:
    """Ordered rules; `match(url)` gives the route for a URL, or None if none applies."""

    def __init__(self, spec: RouteRulesFile) -> None:
        self.spec = spec
        compiled: list[_CompiledRule] = []
        for number, rule in enumerate(spec.rules, start=1):
            where = f"rule {number} (route {rule.route!r})"
            _valid_route(rule.route, f"rule {number}")
            if (rule.path is None) == (rule.regex is None):
                raise RouteRulesError(f"{where}: give exactly one of path (a glob) or regex")
            _valid_cadence(rule.cadence_s, where)
            try:
                regex = re.compile(rule.regex) if rule.regex is not None else None
            except re.error as exc:
                raise RouteRulesError(f"{where}: regex does not compile ({exc})") from exc
            path = glob_to_regex(rule.path) if rule.path is not None else None
            host = rule.host.lower() if rule.host else None
            compiled.append(_CompiledRule(rule, path, regex, host))
        _valid_cadence(spec.default_cadence_s, "default_cadence_s")
        if spec.default_route is not None:
            _valid_route(spec.default_route, "default_route")
        self._rules = compiled

    def match(self, url: str) -> RouteMatch | None:
        parts = urlsplit(url)
        path = parts.path or "/"
        host = (parts.hostname or "").lower()
        for compiled in self._rules:
            if compiled.host is not None and compiled.host != host:
                continue
            if compiled.path is not None and not compiled.path.fullmatch(path):
                continue
            if compiled.regex is not None and not compiled.regex.search(url):
                continue
            return RouteMatch(route=compiled.rule.route, cadence_s=compiled.rule.cadence_s)
        if self.spec.default_route is None:
            return None
        return RouteMatch(route=self.spec.default_route, cadence_s=self.spec.default_cadence_s)

    @classmethod
    def default(cls) -> RouteRules:
        """No rules: every URL goes to the route "page"."""
        return cls(RouteRulesFile(default_route="page"))

    @classmethod
    def from_toml(cls, text: str, *, source: str = "<rules>") -> RouteRules:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RouteRulesError(f"{source}: not valid TOML ({exc})") from exc
        try:
            spec = msgspec.convert(data, RouteRulesFile)
        except msgspec.ValidationError as exc:
            raise RouteRulesError(f"{source}: {exc}") from exc
        try:
            return cls(spec)
        except RouteRulesError as exc:
            raise RouteRulesError(f"{source}: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> RouteRules:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise RouteRulesError(f"{path}: cannot read ({exc.strerror})") from exc
        return cls.from_toml(text, source=str(path))
