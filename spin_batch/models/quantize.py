"""Int8 copies of a model, for drafting (an early-exit drafter with `quantize: int8`).

A draft only proposes tokens: the target verifies every one, so a draft's precision changes how often
its tokens are accepted, never the output. The target itself in int8 is such a draft: it agrees with the
float32 target on about 96% of greedy tokens (the embedded model, docs/trees.md), reads a quarter of the
bytes a decode step, and multiplies int8 by int8 (64 products an instruction with AVX512-VNNI).

Weights: each output row gets one float32 scale, its largest magnitude over 127, and its weights round to
the nearest int8 (symmetric; no zero point). Activations: each row of a linear's input is quantized when
the linear runs, in groups of GROUP inputs, each group with its own scale the same way. One scale per
whole row instead cost 4.5 points of agreement (91.8% against 96.1%, 16 demo prompts x 48 tokens): a few
large inputs flatten the rest. The embedding stays the target's (a lookup reads one row a token); the
layers' linears and the LM head are quantized. The copy shares the target's KV cache like any early-exit
draft: cache rows before the proposal hold the target's own K/V. The copy is built by
LlamaModel.int8_copy; Linear(quantize=True) holds each quantized weight, and runs on the C int8 GEMM
(spin_gemm_q8) or, off the C path, on torch with the same rounding (fake_quantize_groups).
"""

from __future__ import annotations

import torch

from .cpu_decoder import Q8_GROUP as GROUP  # inputs per activation scale
from .execution import CpuPlan

INT8_MAX = 127
INT8_C = CpuPlan("c", "c", "int8 weights: the C int8 GEMM, the one fast path for them (not measured)")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, K] -> (q [O, K] int8, scale [O] float32) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def fake_quantize_groups(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded as the int8 GEMM rounds its input: per group of GROUP inputs along K (the last
    group zero-padded), scale = the group's largest magnitude / 127, values to the nearest int8 step.
    Returns the rounded values in x's dtype (q * scale), for the torch path."""
    K = x.shape[-1]
    pad = -K % GROUP
    xf = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], (K + pad) // GROUP, GROUP)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv)
    out = (q * (amax / INT8_MAX)).reshape(*x.shape[:-1], K + pad)[..., :K]
    return out.to(x.dtype)
