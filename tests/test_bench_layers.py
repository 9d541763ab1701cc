"""bench/'s own layout, enforced: the harness at the bottom, the peer queues on it, the
sections on top, and no import circle among bench's modules (bench/README.md, "Where
things are").

Every import counts, those inside functions too: a deferred import is still a
dependency, and a circle of deferred imports is still a circle a reader must hold whole.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What each part of bench/ may import of bench/ (its own part always).
MAY_IMPORT = {
    "bench.harness": set[str](),
    "bench.peers": {"bench.harness"},
    "bench.sections": {"bench.harness", "bench.peers"},
    "bench.__main__": {"bench.harness"},
}


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module of the `bench` package under `root`."""
    found = {}
    for path in sorted((root / "bench").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def graph(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Module -> (line, bench module) of each import it makes of another bench module.
    `from bench.harness import report` is an import of bench.harness.report."""
    known = modules(root)
    edges: dict[str, list[tuple[int, str]]] = {}
    for name, path in known.items():
        out = edges.setdefault(name, [])
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [
                    f"{node.module}.{alias.name}"
                    if f"{node.module}.{alias.name}" in known
                    else node.module
                    for alias in node.names
                ]
            else:
                continue
            out.extend(
                (node.lineno, target)
                for target in targets
                if target in known and target != name and target != "bench"
            )
    return edges


def circles(edges: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Each strongly connected group of two or more modules (Tarjan's), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for _, target in edges.get(node, []):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def part_of(module: str) -> str | None:
    return next((part for part in MAY_IMPORT if module.startswith(part)), None)


def against_parts(edges: dict[str, list[tuple[int, str]]], root: Path) -> list[str]:
    wrong = []
    for module, targets in sorted(edges.items()):
        part = part_of(module)
        if part is None:
            continue
        for line, target in targets:
            other = part_of(target)
            if other is not None and other != part and other not in MAY_IMPORT[part]:
                path = modules(root)[module].relative_to(root)
                wrong.append(f"{path}:{line}: {module} imports {target}")
    return wrong


def test_bench_has_no_import_circle() -> None:
    assert circles(graph(ROOT)) == []


def test_harness_peers_and_sections_import_downward_only() -> None:
    assert against_parts(graph(ROOT), ROOT) == []


def test_every_section_the_runner_names_is_a_module_of_sections() -> None:
    from bench import __main__ as runner

    for section in runner.SECTIONS + runner.ON_DEMAND:
        assert runner.exists(section), section


def test_the_checks_can_fail(tmp_path: Path) -> None:
    for package in ("bench", "bench/harness", "bench/sections"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "bench/harness/report.py").write_text("from bench.sections import a\n")
    (tmp_path / "bench/sections/a.py").write_text("def f():\n    from bench.sections.b import x\n")
    (tmp_path / "bench/sections/b.py").write_text("from bench.sections import a\nx = 1\n")
    edges = graph(tmp_path)
    assert circles(edges) == [["bench.sections.a", "bench.sections.b"]]
    assert against_parts(edges, tmp_path) == [
        "bench/harness/report.py:1: bench.harness.report imports bench.sections.a"
    ]


def test_a_runnable_module_runs_main_last() -> None:
    """`python -m bench.sections.x` runs the module top to bottom: anything defined after
    the `__main__` guard does not exist yet when main() runs."""
    late = []
    for name, path in modules(ROOT).items():
        body = ast.parse(path.read_text()).body
        for index, node in enumerate(body):
            guard = isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
            if guard and index != len(body) - 1:
                late.append(f"{path.relative_to(ROOT)}:{body[index + 1].lineno}: {name}")
    assert late == []
