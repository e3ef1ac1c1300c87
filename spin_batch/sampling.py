"""Turning logits into distributions, and seeding each request's random stream.

The same transform (temperature, then top-k, then top-p) is applied to the target's and the
drafters' logits, so speculative sampling preserves the distribution the user asked for. What is exact
and where: docs/numerics.md; timings: BENCHMARKS.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def probs_per_row(logits: torch.Tensor, sps: Sequence[SamplingParams]) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32 probabilities, row i under its own settings sps[i].

    A greedy row becomes one-hot at its argmax: the rejection rule run on it accepts exactly the
    argmax and draws the argmax, whatever its uniforms, which is greedy decoding. Rows that share
    settings are transformed together; one setting for all rows is probs_from_logits itself.
    """
    groups: dict[SamplingParams, list[int]] = {}
    for i, sp in enumerate(sps):
        groups.setdefault(sp, []).append(i)
    if len(groups) == 1:
        return _row_probs(logits, sps[0])
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [M, V]
    for sp, rows in groups.items():
        index = torch.tensor(rows, device=logits.device)
        out[index] = _row_probs(logits[index], sp)
    return out


def _row_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    if not sp.greedy:
        return probs_from_logits(logits, sp)
    best = logits.argmax(-1, keepdim=True)  # [M, 1]
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, best, 1.0)


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32 probabilities after temperature, top-k and top-p."""
    x = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]  # [M, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (the first token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def request_seed(job_seed: int, request_id: str) -> int:
    """A stable 63-bit seed per request: same job seed and id give the same text on every run."""
    digest = hashlib.blake2b(f"{job_seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_generator(job_seed: int, request_id: str, row_seed: int | None = None) -> torch.Generator:
    """A request's random stream: from the row's own seed when it gives one (the same seed gives the
    same text, as in OpenAI's API, whatever the id), else from the job seed and the id."""
    g = torch.Generator(device="cpu")
    g.manual_seed(request_seed(job_seed, request_id) if row_seed is None else row_seed % (1 << 63))
    return g


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from a [V] distribution (non-negative, not necessarily normalised) by inverse_cdf.

    torch.multinomial cost far more per call on a large vocabulary and made sampled decoding much
    slower than greedy (the timings are in BENCHMARKS.md, "sampling by CDF inversion").
    """
    return inverse_cdf(probs, uniform64(gen))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor | float) -> int:
    """The token at uniform u of a [V] distribution (non-negative, not necessarily normalised).

    The CDF is summed in float64 and inverted: the token is the first i with cdf[i] > u * cdf[-1], so
    a token of weight 0 (cdf[i] == cdf[i - 1]) is never drawn; where rounding leaves no such i, the
    last token with weight.
    """
    cdf = weights.double().cumsum(0)
    u = torch.as_tensor(u, dtype=torch.float64).to(cdf.device)
    i = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True))
    return i if i < cdf.shape[0] else int(torch.nonzero(weights).max())  # u * total rounded up to total


def uniform(gen: torch.Generator) -> float:
    """A float32 uniform on [0, 1) from the request's stream (the accept tests)."""
    return float(torch.rand((), generator=gen).item())


def uniform64(gen: torch.Generator) -> torch.Tensor:
    """A float64 uniform on [0, 1) from the request's stream (the draws of a token)."""
    return torch.rand((), generator=gen, dtype=torch.float64)
