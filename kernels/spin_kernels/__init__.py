"""Triton kernels for the hot stages, each with a torch reference (`*_ref`; accept's is
spin_batch.engine.verify.accept_ref, the rule the torch path runs)."""

from __future__ import annotations

import os

import torch

from ._triton import HAVE_TRITON
from .accept import accept
from .kv_write import kv_write, kv_write_ref
from .varlen_attention import varlen_attention, varlen_attention_ref

__all__ = [
    "accept",
    "kv_write",
    "kv_write_ref",
    "triton_available",
    "use_kernels",
    "varlen_attention",
    "varlen_attention_ref",
]


def triton_available() -> bool:
    """True when triton (and triton.language) imported."""
    return HAVE_TRITON


def use_kernels(device: torch.device | str) -> bool:
    """Whether to dispatch to the Triton kernels for tensors on `device`.

    SPIN_BATCH_KERNELS=on: yes (CPU tensors then run under the Triton interpreter: slow, for
    tests); off: no; auto or unset: yes iff the device is CUDA and triton is importable.
    """
    mode = os.environ.get("SPIN_BATCH_KERNELS", "auto").strip().lower()
    if mode == "on":
        return True
    if mode == "off":
        return False
    if mode not in ("", "auto"):
        raise ValueError(f"SPIN_BATCH_KERNELS must be on, off or auto, got {mode!r}")
    return torch.device(device).type == "cuda" and HAVE_TRITON
