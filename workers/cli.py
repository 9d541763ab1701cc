"""The `renderqueue` command.

    renderqueue serve [--config FILE] [--db PATH] [--host H] [--port P] [--workers N] ...
    renderqueue demo [--port P] [--reset] [--with-fleet] [--cluster N]
    renderqueue fleet ...            (the simulated render fleet; fleet.cli)
    renderqueue import-sitemap ...   (sitemap import; sitemap.cli)

Settings come from a TOML file, then RENDERQUEUE_* environment variables, then flags.
Tokens are read from the file or the environment only, never from flags (a flag shows
in every process listing).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

from api.version import VERSION
from workers.config import FIELD_NAMES, ConfigError, Settings, flag_name, load_settings

EXIT_USAGE = 2
SECRET_OR_NESTED = frozenset({"fleet_token", "admin_token", "metrics_token", "keeper"})
DELEGATED = {
    "fleet": ("fleet.cli", "the simulated fleet"),
    "import-sitemap": ("sitemap.cli", "the sitemap importer"),
}


def add_setting_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    parser.add_argument("--config", metavar="FILE", help="a TOML settings file")
    fields = Settings.__struct_fields__
    helps = {
        "db": "a SQLite path or a store URL",
        "host": "address to listen on (loopback unless tokens are set)",
        "port": "port to listen on (0 picks a free one)",
        "workers": "number of HTTP worker processes; worker 0 also hosts the keeper",
    }
    for name in fields:
        if name in SECRET_OR_NESTED:
            continue
        parser.add_argument(
            flag_name(name),
            dest=name,
            default=defaults.get(name),
            metavar=name.upper(),
            help=helps.get(name),
        )


def settings_from(args: argparse.Namespace) -> Settings:
    flags = {name: getattr(args, name, None) for name in FIELD_NAMES if hasattr(args, name)}
    return load_settings(config_file=args.config, flags=flags)


def run_delegated(command: str, argv: list[str]) -> int:
    module_name, what = DELEGATED[command]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(
            f"renderqueue {command}: {what} is not available in this build ({exc})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    entry: Callable[[list[str]], int] | None = getattr(module, "main", None)
    if entry is None:
        print(f"renderqueue {command}: {module_name} has no main()", file=sys.stderr)
        return EXIT_USAGE
    return int(entry(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="renderqueue", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"renderqueue {VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run a node: the supervisor and its workers")
    add_setting_flags(serve, {})
    demo = commands.add_parser(
        "demo", help="run a node on SQLite under ./var with the example schedule"
    )
    add_setting_flags(demo, {})
    demo.add_argument(
        "--schedule", metavar="FILE", help="the example schedule (default: examples/)"
    )
    demo.add_argument(
        "--reset", action="store_true", help="reload the example schedule even if rows exist"
    )
    demo.add_argument(
        "--with-fleet", action="store_true", help="also run the simulated fleet against it"
    )
    demo.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="run N nodes on PostgreSQL (--db, by default the local renderqueue_demo "
        "database, created if missing) on ports P, P+1, ..., with a simulated fleet across "
        "them",
    )
    backup = commands.add_parser(
        "backup", help="copy a SQLite store to a new file while its node runs"
    )
    backup.add_argument(
        "--db", metavar="PATH", help="the store (default: RENDERQUEUE_DB, or the config's db)"
    )
    backup.add_argument("--config", metavar="FILE", help="a TOML settings file")
    backup.add_argument("--to", required=True, metavar="FILE", help="the new file to write")
    for command, (_, what) in DELEGATED.items():
        commands.add_parser(command, help=f"{what} (see `renderqueue {command} --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] in DELEGATED:
        return run_delegated(args_list[0], args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    try:
        if args.command == "serve":
            return serve(settings_from(args))
        if args.command == "backup":
            return run_backup(args)
        if args.command == "demo":
            from workers.demo import run_demo

            return run_demo(args, settings_from)
    except ConfigError as exc:
        print(f"renderqueue: {exc}", file=sys.stderr)
        return EXIT_USAGE
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE


def run_backup(args: argparse.Namespace) -> int:
    from store.errors import StoreError
    from store.sqlite.backup import backup

    path = settings_from(args).sqlite_path()
    if path is None:
        print(
            "renderqueue backup: copies a SQLite store; back up PostgreSQL with pg_dump "
            "(a node recognises a restored dump and starts its change log anew)",
            file=sys.stderr,
        )
        return EXIT_USAGE

    def progress(written: int, expected: int) -> None:
        share = f" ({written / expected:.0%})" if expected else ""
        print(f"  {written / 1e6:,.1f} MB written{share}", file=sys.stderr, flush=True)

    try:
        done = backup(path, args.to, progress)
    except StoreError as exc:
        print(f"renderqueue {exc}", file=sys.stderr)
        return 1
    print(
        f"backed up {done.rows:,} rows ({done.bytes / 1e6:,.1f} MB) from {path} to {done.path} "
        f"in {done.seconds:.1f} s"
    )
    return 0


def serve(settings: Settings) -> int:
    from workers import logs
    from workers.supervisor import Supervisor

    logs.configure("supervisor", settings.log_level, settings.log_format, node=settings.node_name())
    return Supervisor(settings).run()


if __name__ == "__main__":
    sys.exit(main())
