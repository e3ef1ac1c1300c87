"""The logits controls that depend on a request's own tokens: min_tokens, logit_bias, the repetition,
frequency and presence penalties, and min_p.

They run on the target's logits before the verifier reads them, in vLLM's order: min_tokens masks
the stop token ids, logit_bias is added, then the penalties (repetition over prompt + generated
tokens, frequency and presence over generated tokens), and min_p last (it reads the distribution
after temperature, so it comes after them; it never moves the argmax). Temperature, top-k and
top-p follow in sampling.py. The verifier, greedy or sampled, chain or tree, then reads the
processed rows: greedy takes their argmax, rejection sampling their distribution as p.

A verify segment scores several positions at once, and the penalties depend on the tokens before
each one. Row r of a segment counts the request's generated tokens and the draft prefix before
that row (prefixes[r]: a chain's drafts[:r], a tree node's path from the root), so every row is
exactly the row plain decoding would see had the drafts before it been committed, and speculative
output equals plain output token for token. What each control means: docs/jobs.md; how exact:
docs/numerics.md.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitControls:
    """One request's controls; the defaults change nothing."""

    min_p: float = 0.0  # [0, 1]: drop tokens under min_p x the top token's probability (sampling only)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    repetition_penalty: float = 1.0  # > 0; tokens in prompt + generated: positive logits / it, others x it
    presence_penalty: float = 0.0  # subtracted once from each token generated at least once
    frequency_penalty: float = 0.0  # subtracted per time a token was generated

    @property
    def penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def active(self, temperature: float) -> bool:
        """Whether these controls change any row of a request sampled at ``temperature`` (0: greedy)."""
        return bool(self.logit_bias) or self.penalties or (self.min_p > 0.0 and temperature > 0.0)


NO_CONTROLS = LogitControls()


def chain_prefixes(drafts: Sequence[int]) -> list[list[int]]:
    """[gamma + 1] per row of a chain's segment, the drafts before it."""
    return [list(drafts[:j]) for j in range(len(drafts) + 1)]


def tree_prefixes(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """[T + 1] per row of a tree's segment (0: the root, 1 + i: node i), the path's tokens up to it."""
    out: list[list[int]] = [[]]
    for x, a in zip(tokens, parents):
        out.append(out[a + 1] + [x])
    return out


def apply_controls(
    logits: torch.Tensor,  # [n, V] float32, one segment's rows; changed in place
    controls: LogitControls,
    temperature: float,  # the request's (min_p applies only when sampling)
    prompt: Sequence[int],
    generated: Sequence[int],  # committed generated tokens
    prefixes: Sequence[Sequence[int]],  # [n] the draft tokens before each row
    min_tokens: int = 0,
    stop_ids: Collection[int] = (),  # masked at rows where fewer than min_tokens tokens precede
) -> None:
    """One segment's rows as the controls make them (the module docstring: order and meaning)."""
    n, vocab = logits.shape
    dev = logits.device
    if min_tokens and stop_ids:
        short = [r for r, p in enumerate(prefixes) if len(generated) + len(p) < min_tokens]
        ids = sorted(i for i in stop_ids if 0 <= i < vocab)
        if short and ids:
            logits[torch.tensor(short, device=dev)[:, None], torch.tensor(ids, device=dev)[None, :]] = -math.inf
    if controls.logit_bias:
        ids, bias = zip(*controls.logit_bias)
        logits[:, torch.tensor(ids, device=dev)] += torch.tensor(bias, dtype=logits.dtype, device=dev)
    if controls.penalties:
        counts = _counts(generated, prefixes, vocab, dev)  # [n, V]
        seen = counts > 0
        if controls.repetition_penalty != 1.0:
            hit = seen | _mask(prompt, vocab, dev)[None, :]
            rp = controls.repetition_penalty
            logits.copy_(torch.where(hit, torch.where(logits > 0, logits / rp, logits * rp), logits))
        if controls.frequency_penalty:
            logits -= controls.frequency_penalty * counts
        if controls.presence_penalty:
            logits -= controls.presence_penalty * seen.to(logits.dtype)
    if controls.min_p > 0.0 and temperature > 0.0:
        # p_i < min_p * p_max after temperature  <=>  logit_i < logit_max + temperature * log(min_p)
        top = logits.max(dim=-1, keepdim=True).values  # [n, 1]
        logits.masked_fill_(logits < top + temperature * math.log(controls.min_p), -math.inf)


def _mask(tokens: Sequence[int], vocab: int, dev: torch.device) -> torch.Tensor:
    """[V] bool: the tokens that occur."""
    out = torch.zeros(vocab, dtype=torch.bool, device=dev)
    if tokens:
        out[torch.tensor(list(tokens), dtype=torch.long, device=dev)] = True
    return out


def _counts(generated: Sequence[int], prefixes: Sequence[Sequence[int]], vocab: int,
            dev: torch.device) -> torch.Tensor:
    """[n, V] float32: per row, how often each token occurs in generated + that row's prefix."""
    base = torch.zeros(vocab, dtype=torch.float32, device=dev)
    if generated:
        base = torch.bincount(torch.tensor(list(generated), dtype=torch.long, device=dev), minlength=vocab).float()
    counts = base.repeat(len(prefixes), 1)
    rows = [r for r, p in enumerate(prefixes) for _ in p]
    if rows:
        cols = torch.tensor([x for p in prefixes for x in p], dtype=torch.long, device=dev)
        counts.index_put_((torch.tensor(rows, device=dev), cols), torch.ones(len(rows), device=dev), accumulate=True)
    return counts
