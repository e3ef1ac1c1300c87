"""The package's imports point one way (docs/architecture.md): no import cycle between modules, and no
layer importing one above it. Every import counts, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "spin_batch"

# What each layer must not import (the layers above it, or beside it where they stay apart).
FORBIDDEN = {
    "engine": {"io", "runner", "build", "preflight", "cli", "bench", "bench_methods", "ray_data", "config"},
    "selection": {"engine", "drafters", "models", "io", "runner", "build", "cli", "config"},
    "drafters": {"engine", "selection", "io", "runner", "build", "cli", "config"},
    "models": {"engine", "selection", "drafters", "io", "runner", "build", "cli"},
    "io": {"engine", "selection", "drafters", "models", "runner", "build", "cli"},
    "config": {"engine", "selection", "drafters", "models", "io", "runner", "build", "cli"},
    "records": {"engine", "selection", "drafters", "models", "io", "runner", "build", "cli", "config"},
    "sampling": {"engine", "selection", "drafters", "models", "io", "runner", "build", "cli", "config"},
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports (at any depth of its code)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target, *(f"{target}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != name}
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_layer_imports_one_above_it():
    leaks = [f"{m} -> {w}" for m, targets in graph().items() for w in targets
             if layer(w) in FORBIDDEN.get(layer(m), set())]
    assert leaks == []
