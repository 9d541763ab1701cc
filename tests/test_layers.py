"""The packages' dependency direction (docs/design.md, "Packages and layers"), enforced.

A module may import its own package and the packages of lower layers, never a higher
layer nor a sibling in its own layer. Every import counts, those inside functions and
under `TYPE_CHECKING` too: a deferred import is still a dependency.

A small walk over the source with `ast` rather than import-linter: the rule is two
tables, and the failure names the file, the line and the import to move.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top first. Packages on one line are siblings: neither may import the other.
LAYERS: list[set[str]] = [
    {"bench"},  # measures everything, from outside and inside
    {"workers", "fleet"},  # the node's processes and CLI; the render fleet's client
    {"api"},  # the HTTP API a worker serves
    {"keeper", "sitemap"},  # the queue in memory; sitemap import
    {"store"},  # the durable schedule and its change feed
    {"shm"},  # shared memory and its C extension
]

# The store's backends are named only where a process is put together (workers, bench)
# and inside `store` itself; everything else goes through the interface (`store.base`,
# `store.rows`, `store.errors`, `store.url`...), so a third backend changes none of it.
BACKENDS = ("store.sqlite", "store.postgres")
MAY_NAME_A_BACKEND = {"store", "workers", "bench"}


def layer_of(package: str) -> int:
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise AssertionError(f"package {package!r} is in no layer: add it to LAYERS")


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            assert node.level == 0, f"{path}:{node.lineno}: relative import; write it absolute"
            yield node.lineno, node.module


def packages() -> list[str]:
    return sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))


def test_every_package_has_a_layer() -> None:
    placed = set().union(*LAYERS)
    assert set(packages()) == placed


def against_layers(package: str, path: Path) -> list[str]:
    """The imports in `path`, a module of `package`, of a higher layer or a sibling."""
    mine = layer_of(package)
    known = set().union(*LAYERS)
    wrong = []
    for line, module in imports(path):
        top = module.split(".")[0]
        if top != package and top in known and layer_of(top) <= mine:
            wrong.append(f"{path}:{line}: {package} imports {module}")
    return wrong


def test_no_package_imports_a_higher_layer_or_a_sibling() -> None:
    wrong = [
        message
        for package in packages()
        for path in sorted((ROOT / package).rglob("*.py"))
        for message in against_layers(package, path.relative_to(ROOT))
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_only_the_composition_roots_name_a_store_backend() -> None:
    wrong: list[str] = []
    for package in sorted(set(packages()) - MAY_NAME_A_BACKEND):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imports(path):
                if module.startswith(BACKENDS):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {package} imports {module}")
    assert not wrong, "backends named outside workers and bench:\n" + "\n".join(wrong)


def test_the_store_interface_does_not_import_its_backends() -> None:
    """`store.base` and the records beside it sit under both backends; only the URL
    dispatcher (`store.url`) and the backends themselves name one."""
    wrong: list[str] = []
    for path in sorted((ROOT / "store").glob("*.py")):
        if path.name == "url.py":
            continue
        for line, module in imports(path):
            if module.startswith(BACKENDS):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports {module}")
    assert not wrong, "the store's interface imports a backend:\n" + "\n".join(wrong)


def test_the_check_can_fail(tmp_path: Path) -> None:
    """Planted imports are found: up a layer, to a sibling, and deferred into a function."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from store.rows import Row\n"
        "import workers.config\n"
        "def later():\n"
        "    from sitemap import parse\n"
    )
    assert [m.split(": ", 1)[1] for m in against_layers("keeper", planted)] == [
        "keeper imports workers.config",
        "keeper imports sitemap",
    ]
