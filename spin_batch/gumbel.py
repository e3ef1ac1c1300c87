"""Reproducible sampling: Gumbel-max with noise fixed by (the row's seed, the position, the token id).

A sampled token is argmax_i(x_i + g_i), x the row's logits after temperature, top-k and top-p
(sampling.filtered_logits) and g_i a standard Gumbel variable; the argmax of Gumbel-perturbed
logits is a draw from softmax(x) (the Gumbel-max trick). Here g_i is not drawn from a generator but
computed, by a counter-based hash of (seed, position, i): the token a row takes at a position is a
function of its logits there and nothing else. Speculative decoding keeps it by accepting a draft
token iff it is the target's token at its position (engine/verify.py, engine/tree_verify.py), so a
seeded row's text is plain decoding's whatever was drafted, in whatever batch. Drafters perturb their
own logits with the same noise, which makes their picks agree with the target's more often.

Only the row's CANDIDATES largest logits get a noise of their own. The rest of the row (the tail),
when it has any mass, competes as one: the largest of its Gumbel-perturbed log-probabilities is a
Gumbel variable located at the log of its mass, which gets its own hash counter (TAIL); only where
the tail wins is it searched token by token, with every token's own noise. That is the same law as
perturbing every token: which set holds the maximum and where in it are independent. After top-p
the tail is usually empty.

The hash: a 64-bit key from (seed, position) by splitmix64 on the host; per element the token id
mixed with each 32-bit half of the key by a xorshift-multiply round, in int64 tensors whose
products stay below 2**63. A 32-bit value h gives u = (h + 0.5) / 2**32 and g = -log(-log(u)),
in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling import SamplingParams, filtered_logits

CANDIDATES = 64  # tokens per row perturbed one by one; the rest compete as one (the module docstring)
TAIL = 0xFFFFFFFF  # the hash counter of the tail's maximum: no token id reaches it
_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of a row's noise at one position (a token's index in prompt + completion)."""
    return _splitmix64((seed & _M64) ^ _splitmix64(position & _M64))


def seed_of(gen: torch.Generator) -> int:
    """A sampling request's seed: its generator's (sampling.make_generator seeds it with the row's)."""
    return gen.initial_seed()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A xorshift-multiply round on int64 values in [0, 2**32); multipliers below 2**31, so no overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x31848BAB) & _M32
    return x ^ (x >> 16)


def noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise [M, K] float64 for token ids [M, K] (int64) under per-row keys [M] (int64 holding
    position_key's 64 bits): the same key and id give the same value in any tensor, batch or order."""
    lo = (keys & _M32)[:, None]  # [M, 1]
    hi = ((keys >> 32) & _M32)[:, None]
    h = _mix32(_mix32(ids ^ lo) ^ hi)  # [M, K] in [0, 2**32)
    u = (h.double() + 0.5) * 2.0 ** -32
    return -torch.log(-torch.log(u))


def key_tensor(keys: Sequence[int], device: torch.device) -> torch.Tensor:
    """position_key values -> [M] int64 (the same 64 bits, as a signed int64)."""
    return torch.tensor([k - (1 << 64) if k >= 1 << 63 else k for k in keys], dtype=torch.int64, device=device)


def gumbel_max(x: torch.Tensor, keys: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Per row of logits x [M, V] (-inf: a dropped token), its Gumbel-max token under keys [M]; [M] int64.

    vocab_ids [V] (optional): the token id of each column (a draft head over a subset of the
    vocabulary), which picks the noise and is returned. The module docstring says how.
    """
    M, V = x.shape
    k = min(CANDIDATES, V)
    top = torch.topk(x, min(k + 1, V), dim=-1)  # [M, k (+ 1)]
    v, cols = top.values[:, :k], top.indices[:, :k]
    bound = top.values[:, k] if k < V else torch.full((M,), float("-inf"), device=x.device)  # the tail's largest
    inside = v > bound[:, None]  # [M, k] the candidates (a tie with the tail's largest goes to the tail)
    ids = cols if vocab_ids is None else vocab_ids[cols]
    g = noise(keys, ids)  # [M, k]
    best = (v.double() + g).masked_fill(~inside, float("-inf")).argmax(-1, keepdim=True)  # [M, 1]
    out = ids.gather(1, best)[:, 0]
    tail = (bound > float("-inf")).nonzero()[:, 0]
    if tail.numel() == 0:
        return out
    # the tail against the best candidate, as log-probabilities
    p = x[tail].softmax(-1)  # [m, V]
    pc = p.gather(1, cols[tail]).double() * inside[tail]  # [m, k]
    mass = (1.0 - pc.sum(-1)).clamp_min(0.0)  # [m]
    cand = pc.gather(1, best[tail]).log()[:, 0] + g[tail].gather(1, best[tail])[:, 0]
    rest = mass.log() + noise(keys[tail], torch.full((tail.numel(), 1), TAIL, device=x.device))[:, 0]
    for r in tail[rest > cand].tolist():
        out[r] = _tail_max(x[r], bound[r], keys[r : r + 1], vocab_ids)
    return out


def _tail_max(x: torch.Tensor, bound: torch.Tensor, key: torch.Tensor, vocab_ids: torch.Tensor | None) -> int:
    """The Gumbel-max token of one row [V] among its tail: the tokens no larger than bound (finite ones)."""
    ids = torch.arange(x.shape[0], device=x.device) if vocab_ids is None else vocab_ids
    score = x.double() + noise(key, ids[None, :])[0]
    score = score.masked_fill((x > bound) | (x == float("-inf")), float("-inf"))
    return int(ids[score.argmax()])


def gumbel_tokens(
    logits: torch.Tensor,  # [M, V]
    sps: Sequence[SamplingParams],  # [M] each row's settings (none greedy)
    keys: Sequence[int],  # [M] each row's position_key
    vocab_ids: torch.Tensor | None = None,  # [V] token id per column, for a draft head over a subset
) -> list[int]:
    """Each row's Gumbel-max token under its own settings (rows that share settings go together)."""
    out = [0] * len(sps)
    groups: dict[SamplingParams, list[int]] = {}
    for i, sp in enumerate(sps):
        groups.setdefault(sp, []).append(i)
    for sp, rows in groups.items():
        x = logits if len(rows) == logits.shape[0] else logits[torch.tensor(rows, device=logits.device)]
        got = gumbel_max(filtered_logits(x, sp), key_tensor([keys[i] for i in rows], logits.device), vocab_ids)
        for i, t in zip(rows, got.tolist()):
            out[i] = t
    return out
