"""Time the Triton kernels against their torch references on the GPU.

    python scripts/bench_kernels.py [--slots 64 --context 1024 --heads 9 --kv-heads 3
                                    --head-dim 64 --dtype bf16]

Attention is timed for a decode batch (every slot 1 new token), a verify batch (1 + gamma
tokens) and a prefill chunk batch, all at the given context; the reported bandwidth is the
bytes of K/V the packed batch must read (each slot's valid length, once per KV head) divided by
the time. Without CUDA it runs a tiny configuration under the Triton interpreter, only to
exercise the script (those timings mean nothing).

A script, not part of either package: it holds the kernels (spin_kernels) against the runtime's
torch rules (spin_batch), and spin_kernels imports nothing of spin_batch.
"""

from __future__ import annotations

import argparse
import time

import torch

from spin_batch.engine.verify import accept_ref
from spin_kernels import accept, kv_write, kv_write_ref, varlen_attention, varlen_attention_ref

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time(fn, iters: int, device: torch.device) -> float:
    """Median seconds per call."""
    fn()  # warm up (and compile)
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def bench_attention(name, slots, new_tokens, context, H, KV, D, dtype, device, iters) -> None:
    """`slots` segments of `new_tokens` each, whose context (cache + new) is `context`."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cache_len = context - new_tokens
    ck = torch.randn(slots, KV, context, D, generator=g).to(device=device, dtype=dtype)  # [slots, KV, L, D]
    cv = torch.randn(slots, KV, context, D, generator=g).to(device=device, dtype=dtype)
    q = torch.randn(slots * new_tokens, H, D, generator=g).to(device=device, dtype=dtype)  # [N, H, D]
    i32 = dict(dtype=torch.int32, device=device)
    args = (
        q, ck, cv,
        torch.arange(slots, **i32),
        torch.arange(0, slots * new_tokens + 1, new_tokens, **i32),
        torch.full((slots,), cache_len, **i32),
        new_tokens,
    )
    err = (varlen_attention(*args).float() - varlen_attention_ref(*args).float()).abs().max().item()
    t_k = _time(lambda: varlen_attention(*args), iters, device)
    t_r = _time(lambda: varlen_attention_ref(*args), max(3, iters // 5), device)
    kv_bytes = slots * KV * context * D * ck.element_size() * 2
    print(
        f"attention {name:8s} {slots:3d} x {new_tokens:3d} tok, ctx {context}, H={H} KV={KV} D={D} {str(dtype)[6:]}: "
        f"triton {t_k * 1e6:9.1f} us {kv_bytes / t_k / 1e9:8.1f} GB/s | "
        f"torch ref {t_r * 1e6:9.1f} us {kv_bytes / t_r / 1e9:8.1f} GB/s | "
        f"speedup {t_r / t_k:6.1f}x | max |diff| {err:.2e}"
    )


def bench_kv_write(slots, new_tokens, context, KV, D, dtype, device, iters) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    ck = torch.zeros(slots, KV, context, D, dtype=dtype, device=device)
    cv = torch.zeros_like(ck)
    N = slots * new_tokens
    token_slots = torch.arange(slots, device=device).repeat_interleave(new_tokens)  # [N]
    positions = (context - new_tokens + torch.arange(new_tokens, device=device)).repeat(slots)  # [N]
    k = torch.randn(N, KV, D, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(N, KV, D, generator=g).to(device=device, dtype=dtype)
    t_k = _time(lambda: kv_write(ck, cv, token_slots, positions, k, v), iters, device)
    t_r = _time(lambda: kv_write_ref(ck, cv, token_slots, positions, k, v), iters, device)
    print(f"kv_write  {N:4d} tokens KV={KV} D={D}: triton {t_k * 1e6:8.1f} us | torch ref {t_r * 1e6:8.1f} us")


def bench_accept(segments, gamma, vocab, device, iters) -> None:
    g = torch.Generator(device="cpu").manual_seed(2)
    R, T = segments * (gamma + 1), segments * gamma
    logits = torch.randn(R, vocab, generator=g).to(device)
    best = logits.argmax(-1).view(segments, gamma + 1)[:, :gamma].reshape(-1)  # drafts that agree
    kw = dict(
        target_logits=logits,
        draft_tokens=best,
        draft_offsets=torch.arange(0, T + 1, gamma, device=device),
        row_offsets=torch.arange(0, R + 1, gamma + 1, device=device),
        draft_probs=None,
        u=torch.rand(T, generator=g).to(device),
        u2=torch.rand(segments, generator=g).to(device),
    )
    for temperature in (0.0, 1.0):
        t_k = _time(lambda: accept(**kw, temperature=temperature), iters, device)
        t_r = _time(lambda: accept_ref(**kw, temperature=temperature), max(3, iters // 5), device)
        print(
            f"accept    {segments:3d} x gamma {gamma}, V={vocab}, temperature {temperature}: "
            f"triton {t_k * 1e6:8.1f} us | torch ref (host loop) {t_r * 1e6:8.1f} us"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Time the Triton kernels against their torch references.")
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        device = torch.device("cpu")
        print("no CUDA device: a tiny run under the Triton interpreter (timings are meaningless)")
        a.slots, a.context, a.vocab, a.iters = 4, 64, 256, 3
    dtype = _DTYPES[a.dtype]
    H, KV, D = a.heads, a.kv_heads, a.head_dim
    bench_attention("decode", a.slots, 1, a.context, H, KV, D, dtype, device, a.iters)
    bench_attention("verify", a.slots, 1 + a.gamma, a.context, H, KV, D, dtype, device, a.iters)
    prefill_slots, chunk = max(1, a.slots // 16), min(256, a.context)
    bench_attention("prefill", prefill_slots, chunk, a.context, H, KV, D, dtype, device, a.iters)
    bench_kv_write(a.slots, 1 + a.gamma, a.context, KV, D, dtype, device, a.iters)
    bench_accept(a.slots, a.gamma, a.vocab, device, a.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
