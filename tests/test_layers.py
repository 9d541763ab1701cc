"""The packages' dependency direction (docs/design.md, "Packages and layers"), enforced.

A module may import its own package and the packages of lower layers, never a higher
layer nor a sibling in its own layer. Every import counts, those inside functions and
under `TYPE_CHECKING` too: a deferred import is still a dependency.

Within a package, modules must not import each other in a circle: a circle makes every
module in it a dependency of every other, and invites the import deferred into a function
(or put under TYPE_CHECKING) to get past it.

A small walk over the source with `ast` rather than import-linter: the rule is two
tables, and the failure names the file, the line and the import to move.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Top first. Packages on one line are siblings: neither may import the other.
LAYERS: list[set[str]] = [
    {"bench"},  # measures everything, from outside and inside
    {"workers", "fleet"},  # the node's processes and CLI; the render fleet's client
    {"api"},  # the HTTP API a worker serves
    {"wire"},  # the API's bodies, shared by the node and its clients
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


def module_imports(package_dir: Path) -> dict[str, dict[str, int]]:
    """The package's modules (file stems) and, for each, the modules of the same package it
    imports, with the line of the first such import. `from pkg import a, b` names modules
    as well as `from pkg.a import x` and `import pkg.a` do."""
    package = package_dir.name
    modules = {p.stem for p in package_dir.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, dict[str, int]] = {}
    for module in sorted(modules):
        edges: dict[str, int] = {}
        path = package_dir / f"{module}.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            named: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module == package:
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                named = [node.module.removeprefix(package + ".").split(".")[0]]
                named = named if node.module.startswith(package + ".") else []
            elif isinstance(node, ast.Import):
                named = [
                    alias.name.removeprefix(package + ".").split(".")[0]
                    for alias in node.names
                    if alias.name.startswith(package + ".")
                ]
            for target in named:
                if target in modules and target != module:
                    assert isinstance(node, ast.Import | ast.ImportFrom)
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Each group of modules that import each other in a circle (strongly connected, more
    than one module), sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group: list[str] = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in graph:
        if module not in order:
            visit(module)
    return sorted(found)


def described(package_dir: Path, group: list[str]) -> str:
    graph = module_imports(package_dir)
    edges = [
        f"  {package_dir.name}/{module}.py:{line}: imports {package_dir.name}.{target}"
        for module in group
        for target, line in sorted(graph[module].items())
        if target in group
    ]
    return f"{package_dir.name}: {', '.join(group)}\n" + "\n".join(edges)


def test_no_modules_of_a_package_import_each_other_in_a_circle() -> None:
    found = [
        described(ROOT / package, group)
        for package in packages()
        for group in circles(module_imports(ROOT / package))
    ]
    assert not found, "modules importing each other in a circle:\n" + "\n".join(found)


def test_the_circle_check_can_fail(tmp_path: Path) -> None:
    """A planted circle is found, through a deferred import and `from pkg import module`;
    a chain that does not close is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def later():\n    from pkg import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg.a import x\n")
    assert circles(module_imports(package)) == [["a", "b", "c"]]
    (package / "c.py").write_text("import pkg.d\n")
    assert circles(module_imports(package)) == [["a", "b", "c", "d"]]
    (package / "d.py").write_text("")
    assert circles(module_imports(package)) == []


# Run in a fresh interpreter where importing any of these fails as if not installed.
WITHOUT_THE_SERVER = """
import importlib.abc, sys

BLOCKED = {blocked!r}

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
{body}
"""


def import_without(blocked: set[str], modules: list[str]) -> subprocess.CompletedProcess[str]:
    body = "\n".join(f"import {module}" for module in modules)
    code = WITHOUT_THE_SERVER.format(blocked=sorted(blocked), body=body)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


SERVER = {"starlette", "uvicorn", "api"}


def test_the_fleet_imports_without_the_server() -> None:
    """A renderer's host needs the fleet client and the wire types, not the node: with
    starlette, uvicorn and the api package unimportable, the fleet's modules import."""
    done = import_without(SERVER, ["wire.schemas", "fleet.client", "fleet.runner", "fleet.cli"])
    assert done.returncode == 0, done.stderr


def test_the_import_block_can_fail() -> None:
    done = import_without(SERVER, ["api.app"])
    assert done.returncode != 0 and "(blocked)" in done.stderr, done.stderr
