"""Int8 copies of a model, for drafting (an early-exit drafter with `quantize: int8`).

A draft only proposes tokens: the target verifies every one, so a draft's precision changes how often
its tokens are accepted, never the output. The target itself in int8 is such a draft: it agrees with the
float32 target on nearly every greedy token (docs/trees.md has the figures), reads a quarter of the
bytes a decode step, and multiplies int8 by int8 (64 products an instruction with AVX512-VNNI).

Weights: each output row gets one float32 scale, its largest magnitude over 127, and its weights round to
the nearest int8 (symmetric; no zero point). Activations: each row of a linear's input is quantized when
the linear runs, in groups of GROUP inputs, each group with its own scale the same way. One scale per
whole row instead cost agreement (docs/trees.md): a few large inputs flatten the rest. The embedding stays the target's (a lookup reads one row a token); the
layers' linears and the LM head are quantized. The copy shares the target's KV cache like any early-exit
draft: cache rows before the proposal hold the target's own K/V. The copy is built by
LlamaModel.int8_copy; Linear(quantize=True) holds each quantized weight, and runs on the C int8 GEMM
(spin_gemm_q8) or, off the C path, on torch with the same rounding (fake_quantize_groups).

The LM head is a fifth of the copy's bytes, and a draft needs only its largest logits. On the C path it is
a RescoredHead: int4 weights (a scale per output row and group of GROUP inputs) score every id at half the
bytes, and each row's RESCORED best ids under them get the int8 head's exact logit. Int4 alone moved the
copy's argmax often; with the best few rescored, the argmax is the int8 head's (docs/trees.md).
"""

from __future__ import annotations

import torch

from .cpu_decoder import PANEL, Q8_GROUP as GROUP  # inputs per activation scale
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


INT4_MAX = 7
RESCORED = 8  # ids per row whose int4 proxy logit RescoredHead replaces with the int8 head's


def quantize_groups4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [O, K] -> (q [O, K] int8 holding int4 values in -7..7, scale [O, G] float32), per output row and
    group of GROUP inputs (K zero-padded to G * GROUP): the group's largest magnitude over 7, to nearest."""
    w = weight.detach().float()
    O, K = w.shape
    g = torch.nn.functional.pad(w, (0, -K % GROUP)).reshape(O, -1, GROUP)
    scale = g.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / INT4_MAX  # [O, G]
    q = torch.round(g / scale[..., None]).clamp_(-INT4_MAX, INT4_MAX).reshape(O, -1)[:, :K]
    return q.to(torch.int8), scale


class RescoredHead:
    """An int8 copy's LM head on the C path (the module docstring): called on x [M, C] float32, returns [M, V]
    float32 logits, int4 proxies but for each row's RESCORED best ids, which hold the int8 head's logits
    exactly (spin_head_q4). A draft's distribution is whatever it computes, so sampling stays exact."""

    def __init__(self, lib, weight: torch.Tensor):
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        self.padded = -(-self.out_features // PANEL) * PANEL
        q4, s4 = quantize_groups4(weight)
        groups = s4.shape[1]
        self.packed = torch.empty(self.padded * groups * GROUP // 2, dtype=torch.uint8)
        lib.spin_gemm_pack_q4(q4.data_ptr(), self.packed.data_ptr(), self.out_features, self.in_features, self.padded)
        ws = torch.zeros(self.padded, groups)
        ws[: self.out_features] = s4
        self.group_scales = ws.view(-1, 16, groups).transpose(1, 2).contiguous()  # [padded / 16, G, 16]
        self.q8, self.scale8 = quantize_rows(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()
        M = x.shape[0]
        y = torch.empty(M, self.padded)
        if M:
            k = min(RESCORED, self.out_features)
            idx = torch.empty(M, k, dtype=torch.long)
            scratch = torch.empty(self.lib.spin_gemm_q8_scratch(M, self.in_features), dtype=torch.uint8)
            self.lib.spin_head_q4(x.data_ptr(), self.packed.data_ptr(), self.group_scales.data_ptr(), self.q8.data_ptr(),
                                  self.scale8.data_ptr(), y.data_ptr(), idx.data_ptr(), M, self.padded,
                                  self.in_features, self.out_features, k, scratch.data_ptr())
        return y[:, : self.out_features]
