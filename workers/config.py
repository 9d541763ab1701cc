"""A node's settings: a TOML file, then `RENDERQUEUE_*` environment variables, then flags.

Each later source overrides the earlier ones, setting by setting. Every value is validated
once, here, and an error names the setting and where its value came from, so an operator
can fix the right line.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from api.node import ApiSettings
from keeper.config import KeeperConfig
from shm.sites import MAX_IN_FLIGHT, MAX_INTERVAL_MS, FailurePolicy
from wire.schemas import MAX_LEASE_S

ENV_PREFIX = "RENDERQUEUE_"
# The API's pacing, fixed rather than set: a long poll re-checks the ring's generation
# this often (small next to the keeper's publish period; a check is two atomic loads); a
# refusal asks for a retry after this long; a peer has this long to answer a forward.
POLL_INTERVAL_S = 0.025
RETRY_AFTER_S = 1
PEER_TIMEOUT_S = 3.0
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
Token = Annotated[str, msgspec.Meta(min_length=16, max_length=512)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class ConfigError(ValueError):
    """A setting is missing, malformed or contradicts another; the message names it."""

    def __init__(self, setting: str, message: str, source: str | None = None) -> None:
        where = f" (from {source})" if source else ""
        super().__init__(f"setting `{setting}`{where}: {message}")
        self.setting = setting
        self.source = source


MAX_WORKERS = 64


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `renderqueue serve` needs. Field names are the TOML keys; the environment
    variable is `RENDERQUEUE_` + the name in upper case, the flag `--` + it with dashes."""

    db: str = "var/renderqueue.sqlite"  # a SQLite path, or a store URL (postgresql://...)
    host: str = "127.0.0.1"
    port: Port = 8080
    workers: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORKERS)] = 2
    # A listener per worker on the one port (SO_REUSEPORT): the kernel spreads connections
    # evenly; with one shared listener a busy worker can end up with most of them.
    reuse_port: bool = True
    # With reuse_port, listeners each worker but worker 0 (which hosts the keeper) gets;
    # worker 0 gets one, so it is handed 1 / (1 + (workers - 1) * this) of new connections.
    listeners_per_worker: Annotated[int, msgspec.Meta(ge=1, le=8)] = 2
    fleet_token: Token | None = None
    admin_token: Token | None = None
    # Read-only: opens /metrics, queue-state, overview, explain and the schedule's reads,
    # nothing that writes (for Prometheus, KEDA, a read-only console).
    metrics_token: Token | None = None
    # Serve /metrics without a token to peers on loopback (a scraper on this host).
    metrics_open_on_loopback: bool = False
    # Past this many bytes a request body is refused with 413 before it is parsed.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=256 * 1024 * 1024)] = 4 * 1024 * 1024
    # Names the shared-memory segments; the default derives from the db and the port so a
    # crashed run's segments are found (and replaced) by the next run of the same node.
    instance: Name | None = None
    node: Name | None = None  # this node's name in a cluster; the host name by default
    # The cluster (a PostgreSQL store): the URL other nodes and the fleet reach this node
    # at; by default http://host:port when the node listens on one address, required when
    # it listens on a wildcard (0.0.0.0, ::).
    advertise_url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^\s/]+(/[^\s]*)?$")] | None = (
        None
    )
    # Other nodes' names (TOML list, or comma-separated): before loading, the keeper waits
    # up to peer_wait_s to see one of them live, since ownership is unknowable before.
    peers: list[Name] = []
    peer_wait_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 120.0
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 2.0
    # A node whose heartbeat is older than this is dead (judged by the database's clock).
    node_ttl_s: Annotated[float, msgspec.Meta(ge=1, le=600)] = 12.0
    # The longest lease a clustered node grants: a node that takes over another's keys
    # waits up to this long for the other's leases to end.
    max_lease_s: Annotated[int, msgspec.Meta(ge=5, le=3600)] = 300
    # What divides a cluster's keys among its nodes: each key by its own hash ("key"), or
    # every key of a site by the site's hash ("site"), so one node holds a whole site and
    # its site table enforces the site's cap, spacing and blocks for the whole cluster
    # (with "key" each node enforces them for its own share). Stored with the cluster's
    # settings: every node must run with the same.
    ownership: Literal["key", "site"] = "key"
    graceful_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # One line per event on stderr: "json" for machines, "text" (time, level, component,
    # event, key=value) for people, "auto" text on a terminal and JSON otherwise.
    log_format: Literal["auto", "json", "text"] = "auto"
    access_log: bool = False
    # uvicorn's HTTP protocol: "httptools" (the llhttp parser, in C) or "h11" (pure Python,
    # so more server CPU per request), a fallback should httptools misbehave.
    http: Literal["httptools", "h11"] = "httptools"
    lease_slots: Annotated[int, msgspec.Meta(ge=1024, le=1 << 26)] = 1 << 20
    # Where a graceful stop (SIGTERM) leaves the lease table for the next start, so live
    # leases outlive a restart (shm/lease_snapshot.py). By default `<db>.leases` beside a
    # SQLite database, and `var/<instance>.leases` for a store URL.
    lease_snapshot: str | None = None
    # An audit: every worker appends each lease it grants, renews and ends to a file in
    # this directory (shm/lease_journal.py), from which `python -m bench.harness.history DIR`
    # proves no key was held by two leases at once. Off by default: a write per change.
    lease_journal_dir: str | None = None
    ring_entries: Annotated[int, msgspec.Meta(ge=16, le=1 << 20)] = 8192
    # Completed leases leave dead slots; unswept, the table fills and grants start failing
    # for a full probe window. The supervisor, otherwise idle, sweeps this often.
    lease_sweep_interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    # Worker 0 hosts the keeper thread; a shorter GIL switch interval there bounds how long
    # the keeper can delay a claim in the same process (see bench/node.py).
    keeper_switch_interval_ms: Annotated[float, msgspec.Meta(ge=0.1, le=100)] = 1.0
    keeper: dict[str, Any] = {}  # passed to keeper.config.KeeperConfig
    # Politeness per site (a key's site is its URL's host; shm/sites.py): at most this many
    # leases live on one site's keys (none: no cap), and grants of one site at least this
    # many ms apart. PUT /v1/sites/{site} overrides either for one site. In a cluster
    # these, site_permits_max and the failure block's settings must agree on every node.
    site_max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=MAX_IN_FLIGHT)] | None = None
    site_min_interval_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_INTERVAL_MS)] = 0
    # The site table in shared memory: sites it can hold at once (those with a setting, a
    # block, leases in flight under a cap or spacing), and the highest max_in_flight a
    # site may be given (its permit words).
    site_slots: Annotated[int, msgspec.Meta(ge=64, le=1 << 24)] = 1 << 13
    site_permits_max: Annotated[int, msgspec.Meta(ge=1, le=MAX_IN_FLIGHT)] = 64
    # This many `failed` renders in a row across a site's keys, within the window from the
    # first, block the site for site_failure_block_s, doubled on each repeat up to the
    # max, until a render of the site succeeds. 0: never.
    site_failure_streak: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 5
    site_failure_window_s: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60
    site_failure_block_s: Annotated[int, msgspec.Meta(ge=1, le=86_400)] = 60
    site_failure_block_max_s: Annotated[int, msgspec.Meta(ge=1, le=7 * 86_400)] = 1_800
    # URL-pattern rules (TOML, as `import-sitemap --route-rules`) for POST /v1/sitemaps;
    # without them every uploaded URL goes to the route "page".
    sitemap_route_rules: str | None = None

    @property
    def auth_enabled(self) -> bool:
        return self.admin_token is not None or self.fleet_token is not None

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)

    def store_url(self) -> str:
        if "://" in self.db:
            return self.db
        return "sqlite:///" + str(Path(self.db).expanduser().resolve())

    def sqlite_path(self) -> Path | None:
        """The SQLite store's file; None when the store URL names another backend."""
        url = self.store_url()
        return Path(url[len("sqlite:///") :]) if url.startswith("sqlite:///") else None

    def node_name(self) -> str:
        """This node's name: `node`, else the host name."""
        return self.node or socket.gethostname()

    @property
    def clustered(self) -> bool:
        """On PostgreSQL a node joins the cluster that shares the database."""
        return self.store_url().startswith(("postgresql://", "postgres://"))

    @property
    def lease_cap_s(self) -> int:
        """The longest lease granted: max_lease_s in a cluster, where another node waits on
        it to take the keys over; on a single node nobody waits, and the API's own bound."""
        return self.max_lease_s if self.clustered else MAX_LEASE_S

    def site_failures(self) -> FailurePolicy:
        return FailurePolicy(
            streak=self.site_failure_streak,
            window_ms=self.site_failure_window_s * 1000,
            block_ms=self.site_failure_block_s * 1000,
            block_max_ms=max(self.site_failure_block_max_s, self.site_failure_block_s) * 1000,
        )

    def site_policy(self) -> str:
        """The site settings every node of a cluster must share, as one value
        (store.postgres.membership compares it at join)."""
        return (
            f"max_in_flight={self.site_max_in_flight or 'none'} "
            f"min_interval_ms={self.site_min_interval_ms} permits={self.site_permits_max} "
            f"failures={self.site_failure_streak}/{self.site_failure_window_s}s/"
            f"{self.site_failure_block_s}s..{self.site_failure_block_max_s}s"
        )

    def advertised(self, port: int) -> str:
        """The URL this node is reached at (advertise_url, else its listening address)."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{port}"


def _wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def is_loopback_host(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


FIELD_NAMES: tuple[str, ...] = Settings.__struct_fields__


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError as exc:
        raise ConfigError("config", f"no such file: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"{path} is not valid TOML: {exc}") from exc
    # A [renderqueue] table is accepted too, so the settings can live in a shared file.
    table = data.get("renderqueue", data)
    if not isinstance(table, dict):
        raise ConfigError("renderqueue", "must be a table", str(path))
    return dict(table)


def load_settings(
    *,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge file < environment < flags and validate; raises ConfigError naming the setting."""
    environ = os.environ if environ is None else environ
    config_file = config_file or environ.get(ENV_PREFIX + "CONFIG") or None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if config_file:
        for name, value in read_toml(config_file).items():
            if name not in FIELD_NAMES:
                raise ConfigError(name, "unknown setting", str(config_file))
            values[name] = value
            sources[name] = str(config_file)
    for name in FIELD_NAMES:
        if name == "keeper":
            continue
        raw = environ.get(env_name(name))
        if raw is not None and raw != "":
            values[name] = _split_list(raw) if name in LIST_FIELDS else raw
            sources[name] = env_name(name)
    for name, value in (flags or {}).items():
        if value is None:
            continue
        if name not in FIELD_NAMES:
            raise ConfigError(name, "unknown setting", flag_name(name))
        if name in LIST_FIELDS and isinstance(value, str):
            value = _split_list(value)
        values[name] = value
        sources[name] = flag_name(name)
    try:
        settings = msgspec.convert(values, Settings, strict=False)
    except msgspec.ValidationError as exc:
        name, message = _split_validation_error(str(exc))
        raise ConfigError(name, message, sources.get(name.split(".")[0])) from exc
    _check_consistency(settings, sources)
    return settings


LIST_FIELDS = frozenset({"peers"})


def _split_list(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def _split_validation_error(message: str) -> tuple[str, str]:
    text, _, path = message.partition(" - at `$.")
    if path:
        return path.rstrip("`"), text
    if text.startswith("Object contains unknown field `"):
        return text.split("`")[1], "unknown setting"
    return "config", text


def _check_consistency(settings: Settings, sources: Mapping[str, str]) -> None:
    if settings.fleet_token is not None and settings.fleet_token == settings.admin_token:
        raise ConfigError("fleet_token", "must differ from admin_token", sources.get("fleet_token"))
    if settings.metrics_token is not None and settings.metrics_token in (
        settings.admin_token,
        settings.fleet_token,
    ):
        raise ConfigError(
            "metrics_token",
            "must differ from admin_token and fleet_token",
            sources.get("metrics_token"),
        )
    if settings.admin_token is None and not settings.is_loopback:
        # Without the admin token the admin endpoints are open, which is only safe on loopback.
        raise ConfigError(
            "host",
            f"{settings.host!r} is beyond loopback and RENDERQUEUE_ADMIN_TOKEN is not set; set "
            "it (and RENDERQUEUE_FLEET_TOKEN for the fleet) or listen on 127.0.0.1",
            sources.get("host"),
        )
    if settings.clustered and settings.advertise_url is None and _wildcard(settings.host):
        raise ConfigError(
            "advertise_url",
            f"the node listens on {settings.host!r}, every address: say which URL other nodes "
            "and the fleet reach it at (e.g. http://10.0.0.5:8080)",
            sources.get("host"),
        )
    if settings.node is not None and settings.node in settings.peers:
        raise ConfigError(
            "peers", f"names this node itself ({settings.node!r})", sources.get("peers")
        )
    try:
        config = keeper_config(settings)
    except msgspec.ValidationError as exc:
        name, message = _split_validation_error(str(exc))
        raise ConfigError("keeper." + name, message, sources.get("keeper")) from exc
    if settings.sitemap_route_rules is not None:
        from sitemap.rules import RouteRules, RouteRulesError

        try:
            RouteRules.load(settings.sitemap_route_rules)
        except RouteRulesError as exc:
            raise ConfigError(
                "sitemap_route_rules", str(exc), sources.get("sitemap_route_rules")
            ) from exc
    if (
        settings.site_max_in_flight is not None
        and settings.site_max_in_flight > settings.site_permits_max
    ):
        raise ConfigError(
            "site_max_in_flight",
            f"{settings.site_max_in_flight} is over site_permits_max "
            f"({settings.site_permits_max}), the most permits a site has; raise that too",
            sources.get("site_max_in_flight"),
        )
    if settings.site_failure_block_max_s < settings.site_failure_block_s:
        raise ConfigError(
            "site_failure_block_max_s",
            f"{settings.site_failure_block_max_s} s is shorter than site_failure_block_s "
            f"({settings.site_failure_block_s} s)",
            sources.get("site_failure_block_max_s"),
        )
    if config.best_k > settings.ring_entries:
        raise ConfigError(
            "keeper.best_k",
            f"{config.best_k} keys do not fit the ring of ring_entries={settings.ring_entries}",
            sources.get("keeper") or sources.get("ring_entries"),
        )


# The keeper's own defaults publish 4,096 keys a second. A node serving a fleet publishes
# 8,192 keys four times a second, so keys that come due reach the ring within 0.25 s, and
# refills the ring early whenever claims drain it (keeper.refill_below), so claims are not
# capped by the tick. Settings in [keeper] override these.
NODE_KEEPER_DEFAULTS: dict[str, Any] = {"publish_interval_s": 0.25, "best_k": 8192}


def api_settings(
    settings: Settings, *, node: str, instance: str, worker: int, advertised_url: str
) -> ApiSettings:
    """What a worker's API reads, all of it from the node's settings (and its keeper's)."""
    keeping = keeper_config(settings)
    return ApiSettings(
        node=node,
        instance=instance,
        worker=worker,
        fleet_token=settings.fleet_token,
        admin_token=settings.admin_token,
        metrics_token=settings.metrics_token,
        metrics_open_on_loopback=settings.metrics_open_on_loopback,
        max_body_bytes=settings.max_body_bytes,
        poll_interval_s=POLL_INTERVAL_S,
        retry_after_s=RETRY_AFTER_S,
        stall_after_ms=int(keeping.stall_after_s * 1000),
        sitemap_boost=keeping.sitemap_boost,
        sitemap_route_rules=settings.sitemap_route_rules,
        clustered=settings.clustered,
        max_lease_s=settings.lease_cap_s,
        ownership=settings.ownership,
        advertised_url=advertised_url,
        node_ttl_s=settings.node_ttl_s,
        site_permits_max=settings.site_permits_max,
        peer_timeout_s=PEER_TIMEOUT_S,
    )


def keeper_config(settings: Settings) -> KeeperConfig:
    """The keeper's settings: the node's defaults under whatever [keeper] sets. In a
    cluster each node's keeper keeps a cursor of its own in the shared log."""
    config = msgspec.convert(
        {**NODE_KEEPER_DEFAULTS, **settings.keeper}, KeeperConfig, strict=False
    )
    if settings.clustered:
        config = msgspec.structs.replace(
            config, consumer=f"{config.consumer}:{settings.node_name()}"
        )
    return config
