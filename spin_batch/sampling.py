"""Turning logits into distributions, and seeding each request's random stream.

The same transform (temperature, then top-k, then top-p) is applied to the target's and the
drafters' logits, so speculative sampling preserves the distribution the user asked for. What is exact
and where: docs/numerics.md; timings: BENCHMARKS.md.

Top-p finds its nucleus among the row's largest logits (TOP_P_CANDIDATES, then more) and sorts the
whole vocabulary only for a row whose nucleus they do not hold: a full sort of a 49152-id row cost
several times a greedy step's argmax.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


SAMPLERS = ("gumbel", "rejection")
# Candidate counts a row's top-p nucleus is looked for among, in turn, before a full sort.
TOP_P_CANDIDATES = (64, 1024)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    # how sampled tokens are drawn and drafts verified (docs/numerics.md): "gumbel", Gumbel-max with noise
    # fixed by (seed, position, token), the same text whatever was drafted; "rejection", speculative
    # rejection sampling with the request's random stream
    sampler: str = "gumbel"

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
    return filtered_logits(logits, sp).softmax(-1)


def filtered_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[M, V] logits -> [M, V] float32 logits / temperature, -inf where top-k or top-p drops the token.

    top-k keeps the tokens at least as large as the k-th largest; top-p then keeps, in order of
    probability, each token the mass strictly before which is below top_p (the first one always),
    and with it every token as large as the smallest kept one (tied tokens stay or go together).
    """
    x = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]  # [M, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sp.top_p < 1.0:
        x = x.masked_fill(x < nucleus_floor(x, sp.top_p)[:, None], float("-inf"))
    return x


def nucleus_floor(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """[M, V] logits -> [M] the smallest logit top-p keeps per row.

    Each row's nucleus is looked for among its TOP_P_CANDIDATES largest logits, a full sort only
    where they do not hold it; every way gives the same floor (the tests compare them).
    """
    p = x.softmax(-1)  # [M, V]
    floor = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    todo = torch.arange(x.shape[0], device=x.device)
    for k in TOP_P_CANDIDATES:
        if k >= x.shape[-1] or todo.numel() == 0:
            break
        rows_x, rows_p = (x, p) if todo.numel() == x.shape[0] else (x[todo], p[todo])  # no copy at first
        top = torch.topk(rows_x, k + 1, dim=-1)  # [m, k + 1]: k candidates and the largest one left out
        kept, v = _nucleus(rows_p.gather(1, top.indices), top.values, top_p)
        # the candidates hold the nucleus when one of them is dropped and the one left out is below the floor
        held = (kept <= k) & (top.values[:, k] < v)
        floor[todo[held]] = v[held]
        todo = todo[~held]
    if todo.numel():
        ordered, order = torch.sort(x[todo], dim=-1, descending=True)
        floor[todo] = _nucleus(p[todo].gather(1, order), ordered, top_p)[1]
    return floor


def _nucleus(p: torch.Tensor, v: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities p [M, K] of logits v [M, K] in descending order -> (tokens kept [M], the smallest
    kept logit [M]): a token stays while the mass strictly before it is below top_p."""
    before = p.cumsum(-1) - p
    kept = (before < top_p).int().cumprod(-1).sum(-1).clamp_min(1)  # [M] a leading run; the first always
    return kept, v.gather(1, (kept - 1)[:, None])[:, 0]


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
