"""Which CPU path runs a model, chosen by measuring both on this machine for the model's own shapes.

A model on CPU runs its decoder layers one of three ways:
- `c`: every layer in one call of our C decoder (cpu_decoder.c: panel GEMMs, C attention). Each row is
  computed alone, so its result does not depend on the batch: speculative greedy output is exact in
  bfloat16 as well as float32.
- `torch+c_attention`: oneDNN's prepacked GEMMs for the linears, our C attention.
- `torch`: oneDNN (or torch's own GEMM where oneDNN refuses the dtype) and torch's attention.
and its LM head on `c` or `torch`. Which is faster depends on the CPU far more than on anything else:
on a Zen4 or Sapphire Rapids the C path wins at the loop's batch sizes; a C build that is slow on some
CPU (as our AVX2 build once was, 16x slower than torch on a Zen3) must never become the default there.

So on the `auto` path (execution.py: target.kernels auto, SPIN_BATCH_CPU_GEMM unset or `auto`) the first
time this kind of machine meets a model's
shapes, dtype, thread count and the loop's row counts, `plan()` builds one decoder layer and the LM head
with random weights of those shapes, times every candidate on the loop's forwards (decode and verify
rows at a context of CONTEXT tokens, the best of REPS runs each) and keeps the fastest. The C path is
kept unless another is more than C_MARGIN faster: it alone gives batch-invariant results. The choice is
written to $SPIN_BATCH_CACHE/cpu_decoder/plans.json beside the library's builds, keyed by the build, so
later runs (and the other tasks of a Slurm array on the same kind of node) read it instead of timing.

The `c` path (target.kernels: c, or SPIN_BATCH_CPU_GEMM=on) forces `c` wherever the C decoder takes the
model (and fails where the library cannot be built); `torch` (target.kernels: torch or triton, or
SPIN_BATCH_CPU_GEMM=off) forces `torch`. model_plan() turns the choice into the model's whole plan
(execution.ModelPlan), which the model reads; whatever was chosen, and why, is on the model
(`LlamaModel.plan`), in summary.json and in `spin-batch env`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable

import torch

from ..cachedir import cache_root, file_lock, write_atomic
from . import cpu_decoder
from .execution import LAYERS, NATIVE, TORCH, CpuPlan, Execution, ModelPlan
from .llama import LayerWeights, Linear, LlamaModel, attention_shape
from .segments import Segments

CONTEXT = 256  # cached tokens per slot in the timed forwards
REPS = 5
C_MARGIN = 0.03


def workloads(slots: int, speculative_tokens: int) -> tuple[tuple[int, int], ...]:
    """The loop's forwards, as (segments, tokens each): decode steps and, when it speculates, verify runs."""
    out = [(slots, 1)]
    if speculative_tokens > 0:
        out.append((slots, 1 + speculative_tokens))
    return tuple(out)


def _fixed(spec, dtype: torch.dtype, execution: Execution) -> CpuPlan | None:
    """The plan when nothing needs measuring, else None."""
    why = execution.cpu_reason()
    if execution.cpu == "torch":
        return CpuPlan("torch", "torch", why)
    if dtype not in (torch.float32, torch.bfloat16):
        return CpuPlan("torch", "torch", f"{str(dtype).removeprefix('torch.')}: the C kernels take float32 and bfloat16")
    lib = cpu_decoder.require(why) if execution.cpu == "c" else cpu_decoder.library()
    if lib is None:
        return CpuPlan("torch", "torch", f"the C library is unavailable ({cpu_decoder.unavailable_reason()})")
    if dtype == torch.bfloat16 and (spec.hidden_size % 2 or spec.intermediate_size % 2
                                    or (spec.num_heads * spec.head_dim) % 2):
        return CpuPlan("torch", "torch", "bfloat16 with an odd layer width: the C GEMM reads inputs in pairs")
    attention_ok = cpu_decoder.attention_applies(lib, dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    if execution.cpu == "c":
        if not attention_ok:
            return CpuPlan("torch", "c", f"{why}; the C attention does not take this head size")
        return CpuPlan("c", "c", why)
    return None


def plan(spec, dtype: torch.dtype, device: torch.device, loop: tuple[tuple[int, int], ...] | None,
         execution: Execution) -> CpuPlan:
    """The plan for a model of this spec and dtype on device, on the job's CPU path (execution.cpu: measured
    for the loop's forwards `loop`, see workloads(); None: one slot, decode and a 4-token draft's verify)."""
    if device.type != "cpu":
        return TORCH
    fixed = _fixed(spec, dtype, execution)
    if fixed is not None:
        return fixed
    loop = loop or workloads(1, 4)
    lib = cpu_decoder.library()
    key = "|".join([
        cpu_decoder.build_key(), str(dtype).removeprefix("torch."), f"threads={torch.get_num_threads()}",
        f"torch={torch.__version__}/{torch.backends.cpu.get_cpu_capability()}/{os.environ.get('ONEDNN_MAX_CPU_ISA', '')}",
        ",".join(str(x) for x in (spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads,
                                   spec.head_dim, spec.vocab_size, int(spec.qkv_bias),
                                   int(getattr(spec, "o_bias", False)))),
        ";".join(f"{s}x{n}" for s, n in loop),
    ])
    path = cache_root() / cpu_decoder.CACHE / "plans.json"
    cached = _read(path).get(key)
    if cached:
        return CpuPlan(cached["layers"], cached["lm_head"], f"measured on this machine earlier ({path})", cached["ms"])
    attention_ok = cpu_decoder.attention_applies(lib, dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    candidates = LAYERS if attention_ok else ("torch",)
    t0 = time.perf_counter()
    layer_ms = _time_layers(spec, dtype, loop, candidates)
    head_ms = _time_head(spec, dtype, loop)
    layers = _pick(layer_ms)
    lm_head = _pick(head_ms)
    ms = {"layers": {k: round(v, 3) for k, v in layer_ms.items()}, "lm_head": {k: round(v, 3) for k, v in head_ms.items()}}
    with file_lock(path.with_name(".plans.json.lock")):
        plans = _read(path)
        plans[key] = {"layers": layers, "lm_head": lm_head, "ms": ms,
                      "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        write_atomic(path, json.dumps(plans, indent=1, sort_keys=True))
    rows = ", ".join(f"{s}x{n}" for s, n in loop)
    return CpuPlan(layers, lm_head, f"measured now in {time.perf_counter() - t0:.1f} s (forwards of {rows} rows, "
                                    f"context {CONTEXT}); kept in {path}", ms)


def model_plan(spec, dtype: torch.dtype, device: torch.device, loop: tuple[tuple[int, int], ...] | None,
               execution: Execution, cpu: CpuPlan | None = None) -> ModelPlan:
    """The whole plan of a native model (execution.ModelPlan): its CPU path `cpu` where given (forced), else
    plan()'s."""
    cpu = cpu or plan(spec, dtype, device, loop, execution)
    return ModelPlan.make(NATIVE, dtype, device, execution, cpu, attention_shape(spec))


def _pick(ms: dict[str, float]) -> str:
    """The fastest candidate, except that `c` stays unless another beats it by more than C_MARGIN."""
    best = min(ms, key=ms.get)
    if "c" in ms and ms["c"] <= ms[best] * (1 + C_MARGIN):
        return "c"
    return best


def _read(path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _random(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).uniform_(-0.05, 0.05).to(dtype)


def best_ms(fns: dict[str, Callable[[], object]], reps: int = REPS) -> dict[str, float]:
    """Each candidate's best time of `reps` calls, in milliseconds. The candidates' calls alternate
    (a b, b a, a b, ...), so a slow spell of a shared machine hits them alike instead of whichever
    candidate it happened to fall on."""
    for fn in fns.values():
        fn()  # warm: first-touch of buffers, oneDNN's primitive cache
    best = {name: float("inf") for name in fns}
    order = list(fns)
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            fns[name]()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: b * 1e3 for name, b in best.items()}


def _time_layers(spec, dtype: torch.dtype, loop, candidates) -> dict[str, float]:
    """Milliseconds of one decoder layer per candidate, summed over the loop's forwards."""

    C, I, H, KV, D = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    one = dataclasses.replace(spec, num_layers=1, vocab_size=64)
    w = {"qkv": _random((H + 2 * KV) * D, C, dtype=dtype), "o": _random(C, H * D, dtype=dtype),
         "gate_up": _random(2 * I, C, dtype=dtype), "down": _random(C, I, dtype=dtype)}
    bias = _random((H + 2 * KV) * D, dtype=dtype) if spec.qkv_bias else None
    o_bias = _random(C, dtype=dtype) if getattr(spec, "o_bias", False) else None  # no fused C decoder then
    norm = torch.ones(C, dtype=dtype)
    models = {}
    for cand in candidates:
        plan_ = ModelPlan.make(NATIVE, dtype, torch.device("cpu"), cpu=CpuPlan(cand, "torch", "candidate"),
                               heads=(H, KV, D))
        biases = {"qkv": bias, "o": o_bias}
        lin = {k: Linear(v, biases.get(k), panel=plan_.linears) for k, v in w.items()}
        layer = LayerWeights(norm, lin["qkv"], lin["o"], norm, lin["gate_up"], lin["down"])
        models[cand] = LlamaModel(one, _random(64, C, dtype=dtype), [layer], norm, _random(64, C, dtype=dtype),
                                  max_len=CONTEXT + 32, plan=plan_)
    out = {c: 0.0 for c in candidates}
    for slots, n in loop:
        seg = Segments(list(range(slots)), [i * n for i in range(slots + 1)], [CONTEXT] * slots)
        tokens = torch.arange(slots * n) % 64
        caches = {cand: model.allocate_cache(slots, CONTEXT + n) for cand, model in models.items()}
        with torch.inference_mode():
            ms = best_ms({cand: (lambda m=model, c=caches[cand]: m.hidden(tokens, seg, c, 1))
                          for cand, model in models.items()})
        for cand, v in ms.items():
            out[cand] += v
    return out


def _time_head(spec, dtype: torch.dtype, loop) -> dict[str, float]:
    """Milliseconds of the LM head per candidate, summed over the loop's forwards (every row's logits)."""

    w = _random(spec.vocab_size, spec.hidden_size, dtype=dtype)
    xs = [_random(s * n, spec.hidden_size, dtype=dtype) for s, n in loop]
    heads = {cand: Linear(w, panel=cand == "c") for cand in ("c", "torch")}
    if heads["c"].panel is None:  # no C build for this dtype here
        del heads["c"]
    out = {cand: 0.0 for cand in heads}
    for x in xs:
        for cand, v in best_ms({cand: (lambda h=h: h(x)) for cand, h in heads.items()}).items():
            out[cand] += v
    return out
