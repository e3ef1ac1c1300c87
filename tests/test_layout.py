"""The imports point one way (docs/architecture.md): no import cycle between modules, and every import of one
of our modules allowed by the table below, which is the table of docs/architecture.md. Every import counts,
those inside functions too; spin_batch and the kernels (kernels/spin_kernels, imported as spin_kernels) both."""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"spin_batch": ROOT / "spin_batch", "spin_kernels": ROOT / "kernels" / "spin_kernels"}
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Rows of docs/architecture.md's table: the units a row covers (a module of spin_batch, a folder of it with
# everything under it, `__init__` for spin_batch's own, `spin_kernels` for the kernels) and the units they may
# import. The units of one row may import each other (the cycle test still holds between their modules).
TABLE: list[tuple[tuple[str, ...], set[str]]] = [
    (("cli",), {"runner", "distill", "bench", "bench_speed", "preflight", "outcome", "export", "report", "models", "io", "config",
                "__init__"}),
    (("runner",), {"build", "preflight", "fingerprint", "export", "io", "config", "records", "stats"}),
    (("distill",), {"runner", "build", "models", "io", "config"}),
    (("build",), {"engine", "selection", "drafters", "models", "config", "records", "grammars", "sampling", "stats",
                  "memory"}),
    (("memory",), {"cachedir", "models", "config"}),
    (("preflight",), {"drafters", "models", "io", "config"}),
    (("outcome",), {"io"}),
    (("fingerprint",), {"io", "config"}),
    (("bench", "bench_methods", "bench_plot", "bench_policies", "bench_speed", "llamacpp"),
     {"build", "engine", "selection", "models", "io", "config", "records", "stats", "cachedir", "memory",
      "__init__"}),
    (("ray_data",), {"build", "preflight", "io", "config", "records"}),
    (("export", "report"), {"io"}),
    (("engine",), {"selection", "drafters", "models", "sampling", "gumbel", "records", "grammars", "stats"}),
    (("selection",), set()),
    (("drafters",), {"models", "sampling", "gumbel"}),
    (("models",), {"spin_kernels", "cachedir"}),
    (("io",), {"records", "grammars"}),
    (("config",), {"records", "grammars"}),
    (("records", "grammars", "sampling", "gumbel", "stats", "cachedir", "__init__"), set()),
    (("spin_kernels",), set()),
]


def allowed(table: list[tuple[tuple[str, ...], set[str]]] = TABLE) -> dict[str, set[str]]:
    """Each unit: the units it may import (its row's, and the other units of its row)."""
    return {unit: set(may) | set(units) for units, may in table for unit in units}


def modules() -> dict[str, Path]:
    out = {}
    for root, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = (root, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Our modules that `name` imports (at any depth of its code)."""
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


def unit(module: str) -> str:
    """The table's unit of a module: spin_batch.engine.loop -> engine, spin_batch -> __init__,
    spin_kernels.accept -> spin_kernels."""
    parts = module.split(".")
    if parts[0] == "spin_kernels":
        return "spin_kernels"
    return parts[1] if len(parts) > 1 else "__init__"


def leaks(g: dict[str, set[str]], table: dict[str, set[str]]) -> list[str]:
    """Each import the table does not allow, as 'module -> module (unit may import: ...)'."""
    return [f"{m} -> {w} ({unit(m)} may import: {', '.join(sorted(table.get(unit(m), ()))) or 'nothing of ours'})"
            for m, targets in sorted(g.items()) for w in sorted(targets)
            if unit(w) != unit(m) and unit(w) not in table.get(unit(m), set())]


def docs_table(text: str) -> list[tuple[tuple[str, ...], set[str]]]:
    """The rows of the markdown table under '## The folders': the units named in backticks in the first
    column and in the last ('may import')."""
    section = text.split("## The folders", 1)[1].split("\n## ", 1)[0]

    def names(cell: str) -> list[str]:
        tokens = re.findall(r"`([^`]+)`", cell)
        units = (t.removeprefix("kernels/").removeprefix("spin_batch/").rstrip("/").removesuffix(".py") for t in tokens)
        return list(dict.fromkeys(units))

    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        rows.append((tuple(names(cells[0])), set(names(cells[-1]))))
    return rows


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_row():
    rows = allowed()
    assert sorted({unit(m) for m in graph()} - set(rows)) == []


def test_every_import_is_allowed_by_the_table():
    assert leaks(graph(), allowed()) == []


def test_every_allowance_is_used():
    """The table is a map of the code as it is: a row allows only what its units import."""
    used: dict[str, set[str]] = {}
    for m, targets in graph().items():
        used.setdefault(unit(m), set()).update(unit(w) for w in targets)
    unused = [f"{units} -> {w}" for units, may in TABLE for w in sorted(may)
              if not any(w in used.get(u, set()) for u in units)]
    assert unused == []


def test_the_kernels_import_nothing_of_spin_batch():
    g = graph()
    assert [f"{m} -> {w}" for m in g if m.startswith("spin_kernels") for w in g[m]
            if not w.startswith("spin_kernels")] == []


def test_the_leak_finder_finds_one():
    g = {"spin_kernels.varlen_attention": {"spin_batch.models.attention", "spin_kernels._triton"},
         "spin_batch.models.llama": {"spin_kernels", "spin_batch.models.attention"},
         "spin_batch.io.reader": {"spin_batch.config.sections", "spin_batch.records"}}
    assert leaks(g, allowed()) == [
        "spin_batch.io.reader -> spin_batch.config.sections (io may import: grammars, io, records)",
        "spin_kernels.varlen_attention -> spin_batch.models.attention (spin_kernels may import: spin_kernels)",
    ]


def test_the_docs_table_is_this_table():
    rows = docs_table(ARCHITECTURE.read_text())
    assert {units: sorted(may) for units, may in rows} == {units: sorted(may) for units, may in TABLE}


def tracked_files() -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    res = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if res.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in res.stdout.decode().split("\0") if name]


def test_no_wheel_and_no_large_file_twice_is_tracked():
    """Binaries stay out (*.whl), and a large file is tracked once: the shipped drafts run with their target's
    tokenizer instead of a copy each."""
    files = [f for f in tracked_files() if f.is_file()]
    assert [f.name for f in files if f.suffix == ".whl"] == []
    seen: dict[str, Path] = {}
    twice = []
    for f in files:
        if f.stat().st_size > 64 * 1024:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            if digest in seen:
                twice.append(f"{seen[digest].relative_to(ROOT)} = {f.relative_to(ROOT)}")
            seen.setdefault(digest, f)
    assert twice == []
