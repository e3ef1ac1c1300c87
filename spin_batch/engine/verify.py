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
from itertools import accumulate

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


def accept_fused(
    kernels,  # spin_batch.kernels
    target_logits: torch.Tensor,  # [R, V]
    drafts: list[list[int]],  # [S]
    draft_probs: list[torch.Tensor | None] | None,  # [S] as in accept_sampling; None when greedy
    gens: list[torch.Generator] | None,  # [S]; None when greedy
    sp: SamplingParams,
) -> Verdict:
    """The same verdicts from the Triton accept kernel: every segment in one launch, one host read.

    Greedy: identical to accept_greedy. Sampling: the same rule as accept_sampling, exact in
    distribution, but it consumes each request's random stream differently (all its accept
    uniforms, then one for the next token), so a seed does not give the torch path's text.
    Inputs go up in one asynchronous copy each, so the host waits only for the verdicts.
    """
    dev = target_logits.device
    S, lens = len(drafts), [len(d) for d in drafts]
    d_off = [0, *accumulate(lens)]
    index = _upload(torch.tensor(d_off + [0, *accumulate(n + 1 for n in lens)] + [t for d in drafts for t in d]), dev)
    d_off_t, r_off_t, flat = index[: S + 1], index[S + 1 : 2 * S + 2], index[2 * S + 2 :]
    if sp.greedy:
        acc, nxt = kernels.accept(target_logits.contiguous(), flat, d_off_t, r_off_t)
    else:
        # the kernel applies only a temperature: top-k / top-p go in as log-probs (-inf where filtered)
        logits = probs_from_logits(target_logits, sp).log()
        # One q for all segments or none. A deterministic draft goes in as q one-hot, which gives
        # the same accept test and residual as q None.
        q = None
        if any(x is not None for x in draft_probs):
            q = torch.zeros(len(flat), target_logits.shape[1], device=dev).scatter_(1, flat[:, None], 1.0)
            for start, x in zip(d_off, draft_probs):
                if x is not None:
                    q[start : start + len(x)] = x
        randoms = _upload(torch.cat([torch.rand(n, generator=g) for n, g in zip(lens, gens)]
                                    + [torch.rand(1, generator=g) for g in gens]), dev)
        acc, nxt = kernels.accept(logits, flat, d_off_t, r_off_t, q, randoms[: d_off[-1]], randoms[d_off[-1]:], 1.0)
    accepted, last = torch.stack([acc, nxt]).tolist()  # the one host sync
    return Verdict(accepted, [d[:k] + [t] for d, k, t in zip(drafts, accepted, last)])


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA from pinned memory without waiting for the copy."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
