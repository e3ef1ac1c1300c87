"""spin-batch: offline batch LLM inference with SPIN speculative decoding."""

import sys
from pathlib import Path

__version__ = "0.1.0"


def _unshadow_kernels() -> None:
    """Keep the repository's top-level `kernels/` from hiding the PyPI package `kernels`.

    Our Triton kernels live in `kernels/` at the top of the repository and install as
    `spin_batch.kernels`. transformers imports a PyPI package of the same name, so a process
    whose sys.path holds the repository root (Python started in it, or a Ray worker, whose
    path gets the driver's working directory) would find ours and fail inside transformers.
    The root is never needed to import spin_batch once it is installed, so it is dropped, as
    is a `kernels` module already imported from there.
    """
    root = Path(__file__).resolve().parent.parent
    if not (root / "kernels" / "__init__.py").is_file() or not (root / "pyproject.toml").is_file():
        return  # installed from a wheel: nothing of ours is called `kernels`
    def is_root(entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() == root
        except OSError:
            return False

    sys.path[:] = [p for p in sys.path if not is_root(p)]
    mod = sys.modules.get("kernels")
    if mod is not None and Path(getattr(mod, "__file__", None) or "/").resolve().parent.parent == root:
        del sys.modules["kernels"]


_unshadow_kernels()
