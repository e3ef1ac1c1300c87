"""Compile the kernels' real launches for an NVIDIA GPU without one (ptxas ships with triton).

    TRITON_INTERPRET=0 python scripts/aot_check.py [--arch 90] [--quick]

Each public wrapper is called on small CPU tensors with its launch intercepted; the launch it
would make (argument types, constexprs, num_warps, num_stages) is compiled to a cubin for the
given compute capability, and the shared memory each needs is printed. Interpreted kernels
cannot be compiled: without a GPU, set TRITON_INTERPRET=0 (else spin_kernels turns the
interpreter on when it imports triton).

A build check for developers and CI (tests/test_kernels.py runs it), not part of the kernels package.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

_TRITON_TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int32: "i32",
    torch.int64: "i64",
}


def compile_launch(module_name: str, wrapper: str, *args, arch: int = 90, **kwargs):
    """Runs spin_kernels.<module_name>.<wrapper>(*args, **kwargs) with the launch
    intercepted and compiles that launch; returns (constexprs, compiled kernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from spin_kernels._triton import is_interpreted

    mod = importlib.import_module(f"spin_kernels.{module_name}")
    launches = []

    class _Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((self.kernel, a, kw))

    saved = mod.launcher, getattr(mod, "is_interpreted", None)
    mod.launcher = lambda kernel, device: _Recorder(kernel)
    if saved[1] is not None:
        mod.is_interpreted = lambda kernel: False
    try:
        getattr(mod, wrapper)(*args, **kwargs)
    finally:
        mod.launcher = saved[0]
        if saved[1] is not None:
            mod.is_interpreted = saved[1]
    (kernel, a, kw), = launches
    if is_interpreted(kernel):
        raise RuntimeError("the kernels were decorated for the interpreter; run with TRITON_INTERPRET=0")
    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    sig = {}
    for name, value in zip(kernel.arg_names, a):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: cannot type {type(value).__name__}")
    sig.update({k: "constexpr" for k in kw})
    compiled = triton.compile(ASTSource(kernel, sig, kw), target=GPUTarget("cuda", arch, 32), options=options)
    return kw, compiled


_QUICK_ATTENTION = [(torch.bfloat16, 64, 1), (torch.bfloat16, 128, 64), (torch.float32, 64, 5),
                    (torch.float32, 256, 64)]


def launches(quick: bool = False):
    """(module, wrapper, args, kwargs) covering every kernel variant the wrappers pick
    (quick: a representative few, including the largest shared-memory one)."""
    out = []
    i32 = dict(dtype=torch.int32)
    full = [(dt, D, n) for dt in (torch.bfloat16, torch.float16, torch.float32) for D in (64, 128, 256, 80)
            for n in (1, 5, 64)]  # decode, verify, prefill chunk (block sizes differ)
    for dtype, D, n in _QUICK_ATTENTION if quick else full:
        q = torch.empty(2 * n, 6, D, dtype=dtype)  # GQA group 3
        ck = torch.empty(2, 2, 128, D, dtype=dtype)
        seg = (torch.zeros(2, **i32), torch.tensor([0, n, 2 * n], **i32), torch.zeros(2, **i32), n)
        out.append(("varlen_attention", "varlen_attention", (q, ck, ck, *seg), {}))
        tree_mask = torch.zeros(2 * n, dtype=torch.long)  # the HAS_TREE variant (token trees)
        out.append(("varlen_attention", "varlen_attention", (q, ck, ck, *seg, tree_mask), {}))
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        x = torch.empty(3, 3, 64, dtype=dtype)
        c = torch.empty(2, 3, 8, 64, dtype=dtype)
        idx = torch.zeros(3, dtype=torch.long)
        out.append(("kv_write", "kv_write", (c, c, idx, idx, x, x), {}))
    drafts, offs, rows = torch.zeros(4, dtype=torch.long), torch.tensor([0, 4]), torch.tensor([0, 5])
    u, u2 = torch.zeros(4), torch.zeros(1)
    logit_rows = [torch.empty(6, 49152)] + ([] if quick else [torch.empty(6, 49152, dtype=torch.bfloat16)])
    for logits in logit_rows:
        out.append(("accept", "accept", (logits, drafts, offs, rows), {}))
        out.append(("accept", "accept", (logits, drafts, offs, rows, None, u, u2, 0.7), {}))
        out.append(("accept", "accept", (logits, drafts, offs, rows, torch.empty(4, 49152), u, u2, 0.7), {}))
    # the device step's kernels (engine/device_step.py): accept and commit, the n-gram lookup
    P, L, B, G = 5, 64, 4, 8
    state = (torch.zeros(P, L, dtype=torch.long), *(torch.zeros(P, dtype=torch.long) for _ in range(4)),
             torch.zeros(P, 8, dtype=torch.long), torch.zeros(P, **i32), torch.zeros(P, 3, dtype=torch.long),
             torch.zeros(P, 5 + G + 1, **i32))
    for g in (0, G):
        step = (torch.zeros(B, dtype=torch.long), torch.zeros(B, g, dtype=torch.long), torch.zeros(B, dtype=torch.long),
                torch.zeros(B, g + 1, dtype=torch.long))
        out.append(("commit", "accept_commit", (*step, *state), {}))
    out.append(("ngram", "ngram_draft", (torch.zeros(B, dtype=torch.long), state[0], state[1],
                                         torch.zeros(B, dtype=torch.long), torch.zeros(4, dtype=torch.long), G, 1, 3), {}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="a representative few launches only")
    ap.add_argument("--smem-limit", type=int, default=160 * 1024, help="fail above this many bytes")
    args = ap.parse_args(argv)
    worst = 0
    for module, wrapper, a, kw in launches(args.quick):
        constexprs, compiled = compile_launch(module, wrapper, *a, arch=args.arch, **kw)
        smem = compiled.metadata.shared
        worst = max(worst, smem)
        print(f"{wrapper:17s} smem={smem:7d}  {constexprs}")
    print(f"all compiled for sm_{args.arch}; largest shared memory {worst} bytes")
    return 0 if worst <= args.smem_limit else 1


if __name__ == "__main__":
    sys.exit(main())
