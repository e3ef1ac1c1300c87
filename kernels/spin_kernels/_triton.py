"""Optional Triton import, and interpreter mode on machines without a GPU.

Triton fixes at decoration time whether each `@triton.jit` function (its own standard library
included) is compiled for a GPU or interpreted with numpy on the host, from the env var
TRITON_INTERPRET. Triton has no CPU backend, so on a machine without CUDA the interpreter is
the only mode that can run anything: when triton has not been imported yet, TRITON_INTERPRET is
unset and no CUDA device is present, this module sets TRITON_INTERPRET=1 before importing it.
CPU tensors reaching a compiled kernel get a clear error instead of a crash.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install
    triton = None
    tl = None
    HAVE_TRITON = False


def require_triton(name: str) -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"{name} needs Triton, which is not importable here; use {name}_ref instead")


def is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def launcher(kernel, device: torch.device):
    """The kernel to launch for tensors on `device` (interpreted kernels run anywhere)."""
    if device.type == "cpu" and not is_interpreted(kernel):
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before triton "
            "is first imported (this process imported it in compiled mode)"
        )
    return kernel
