"""A model drafter's chain on the device step (engine/device_step.py): gamma draft tokens per row at fixed
shapes, its cache rolled back by length arithmetic, no host read.

Two kinds of draft model, as drafters/model.py and drafters/early_exit.py:

- its own KV cache (a separate checkpoint: ModelDrafter). The chain feeds, per row, the last two committed
  tokens (positions n - 2 and n - 1, n the slot's committed length on the device), then G - 1 one-row steps,
  each feeding the previous draft token. The invariant: at the start of every step the draft's cache holds
  the draft's own K/V for every position below n - 2. It holds at admission (the prompt's positions are
  prefilled, n = prompt + 1), and a step keeps it: the catch-up makes positions below n right, the chain
  writes its drafts at n .. n + G - 2, and the commit keeps k <= G of them, so n' = n + k + 1 and the
  right rows reach n + min(k, G - 1) >= n' - 2. So no draft length is stored, nothing is read back and
  nothing is copied to roll back: the rows past n' - 2 are overwritten by the next catch-up. A bucket of
  width 0 still runs the catch-up (two rows a slot), so the invariant survives steps that draft nothing.
- the target's own cache (the early-exit drafter, the target's first layers or its int8 copy). The target's
  cache holds every committed token but the last, so the chain starts with one row (position n - 1), then
  G - 1 one-row steps; the verify forward that follows overwrites all the rows it wrote.

Each draft token is the argmax of the draft's logits (mapped through vocab_ids for a draft whose head covers
a subset of the target's ids), so the drafts are ModelDrafter's greedy chain's. No confidence gate and no
lookahead guesses: every live row drafts its gamma (the room left caps it, on the device).
"""

from __future__ import annotations

import torch

from ..drafters.early_exit import EarlyExitDrafter
from ..drafters.model import FeatureDrafter, ModelDrafter
from ..models.buckets import PaddedSegments, padded_hidden, padded_problem
from ..models.cache import KVCache
from ..models.cpu_decoder import argmax
from ..models.llama import LlamaModel
from ..models.segments import Segments


def chain_problem(drafter) -> str | None:
    """Why a model drafter cannot draft on the device step, or None: a Llama-family model draft (token-only, or one
    that reads the target's features: engine/device_feature.py) whose model runs a bucket's forward from device
    tensors (models/buckets.py)."""
    if not isinstance(drafter, ModelDrafter) or not isinstance(drafter.model, LlamaModel):
        return (f"drafter {drafter.name!r}: the device step drafts with n-gram or native model drafters, or cascades "
                "and votes of them, only")
    problem = padded_problem(drafter.model)
    return None if problem is None else f"drafter {drafter.name!r}: {problem}"


class StepDraft:
    """What the device step asks of a drafter: drafts at a bucket's shape, and hooks around the step (each a no-op
    here). Every method runs on the device with no host read, except admit (outside the step)."""

    reads_features = False  # whether admit wants the target's prefill residuals

    def admit(self, slot: int, ids: list[int], budget: int, hidden: torch.Tensor | None = None) -> None:
        """A new request in `slot` (prompt `ids`); hidden [len(ids), C]: the target's prefill residuals where
        reads_features."""

    def draft(self, rows: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, gamma: torch.Tensor,
              width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B, width] long, counts [B]) for the rows' slots, each at most its gamma."""
        raise NotImplementedError

    def verified(self, rows: torch.Tensor, start: torch.Tensor, hidden: torch.Tensor, width: int) -> None:
        """After the verify forward: hidden [B (width + 1), C], the residual of row r's tokens at positions
        start[r] ..."""

    def committed(self, rows: torch.Tensor, before: torch.Tensor, gamma: torch.Tensor, lengths: torch.Tensor,
                  live: torch.Tensor, history: torch.Tensor) -> None:
        """After the commit: before [B], the rows' committed lengths before it; gamma [B], what they drafted up to;
        lengths, live and history the step state after it."""


class DraftChain(StepDraft):
    """A draft model's greedy chains, batched over a bucket's rows; see the module docstring."""

    def __init__(self, model: LlamaModel, cache: KVCache, num_layers: int | None, own_cache: bool,
                 catch_up: int = 2):
        self.model, self.cache, self.own_cache = model, cache, own_cache
        self.layers = num_layers or len(model.layers)
        self.vocab_ids = model.vocab_ids
        # rows fed per slot before the one-row steps: own cache, 2, or more where the slot may have committed
        # more than one token since this chain last fed it (another drafter's step: engine/device_mix.py)
        self.catch_up = catch_up if own_cache else 1

    @classmethod
    def of(cls, drafter: ModelDrafter, target_cache: KVCache, slots: int, max_len: int,
           catch_up: int = 2) -> "DraftChain":
        """The chain of a ModelDrafter (a cache of its own, `slots` x `max_len`, fed `catch_up` rows a slot) or an
        EarlyExitDrafter (the target's cache, shared)."""
        problem = chain_problem(drafter)
        if problem:
            raise ValueError(problem)
        if isinstance(drafter, FeatureDrafter):
            raise ValueError(f"drafter {drafter.name!r} reads the target's features: its chain is a FeatureChain")
        if isinstance(drafter, EarlyExitDrafter):
            return cls(drafter.model, target_cache, drafter.num_layers, own_cache=False)
        return cls(drafter.model, drafter.model.allocate_cache(slots, max_len, drafter.num_layers),
                   drafter.num_layers, own_cache=True, catch_up=catch_up)

    def admit(self, slot: int, ids: list[int], budget: int, hidden: torch.Tensor | None = None) -> None:
        """Prefill a new request's prompt into the draft's own cache (outside the step; nothing read back).
        Nothing to do on the target's cache: the target's prefill wrote it."""
        if not self.own_cache:
            return
        dev, n = self.model.device, len(ids)
        for a in range(0, n, max(budget, 1)):
            b = min(a + max(budget, 1), n)
            seg = Segments.build([(slot, b - a, a)], dev)
            self.model.hidden(torch.as_tensor(ids[a:b], device=dev), seg, self.cache, self.layers)

    def draft(self, rows: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, gamma: torch.Tensor,
              width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [B, width] long, 0 past each row's count; counts [B] = gamma) for the rows' slots: the draft
        chains at fixed shapes (width 0: the catch-up alone, where the draft has a cache of its own)."""
        B, dev = rows.shape[0], history.device
        counts = gamma.long().clamp(0, width)
        if width == 0:
            if self.own_cache:
                self._feed(rows, history, lengths)
            return torch.zeros(B, 0, dtype=torch.long, device=dev), counts
        tok = self._feed(rows, history, lengths)  # [B]: each row's first draft token
        picks = [tok]
        n = lengths[rows].long()
        for j in range(1, width):
            seg = PaddedSegments(rows, n + (j - 1), 0)
            tok = self._pick(padded_hidden(self.model, tok, seg, self.cache, self.layers))
            picks.append(tok)
        drafts = torch.stack(picks, 1)  # [B, width]
        j = torch.arange(width, device=dev)
        return torch.where(j < counts[:, None], drafts, 0), counts

    def feed(self, rows: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor) -> None:
        """The catch-up alone, for a draft with a cache of its own (a slot that drafts with another drafter, or with
        none, this step: its cache keeps the invariant); nothing to do on the target's cache."""
        if self.own_cache:
            self._feed(rows, history, lengths)

    def _feed(self, rows: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The catch-up forward: each row's last catch_up committed tokens (from position 0 where it has fewer:
        the rows past its last token are overwritten later); the first draft token [B]."""
        c, n = self.catch_up, lengths[rows].long()
        start = (n - c).clamp(min=0)  # [B]
        pos = start[:, None] + torch.arange(c, device=history.device)  # [B, c]
        tokens = history[rows[:, None], pos].reshape(-1)  # [B c]
        h = padded_hidden(self.model, tokens, PaddedSegments(rows, start, c - 1), self.cache, self.layers)
        last = (n - 1 - start).clamp(min=0)  # [B]: the row of each slot's last committed token
        return self._pick(h.view(rows.shape[0], c, -1)[torch.arange(rows.shape[0], device=h.device), last])

    def _pick(self, h: torch.Tensor) -> torch.Tensor:
        """[B, C] residual -> [B] target ids: the draft's argmax."""
        best = argmax(self.model.logits(h))
        return best if self.vocab_ids is None else self.vocab_ids[best]
