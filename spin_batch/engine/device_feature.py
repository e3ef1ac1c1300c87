"""A feature-reading draft's chain on the device step (engine/device_step.py): the distilled drafts that read the
target's last hidden state (drafters/model.py FeatureDrafter, models/distilled.py), greedy, at fixed shapes, no
host read.

The draft's cache holds one entry per position p: the pair (token p + 1, the target's feature at p), the feature
being the target's final residual at p, RMS-normalised without a weight (distilled.normalize). A position's
feature is the target's own once token p + 1 is committed: the verify row at p fed a committed token.

The target's features live in a ring per slot, R = 2 W + 2 positions (W the widest draft of a step; position p
at p mod R): the admission writes the prompt's last R, and every verify forward writes all of its rows (rejected
ones too, which later verifies overwrite, as TargetFeatures.write does on the host). A step reads positions at
most W + 1 below its committed length n, and the writes since position p was committed reach at most 2 W
positions past it, so a read never finds a newer position in its ring entry.

A step's chain, per row:
- the catch-up: W + 1 rows at positions s .. s + W, s = max(n - 2 - W, 0), each fed its pair (history[p + 1],
  ring[p]). The rows up to n - 2 are the pairs the draft has not seen with the target's features (a step
  commits at most W + 1 tokens, so n - 2 - W is at or below the first of them) and some it has, recomputed to the
  same K/V; rows past n - 2 (a short context) write K/V that the chain and later catch-ups overwrite before any
  row at or past them reads it. The draft's first token and predicted feature come from the row at n - 2;
- then G - 1 one-row steps at positions n - 1, ..., each fed the previous draft token and the feature the draft
  predicted with it, as FeatureDrafter's chain feeds them.
The catch-up runs at every step, at width 0 too, so the invariant (the pairs below s are the target's) holds at
every step. The picks are the feature head's argmax mapped through the draft's vocab_ids, so the drafts are
FeatureDrafter's greedy chain's (no confidence gate, no grammar).
"""

from __future__ import annotations

import torch

from ..models.buckets import PaddedSegments, padded_hidden
from ..models.cpu_decoder import argmax
from ..models.distilled import normalize
from ..models.llama import LlamaModel
from ..models.segments import Segments
from .device_draft import StepDraft


class FeatureChain(StepDraft):
    """A feature-reading draft's greedy chains, batched over a bucket's rows; see the module docstring."""

    reads_features = True

    def __init__(self, model: LlamaModel, target: LlamaModel, slots: int, max_len: int, width: int):
        if model.feature_head is None:
            raise ValueError("the draft does not read target features")
        self.model, self.head, self.vocab_ids = model, model.feature_head, model.vocab_ids
        self.cache = model.allocate_cache(slots, max_len)
        self.width = width  # W: the widest draft of a step
        self.ring = 2 * width + 2  # R
        self.eps = target.spec.rms_norm_eps
        # [slots, R, E]: the target's features per slot, in the target's dtype (as TargetFeatures keeps them)
        self.g = torch.zeros(slots, self.ring, target.spec.hidden_size, dtype=target.dtype, device=target.device)

    def admit(self, slot: int, ids: list[int], budget: int, hidden: torch.Tensor | None = None) -> None:
        """The prompt's features into the ring, and the draft's pairs for positions below len(ids) - 1 into its
        cache (outside the step; nothing read back)."""
        n, dev, budget = len(ids), self.model.device, max(budget, 1)
        g = normalize(hidden, self.eps).to(self.g.dtype)  # [n, E]
        last = max(n - self.ring, 0)  # the positions the ring keeps: no two of them share an entry
        self.g[slot, torch.arange(last, n, device=dev) % self.ring] = g[last:]
        for a in range(0, n - 1, budget):
            b = min(a + budget, n - 1)
            seg = Segments.build([(slot, b - a, a)], dev)
            self.model.hidden(torch.as_tensor(ids[a + 1 : b + 1], device=dev), seg, self.cache,
                              extra=g[a:b].to(self.model.dtype))

    def verified(self, rows: torch.Tensor, start: torch.Tensor, hidden: torch.Tensor, width: int) -> None:
        B = rows.shape[0]
        pos = start[:, None] + torch.arange(width + 1, device=rows.device)  # [B, G + 1]
        self.g[rows[:, None], pos % self.ring] = normalize(hidden, self.eps).to(self.g.dtype).view(B, width + 1, -1)

    def draft(self, rows: torch.Tensor, history: torch.Tensor, lengths: torch.Tensor, gamma: torch.Tensor,
              width: int) -> tuple[torch.Tensor, torch.Tensor]:
        B, W, dev = rows.shape[0], self.width, history.device
        n = lengths[rows].long()  # [B]
        start = (n - 2 - W).clamp(min=0)
        pos = start[:, None] + torch.arange(W + 1, device=dev)  # [B, W + 1]
        tokens = history[rows[:, None], pos + 1].reshape(-1)  # [B (W + 1)]
        extra = self.g[rows[:, None], pos % self.ring].reshape(B * (W + 1), -1).to(self.model.dtype)
        h = padded_hidden(self.model, tokens, PaddedSegments(rows, start, W), self.cache, extra=extra)
        counts = gamma.long().clamp(0, width)
        if width == 0:  # the catch-up alone
            return torch.zeros(B, 0, dtype=torch.long, device=dev), counts
        at = (n - 2 - start).clamp(min=0)  # [B]: the row of position n - 2
        tok, g = self._pick(h.view(B, W + 1, -1)[torch.arange(B, device=dev), at])
        picks = [tok]
        for j in range(1, width):
            seg = PaddedSegments(rows, n + (j - 2), 0)  # position n - 1 + (j - 1)
            tok, g = self._pick(padded_hidden(self.model, tok, seg, self.cache, extra=g))
            picks.append(tok)
        drafts = torch.stack(picks, 1)  # [B, width]
        j = torch.arange(width, device=dev)
        return torch.where(j < counts[:, None], drafts, 0), counts

    def _pick(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, C] residual -> ([B] target ids: the feature head's argmax, [B, E] the predicted features)."""
        logits, g = self.head(self.model.normed(h, self.model.norm))
        best = argmax(logits)
        return (best if self.vocab_ids is None else self.vocab_ids[best]), g
