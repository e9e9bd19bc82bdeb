"""The package's import structure: no import cycle among shardopt's modules (function-level imports count,
since they only hide a cycle until the function runs), ``shardopt.optim`` and ``shardopt.sharding`` never
import ``shardopt.plugin`` (engines are adapters that hand the optimizer its layouts; the algorithms never
ask which engine runs them), and no tensor carries a private ``_shardopt_*`` attribute (state and names are
addressed through the optimizer, never through marks on tensors).

Before issue 18, ``optim/base.py`` imported ``plugin/discover`` at step time, ``sharding/matrix_ops.py`` and
``sharding/owner.py`` imported each other, and the DeepSpeed adapter marked flat partitions with an attribute
that ``optim/base.py`` read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "shardopt"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    """``{module: package-internal modules it imports}``, from every ``import`` statement at any depth."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_package, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:  # ``import shardopt.optim.base as x`` -> the module itself
                    t = t.rpartition(".")[0]
                if t.startswith("shardopt") and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    assert _cycles(import_graph()) == []


def test_cycle_finder_finds_the_old_cycle() -> None:
    graph = {
        "shardopt.sharding.matrix_ops": {"shardopt.sharding.owner", "shardopt.sharding.layout"},
        "shardopt.sharding.owner": {"shardopt.sharding.matrix_ops"},
        "shardopt.sharding.layout": set(),
    }
    assert _cycles(graph) == [["shardopt.sharding.matrix_ops", "shardopt.sharding.owner"]]


def test_algorithms_do_not_import_engines() -> None:
    graph = import_graph()
    bad = sorted(
        (m, t)
        for m, ts in graph.items()
        for t in ts
        if m.startswith(("shardopt.optim", "shardopt.sharding")) and t.startswith("shardopt.plugin")
    )
    assert bad == []


def test_graph_sees_function_level_imports() -> None:
    graph = import_graph()
    assert "shardopt.sharding.layout" in graph["shardopt.sharding.matrix_ops"]
    assert graph["shardopt.checkpoint.api"]  # checkpoint.api imports the optimizer base


def test_no_private_tensor_attributes() -> None:
    pattern = re.compile(r"\._shardopt_\w+\s*=|getattr\([^)]*[\"']_shardopt_|hasattr\([^)]*[\"']_shardopt_")
    hits = [
        f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}"
        for p in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
