"""Triton kernels for the hot stages, each with a torch reference beside it (`*_ref`), except accept's:
its rule is the runtime's own torch path (spin_batch.engine.verify.accept_ref), which its tests and
scripts/bench_kernels.py hold it against. This package imports nothing of spin_batch.

Whether a job runs on them is chosen once per job (spin_batch.models.loader.resolve_execution, from
target.kernels and SPIN_BATCH_KERNELS); `problem()` says why they cannot run somewhere.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, is_interpreted
from .accept import accept
from .commit import accept_commit, accept_commit_ref
from .kv_write import _kv_write_kernel, kv_write, kv_write_ref
from .ngram import ngram_draft, ngram_draft_ref
from .ngram_tree import ngram_tree
from .tree import keep_path, keep_path_ref, tree_layout, tree_walk, tree_walk_ref
from .varlen_attention import varlen_attention, varlen_attention_ref

__all__ = [
    "accept",
    "accept_commit",
    "accept_commit_ref",
    "keep_path",
    "keep_path_ref",
    "kv_write",
    "kv_write_ref",
    "ngram_draft",
    "ngram_draft_ref",
    "ngram_tree",
    "problem",
    "tree_layout",
    "tree_walk",
    "tree_walk_ref",
    "triton_available",
    "varlen_attention",
    "varlen_attention_ref",
]


def triton_available() -> bool:
    """True when triton (and triton.language) imported."""
    return HAVE_TRITON


def problem(device: torch.device | str) -> str | None:
    """Why the kernels cannot run on tensors of `device` in this process, or None where they can: CUDA
    needs Triton; CPU needs the Triton interpreter (TRITON_INTERPRET=1 when triton was first imported,
    which importing this package sets by itself on a machine without CUDA)."""
    device = torch.device(device)
    if not HAVE_TRITON:
        return "Triton is not installed here (or does not import): pip install 'spin-batch[gpu]' installs it"
    if device.type == "cuda":
        return None
    if device.type != "cpu":
        return f"they run on CUDA, and on CPU under the Triton interpreter, not on {device.type}"
    if not is_interpreted(_kv_write_kernel):
        return ("on CPU they run only under the Triton interpreter: set TRITON_INTERPRET=1 before triton is first "
                "imported (this process imported it compiled, for the GPU)")
    return None
