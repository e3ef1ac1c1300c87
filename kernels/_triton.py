"""Optional Triton import and the choice of compiled vs interpreted launch.

Triton decides at decoration time whether `@triton.jit` compiles (GPU) or interprets (numpy on
the host), from the env var TRITON_INTERPRET. The kernel modules may well be imported before a
test sets that variable, so `launcher` picks per call instead: tensors on the CPU always run
through the interpreter (Triton has no CPU backend); anything else runs the kernel as decorated.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install (no driver libraries, ...)
    triton = None
    tl = None
    HAVE_TRITON = False

_interpreted: dict[int, object] = {}


def require_triton(name: str) -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"{name} needs Triton, which is not importable here; use {name}_ref instead")


def is_interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def launcher(kernel, device: "torch.device"):  # noqa: F821
    """The kernel to launch for tensors on `device`: interpreted for CPU tensors."""
    if device.type != "cpu" or is_interpreted(kernel):
        return kernel
    fn = kernel.fn  # the undecorated Python function behind a JITFunction
    if id(fn) not in _interpreted:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted[id(fn)] = InterpretedFunction(fn)
    return _interpreted[id(fn)]


