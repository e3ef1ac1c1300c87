"""Weight-only int8 copies of a model, for drafting (an early-exit drafter with `quantize: int8`).

A draft only proposes tokens: the target verifies every one, so a draft's precision changes how often
its tokens are accepted, never the output. The target itself with int8 weights is such a draft: it
agrees with the float32 target on about 97% of greedy tokens (the embedded model, docs/trees.md), and on
CPU, where a decode step streams every weight once, it reads a quarter of the bytes.

Each output row of a weight gets one float32 scale, its largest magnitude over 127, and its weights round
to the nearest int8 (symmetric; no zero point). The embedding stays the target's (a lookup reads one row
a token); the layers' linears and the LM head are quantized. The copy shares the target's KV cache like
any early-exit draft: cache rows before the proposal hold the target's own K/V. The copy is built by
LlamaModel.int8_copy; Linear(quantize=True) holds each quantized weight.
"""

from __future__ import annotations

import torch

from .execution import CpuPlan

INT8_MAX = 127
INT8_C = CpuPlan("c", "c", "int8 weights: the C int8 GEMM, the one fast path for them (not measured)")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, K] -> (q [O, K] int8, scale [O] float32) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale
