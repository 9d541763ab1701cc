"""Settings: file < environment < flags, validated with errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from wire.schemas import MAX_LEASE_S
from workers.config import ConfigError, Settings, api_settings, is_loopback_host, load_settings

ADMIN = "a" * 32
FLEET = "f" * 32


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return str(path)


def test_defaults_listen_on_loopback_without_tokens() -> None:
    settings = load_settings(environ={})
    assert settings == Settings()
    assert settings.host == "127.0.0.1"
    assert not settings.auth_enabled


def test_precedence_file_then_environment_then_flags(tmp_path: Path) -> None:
    config = write_toml(tmp_path, 'port = 9001\nworkers = 3\ndb = "from-file.sqlite"\n')
    environ = {"RENDERQUEUE_PORT": "9002", "RENDERQUEUE_DB": "from-env.sqlite"}
    settings = load_settings(config_file=config, environ=environ, flags={"db": "from-flag.sqlite"})
    assert settings.workers == 3  # only the file says
    assert settings.port == 9002  # the environment beats the file
    assert settings.db == "from-flag.sqlite"  # a flag beats both


def test_config_file_named_by_the_environment(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[renderqueue]\nworkers = 5\n")
    assert load_settings(environ={"RENDERQUEUE_CONFIG": config}).workers == 5


@pytest.mark.parametrize(
    ("environ", "flags", "setting", "source"),
    [
        ({"RENDERQUEUE_PORT": "eighty"}, {}, "port", "RENDERQUEUE_PORT"),
        ({}, {"port": "70000"}, "port", "--port"),
        ({}, {"workers": "0"}, "workers", "--workers"),
        ({"RENDERQUEUE_MAX_BODY_BYTES": "12"}, {}, "max_body_bytes", "RENDERQUEUE_MAX_BODY_BYTES"),
        ({"RENDERQUEUE_ADMIN_TOKEN": "short"}, {}, "admin_token", "RENDERQUEUE_ADMIN_TOKEN"),
        ({"RENDERQUEUE_LOG_LEVEL": "loud"}, {}, "log_level", "RENDERQUEUE_LOG_LEVEL"),
        ({"RENDERQUEUE_HTTP": "lean"}, {}, "http", "RENDERQUEUE_HTTP"),
        ({}, {"ownership": "host"}, "ownership", "--ownership"),
    ],
)
def test_a_bad_value_names_its_setting_and_source(
    environ: dict[str, str], flags: dict[str, str], setting: str, source: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(environ=environ, flags=flags)
    assert raised.value.setting == setting
    assert raised.value.source == source
    assert f"`{setting}`" in str(raised.value)


def test_the_http_protocol_is_httptools_unless_h11_is_asked_for() -> None:
    assert load_settings(environ={}).http == "httptools"
    assert load_settings(environ={"RENDERQUEUE_HTTP": "h11"}).http == "h11"


def test_unknown_setting_in_file_is_named(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "prot = 80\n")
    with pytest.raises(ConfigError, match="`prot`"):
        load_settings(config_file=config, environ={})


def test_unparseable_file_is_reported(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "port = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(config_file=config, environ={})


def test_refuses_a_public_host_without_tokens() -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(environ={}, flags={"host": "0.0.0.0"})
    assert raised.value.setting == "host"
    assert "RENDERQUEUE_ADMIN_TOKEN" in str(raised.value)


def test_public_host_with_tokens_is_allowed() -> None:
    environ = {"RENDERQUEUE_ADMIN_TOKEN": ADMIN, "RENDERQUEUE_FLEET_TOKEN": FLEET}
    settings = load_settings(environ=environ, flags={"host": "0.0.0.0"})
    assert settings.auth_enabled and not settings.is_loopback
    # The admin token alone protects every endpoint (it opens the fleet ones too).
    settings = load_settings(environ={"RENDERQUEUE_ADMIN_TOKEN": ADMIN}, flags={"host": "::"})
    assert settings.auth_enabled


def test_a_fleet_token_alone_stays_on_loopback() -> None:
    environ = {"RENDERQUEUE_FLEET_TOKEN": FLEET}
    assert load_settings(environ=environ).auth_enabled
    with pytest.raises(ConfigError) as raised:
        load_settings(environ=environ, flags={"host": "0.0.0.0"})
    assert raised.value.setting == "host"


def test_identical_tokens_are_refused() -> None:
    environ = {"RENDERQUEUE_ADMIN_TOKEN": ADMIN, "RENDERQUEUE_FLEET_TOKEN": ADMIN}
    with pytest.raises(ConfigError, match="must differ"):
        load_settings(environ=environ)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("example.com", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_store_url_resolves_a_path(tmp_path: Path) -> None:
    settings = load_settings(environ={}, flags={"db": str(tmp_path / "x.sqlite")})
    assert settings.store_url() == f"sqlite:///{tmp_path / 'x.sqlite'}"
    assert load_settings(environ={}, flags={"db": "postgresql://h/db"}).store_url() == (
        "postgresql://h/db"
    )


def test_keeper_settings_override_the_node_defaults(tmp_path: Path) -> None:
    from workers.config import NODE_KEEPER_DEFAULTS, keeper_config

    assert (
        keeper_config(load_settings(environ={})).publish_interval_s
        == (NODE_KEEPER_DEFAULTS["publish_interval_s"])
    )
    config = write_toml(tmp_path, "[keeper]\npublish_interval_s = 1.0\nbest_k = 4096\n")
    keeper = keeper_config(load_settings(config_file=config, environ={}))
    assert (keeper.publish_interval_s, keeper.best_k) == (1.0, 4096)


def test_a_bad_keeper_setting_is_named(tmp_path: Path) -> None:
    config = write_toml(tmp_path, '[keeper]\nbest_k = "many"\n')
    with pytest.raises(ConfigError) as raised:
        load_settings(config_file=config, environ={})
    assert raised.value.setting == "keeper.best_k"
    config = write_toml(tmp_path, "ring_entries = 1024\n[keeper]\nbest_k = 2048\n")
    with pytest.raises(ConfigError, match="do not fit the ring"):
        load_settings(config_file=config, environ={})


def test_sqlite_path_is_the_stores_file_and_none_for_postgresql(tmp_path: Path) -> None:
    bare = load_settings(flags={"db": str(tmp_path / "a.sqlite")})
    assert bare.sqlite_path() == (tmp_path / "a.sqlite").resolve()
    url = load_settings(flags={"db": f"sqlite:///{tmp_path}/b.sqlite"})
    assert url.sqlite_path() == tmp_path / "b.sqlite"
    assert load_settings(flags={"db": "postgresql://u@h/d"}).sqlite_path() is None


def test_site_settings_are_validated_and_make_the_failure_policy() -> None:
    settings = load_settings(
        environ={"RENDERQUEUE_SITE_MAX_IN_FLIGHT": "4", "RENDERQUEUE_SITE_MIN_INTERVAL_MS": "250"}
    )
    assert (settings.site_max_in_flight, settings.site_min_interval_ms) == (4, 250)
    policy = settings.site_failures()
    assert (policy.streak, policy.window_ms, policy.block_ms, policy.block_max_ms) == (
        5,
        60_000,
        60_000,
        1_800_000,
    )
    with pytest.raises(ConfigError, match=r"site_max_in_flight.*over site_permits_max"):
        load_settings(environ={}, flags={"site_max_in_flight": 100})
    with pytest.raises(ConfigError, match="`site_max_in_flight`"):
        load_settings(environ={}, flags={"site_max_in_flight": 0})
    with pytest.raises(ConfigError, match="`site_min_interval_ms`"):
        load_settings(environ={}, flags={"site_min_interval_ms": 86_400_001})
    with pytest.raises(ConfigError, match="shorter than site_failure_block_s"):
        load_settings(
            environ={}, flags={"site_failure_block_s": 600, "site_failure_block_max_s": 60}
        )


def test_the_api_reads_its_settings_from_the_nodes() -> None:
    """One source: every value the API reads comes from the node's settings (or its
    keeper's), and the lease cap is max_lease_s only in a cluster."""
    single = Settings(max_body_bytes=8192, site_permits_max=16, max_lease_s=120)
    api = api_settings(single, node="n", instance="i", worker=1, advertised_url="http://n")
    assert (api.max_body_bytes, api.site_permits_max, api.clustered) == (8192, 16, False)
    assert (api.node, api.instance, api.worker, api.advertised_url) == ("n", "i", 1, "http://n")
    assert api.max_lease_s == single.lease_cap_s == MAX_LEASE_S
    clustered = Settings(db="postgresql://db.example/rq", max_lease_s=120, node_ttl_s=30)
    api = api_settings(clustered, node="n", instance="i", worker=0, advertised_url="")
    assert (api.clustered, api.max_lease_s, api.node_ttl_s) == (True, 120, 30)
