"""The verifier: one rule decides which draft tokens stand.

Terms, used the same way everywhere:
- accepted: the number of leading draft tokens the target agrees with (0..gamma).
- recovered: the target's token at the first rejected position (greedy: its argmax; sampling:
  a draw from norm(max(p - q, 0))).
- bonus: the target's token after a fully accepted draft (a draw from p at the last row).
Every verified segment therefore yields accepted + 1 new tokens.

Inputs are ragged: the drafts of all segments are one flat list with offsets, and the target
rows of segment i are rows [row_offsets[i], row_offsets[i] + gamma_i + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, probs_from_logits, sample, uniform


@dataclass
class Verdict:
    accepted: list[int]  # [S] accepted draft tokens per segment
    tokens: list[list[int]]  # [S] new tokens per segment: accepted drafts + recovered/bonus


def accept_greedy(
    target_logits: torch.Tensor,  # [R, V] rows of all segments, laid end to end
    drafts: list[list[int]],  # [S] draft tokens per segment (may be empty)
) -> Verdict:
    """Longest prefix of each draft that matches the target's argmax, then the target's token."""
    best = target_logits.argmax(-1).tolist()  # [R]: the one host sync of the stage
    accepted, tokens, row = [], [], 0
    for d in drafts:
        k = 0
        while k < len(d) and d[k] == best[row + k]:
            k += 1
        accepted.append(k)
        tokens.append(d[:k] + [best[row + k]])
        row += len(d) + 1
    return Verdict(accepted, tokens)


def accept_sampling(
    target_logits: torch.Tensor,  # [R, V]
    drafts: list[list[int]],  # [S]
    draft_probs: list[torch.Tensor | None],  # [S] each [gamma_i, V] q, or None for a deterministic draft
    gens: list[torch.Generator],  # [S] each request's own random stream
    sp: SamplingParams,
) -> Verdict:
    """Speculative rejection sampling; the output is distributed exactly as sampling from p."""
    p_all = probs_from_logits(target_logits, sp)  # [R, V]
    accepted, tokens, row = [], [], 0
    for d, q, gen in zip(drafts, draft_probs, gens):
        p = p_all[row : row + len(d) + 1]
        k, nxt = _accept_one(p, d, q, gen)
        accepted.append(k)
        tokens.append(d[:k] + [nxt])
        row += len(d) + 1
    return Verdict(accepted, tokens)


def _accept_one(p: torch.Tensor, d: list[int], q: torch.Tensor | None, gen: torch.Generator) -> tuple[int, int]:
    for i, x in enumerate(d):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if qx > 0 and uniform(gen) < min(1.0, px / qx):
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = (p[i] - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # p == q leaves no residual mass; rejection then has probability 0, but guard rounding.
        return i, sample(residual / total if total > 0 else p[i], gen)
    return len(d), sample(p[len(d)], gen)
