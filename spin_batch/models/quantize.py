"""Weight-only int8 copies of a model, for drafting (an early-exit drafter with `quantize: int8`).

A draft only proposes tokens: the target verifies every one, so a draft's precision changes how often
its tokens are accepted, never the output. The target itself with int8 weights is such a draft: it
agrees with the float32 target on about 97% of greedy tokens (the embedded model, docs/trees.md), and on
CPU, where a decode step streams every weight once, it reads a quarter of the bytes.

Each output row of a weight gets one float32 scale, its largest magnitude over 127, and its weights round
to the nearest int8 (symmetric; no zero point). The embedding stays the target's (a lookup reads one row
a token); the layers' linears and the LM head are quantized. The copy shares the target's KV cache like
any early-exit draft: cache rows before the proposal hold the target's own K/V.
"""

from __future__ import annotations

import torch

from . import cpu_decoder
from .execution import TORCH, CpuPlan
from .spec import EMBED_TENSOR, HEAD_TENSOR

INT8_MAX = 127
INT8_C = CpuPlan("c", "c", "int8 weights: the C int8 GEMM, the one fast path for them (not measured)")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, K] -> (q [O, K] int8, scale [O] float32) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_copy(target, state_dict: dict[str, torch.Tensor], num_layers: int | None = None):
    """A LlamaModel of the target's first num_layers layers (all by default) with int8 linears and LM head,
    sharing the target's embedding, final norm and kernels. state_dict: the target's checkpoint (the
    target's packed weights are not read back)."""
    from .llama import LlamaModel

    def get(name: str) -> torch.Tensor:
        return state_dict[name].to(device=target.device, dtype=target.dtype)

    # The C int8 GEMM wherever the job lets the CPU use C (target.kernels torch: off): int8 has no fast torch
    # path, so the target's measured float32 plan does not apply.
    c = target.device.type == "cpu" and target.execution.cpu != "torch" and cpu_decoder.library() is not None
    plan = INT8_C if c else TORCH
    layers = LlamaModel.layers_from_state_dict(target.spec, get, c, quantize=True, num_layers=num_layers)
    head = get(HEAD_TENSOR if HEAD_TENSOR in state_dict else EMBED_TENSOR)
    return LlamaModel(target.spec, target.embed, layers, target.norm, head, quantize=True, plan=plan,
                      execution=target.execution)
