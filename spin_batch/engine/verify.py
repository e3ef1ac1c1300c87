"""The verifier: one rule decides which draft tokens stand.

Terms, used the same way everywhere:
- accepted: the number of leading draft tokens the target agrees with (0..gamma).
- recovered: the target's token at the first rejected position (greedy: its argmax; sampling:
  a draw from norm(max(p - q, 0))).
- bonus: the target's token after a fully accepted draft (a draw from p at the last row).
Every verified segment therefore yields accepted + 1 new tokens.

Inputs are ragged: the drafts of all segments are one flat list with offsets, and the target
rows of segment i are rows [row_offsets[i], row_offsets[i] + gamma_i + 1).

The rule is written once, in torch: accept_greedy (common_prefix with the argmax),
accept_gumbel (common_prefix with each row's Gumbel-max token, gumbel.py: the sampler "gumbel") and
rejection_sample (with inverse_cdf from sampling.py: the sampler "rejection"). accept_drafts
dispatches between them and the Triton kernel (accept_fused, greedy and rejection sampling);
accept_ref is the rule behind the kernel's interface, its test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from ..drafters.base import common_prefix
from ..gumbel import gumbel_tokens, position_key, seed_of
from ..models.cpu_decoder import argmax
from ..sampling import SamplingParams, inverse_cdf, probs_from_logits, probs_per_row, uniform, uniform64


@dataclass
class Verdict:
    accepted: list[int]  # [S] accepted draft tokens per segment
    tokens: list[list[int]]  # [S] new tokens per segment: accepted drafts + recovered/bonus
    # [S] per token-tree segment the accepted nodes as segment token indices (KVCache.keep_path's
    # path), None for a chain; None here: no tree in the batch
    paths: list[list[int] | None] | None = None


@dataclass(frozen=True)
class Uniforms:
    """One segment's randoms: accept(i) for draft i's test, draw() for the recovered/bonus token."""

    accept: Callable[[int], float]
    draw: Callable[[], torch.Tensor | float]

    @classmethod
    def from_generator(cls, gen: torch.Generator) -> Uniforms:
        """Drawn from the request's stream when needed: a test per draft reached, then the token."""
        return cls(lambda i: uniform(gen), lambda: uniform64(gen))

    @classmethod
    def zeros(cls) -> Uniforms:
        """For a greedy segment in a sampled batch: its p is one-hot, so any uniform decides alike."""
        return cls(lambda i: 0.0, lambda: 0.0)


def segment_rows(drafts: list[list[int]]) -> list[int]:
    """First target row of each segment when the rows lie end to end (gamma_i + 1 each)."""
    return [0, *accumulate(len(d) + 1 for d in drafts)][:-1]


def accept_greedy(
    target_logits: torch.Tensor,  # [R, V] rows of all segments, laid end to end
    drafts: list[list[int]],  # [S] draft tokens per segment (may be empty)
) -> Verdict:
    """Longest prefix of each draft that matches the target's argmax, then the target's token."""
    return _accept_tokens(argmax(target_logits).tolist(), drafts)  # [R]: the one host sync of the stage


def accept_gumbel(
    target_logits: torch.Tensor,  # [R, V]
    drafts: list[list[int]],  # [S]
    gens: list[torch.Generator | None],  # [S] each request's stream, whose seed keys its noise (None: greedy)
    sps: list[SamplingParams],  # [S]
    starts: list[int],  # [S] each segment's first position: the index in its row's tokens of the token it adds first
) -> Verdict:
    """Longest prefix of each draft that matches the target's token per row, then the target's token: the
    argmax for a greedy request, the Gumbel-max token at the row's position (gumbel.py) for a sampled one.
    Each request's text is therefore plain decoding's with the same seed, whatever was drafted."""
    best = argmax(target_logits).tolist()  # [R]
    rows = segment_rows(drafts)

    def follow(i: int, row: int, token: int) -> int | None:
        j = row - rows[i]
        return row + 1 if j < len(drafts[i]) and drafts[i][j] == token else None

    for row, t in gumbel_walk(target_logits, rows, gens, sps, starts, follow).items():
        best[row] = t
    return _accept_tokens(best, drafts)


def gumbel_walk(
    target_logits: torch.Tensor,  # [R, V]
    firsts: list[int],  # [S] each segment's first row
    gens: list[torch.Generator | None],  # [S] (None: greedy, skipped)
    sps: list[SamplingParams],  # [S]
    starts: list[int],  # [S] the position of each segment's first row
    follow: Callable[[int, int, int], int | None],  # (segment, row, its token) -> the accepted draft's row, or None
) -> dict[int, int]:
    """The sampled segments' Gumbel-max tokens, row -> token, only on the rows the verdict reads: each
    segment's first row, then the row of each draft token accepted, one batched call per depth (a row at
    depth k has position start + k)."""
    out: dict[int, int] = {}
    frontier = [(i, firsts[i], 0) for i, sp in enumerate(sps) if not sp.greedy]
    while frontier:
        at = torch.tensor([row for _, row, _ in frontier], device=target_logits.device)
        got = gumbel_tokens(target_logits[at], [sps[i] for i, _, _ in frontier],
                            [position_key(seed_of(gens[i]), starts[i] + k) for i, _, k in frontier])
        nxt = []
        for (i, row, k), t in zip(frontier, got):
            out[row] = t
            child = follow(i, row, t)
            if child is not None:
                nxt.append((i, child, k + 1))
        frontier = nxt
    return out


def uses_gumbel(sps: list[SamplingParams]) -> bool:
    """Whether a batch's sampled requests take the Gumbel sampler (a job has one sampler for all rows)."""
    return any(not sp.greedy and sp.sampler == "gumbel" for sp in sps)


def _accept_tokens(best: list[int], drafts: list[list[int]]) -> Verdict:
    """Each draft's longest prefix equal to the target's token per row (best [R]), then the target's token."""
    rows = segment_rows(drafts)
    accepted = [common_prefix(d, best[row : row + len(d)]) for d, row in zip(drafts, rows)]
    return Verdict(accepted, [d[:k] + [best[row + k]] for d, k, row in zip(drafts, accepted, rows)])


def accept_sampling(
    target_logits: torch.Tensor,  # [R, V]
    drafts: list[list[int]],  # [S]
    draft_probs: list[torch.Tensor | None],  # [S] each [gamma_i, V] q, or None for a deterministic draft
    gens: list[torch.Generator | None],  # [S] each request's own random stream (None: a greedy request)
    sps: list[SamplingParams],  # [S] each request's settings; greedy ones decide by argmax
) -> Verdict:
    """Speculative rejection sampling; each request's output is distributed exactly as sampling
    from its own p (a greedy request's p is one-hot at the argmax: greedy decoding)."""
    rands = [Uniforms.zeros() if sp.greedy else Uniforms.from_generator(g) for g, sp in zip(gens, sps)]
    return rejection_sample_segments(probs_per_row(target_logits, row_settings(drafts, sps)), drafts, draft_probs,
                                     rands)


def row_settings(drafts: list[list[int]], sps: list[SamplingParams]) -> list[SamplingParams]:
    """Per target row (gamma_i + 1 per segment, end to end), its segment's settings."""
    return [sp for d, sp in zip(drafts, sps) for _ in range(len(d) + 1)]


def rejection_sample_segments(
    p_all: torch.Tensor,  # [R, V] target probs, the segments' rows end to end
    drafts: list[list[int]],  # [S]
    draft_probs: list[torch.Tensor | None],  # [S] each [gamma_i, V] q, or None
    rands: list[Uniforms],  # [S]
) -> Verdict:
    """rejection_sample over every segment."""
    accepted, tokens = [], []
    for d, q, rand, row in zip(drafts, draft_probs, rands, segment_rows(drafts)):
        k, nxt = rejection_sample(p_all[row : row + len(d) + 1], d, q, rand)
        accepted.append(k)
        tokens.append(d[:k] + [nxt])
    return Verdict(accepted, tokens)


def rejection_sample(p: torch.Tensor, d: list[int], q: torch.Tensor | None, rand: Uniforms) -> tuple[int, int]:
    """One segment: (accepted, the recovered token at the first rejection or the bonus token).

    p [gamma + 1, V] target probs; q [gamma, V] draft probs, or None for a deterministic draft
    (q one-hot at the draft). Draft i stands when q[x] > 0 and u < min(1, p[x] / q[x]).
    """
    for i, x in enumerate(d):
        qx = 1.0 if q is None else float(q[i, x])
        if not (qx > 0 and rand.accept(i) < min(1.0, float(p[i, x]) / qx)):
            return i, inverse_cdf(recovered_probs(p[i], None if q is None else q[i], x), rand.draw())
    return len(d), inverse_cdf(p[len(d)], rand.draw())


def recovered_probs(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """norm(max(p - q, 0)) after draft x is rejected ([V]; q None: p without x); p where no mass is left."""
    if q is None:
        residual = p.clone()
        residual[x] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = float(residual.sum())
    # p == q leaves no residual mass; rejection then has probability 0, but guard rounding.
    return residual / total if total > 0 else p


def accept_drafts(
    kernels,  # spin_kernels, or None for the torch reference
    target_logits: torch.Tensor,  # [R, V]
    drafts: list[list[int]],  # [S]
    draft_probs: list[torch.Tensor | None],  # [S] as in accept_sampling (unused when greedy)
    gens: list[torch.Generator | None],  # [S] (None for greedy requests)
    sps: list[SamplingParams],  # [S] each request's settings (temperature, top-k, top-p)
    starts: list[int] | None = None,  # [S] each segment's first position (the Gumbel sampler's noise)
) -> Verdict:
    """The one dispatch: the Gumbel rule when a sampled request takes it (torch), else the Triton accept
    kernel when `kernels` is given, else the torch rule."""
    if uses_gumbel(sps):
        if starts is None:
            raise ValueError("the Gumbel sampler needs each segment's position")
        return accept_gumbel(target_logits, drafts, gens, sps, starts)
    if kernels is not None:
        return accept_fused(kernels, target_logits, drafts, draft_probs, gens, sps)
    if all(sp.greedy for sp in sps):
        return accept_greedy(target_logits, drafts)
    return accept_sampling(target_logits, drafts, draft_probs, gens, sps)


def accept_ref(
    target_logits: torch.Tensor,  # [R, V]
    draft_tokens: torch.Tensor,  # [T] drafts of all segments end to end
    draft_offsets: torch.Tensor,  # [S + 1]
    row_offsets: torch.Tensor,  # [S + 1]: first target row of each segment
    draft_probs: torch.Tensor | None = None,  # [T, V] q, or None for deterministic drafts
    u: torch.Tensor | None = None,  # [T] float32 accept-test uniforms (sampling only)
    u2: torch.Tensor | None = None,  # [S] float32 recovered/bonus uniforms (sampling only)
    temperature: float = 0.0,  # 0: greedy
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [S] int64, next_token [S] int64
    """The kernel's interface (kernels/accept.py) to this module's rule, with the randoms given."""
    d_off, r_off, flat = draft_offsets.tolist(), row_offsets.tolist(), draft_tokens.tolist()
    drafts = [flat[a:b] for a, b in zip(d_off[:-1], d_off[1:])]
    rows = torch.cat([torch.arange(r, r + len(d) + 1) for r, d in zip(r_off, drafts)] + [torch.arange(0)])
    logits = target_logits[rows.to(target_logits.device)]  # the segments' rows, end to end
    if temperature == 0:
        v = accept_greedy(logits, drafts)
    else:
        qs = [None if draft_probs is None else draft_probs[a:b] for a, b in zip(d_off[:-1], d_off[1:])]
        rands = [Uniforms(lambda i, a=a: float(u[a + i]), lambda s=s: u2[s]) for s, a in enumerate(d_off[:-1])]
        v = rejection_sample_segments(probs_from_logits(logits, SamplingParams(temperature)), drafts, qs, rands)
    dev = target_logits.device
    return (torch.tensor(v.accepted, dtype=torch.int64, device=dev),
            torch.tensor([t[-1] for t in v.tokens], dtype=torch.int64, device=dev))


def accept_fused(
    kernels,  # spin_kernels
    target_logits: torch.Tensor,  # [R, V]
    drafts: list[list[int]],  # [S]
    draft_probs: list[torch.Tensor | None] | None,  # [S] as in accept_sampling; None when greedy
    gens: list[torch.Generator | None],  # [S]; None for greedy requests
    sps: list[SamplingParams],  # [S]
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
    if all(sp.greedy for sp in sps):
        acc, nxt = kernels.accept(target_logits.contiguous(), flat, d_off_t, r_off_t)
    else:
        # the kernel applies only a temperature: each row's own temperature, top-k and top-p go in as
        # log-probs (-inf where filtered; a greedy row one-hot at its argmax)
        logits = probs_per_row(target_logits, row_settings(drafts, sps)).log()
        # One q for all segments or none. A deterministic draft goes in as q one-hot, which gives
        # the same accept test and residual as q None.
        q = None
        if any(x is not None for x in draft_probs):
            q = torch.zeros(len(flat), target_logits.shape[1], device=dev).scatter_(1, flat[:, None], 1.0)
            for start, x in zip(d_off, draft_probs):
                if x is not None:
                    q[start : start + len(x)] = x
        randoms = _upload(torch.cat([_rand(n, g) for n, g in zip(lens, gens)] + [_rand(1, g) for g in gens]), dev)
        acc, nxt = kernels.accept(logits, flat, d_off_t, r_off_t, q, randoms[: d_off[-1]], randoms[d_off[-1]:], 1.0)
    accepted, last = torch.stack([acc, nxt]).tolist()  # the one host sync
    return Verdict(accepted, [d[:k] + [t] for d, k, t in zip(drafts, accepted, last)])


def _rand(n: int, gen: torch.Generator | None) -> torch.Tensor:
    """n float32 uniforms from a request's stream; zeros for a greedy request (its p is one-hot)."""
    return torch.zeros(n) if gen is None else torch.rand(n, generator=gen)


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to CUDA from pinned memory without waiting for the copy."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
