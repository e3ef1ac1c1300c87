"""Cascades and votes on the device step (engine/device_step.py), and the step's draft for any drafter it takes.

Every member drafts every row at the bucket's shape (a model member runs its chain, catch-up included, at every
step, as it would alone), and the composite picks per row on the device, with no host read:

- a cascade (drafters/cascade.py): row r takes the first member whose draft has at least min(min_tokens,
  gamma_r) tokens, else the last member's: torch.where over the members, last first. An n-gram member's count is
  its gated lookup's (the gate's caps per match length are taken from the n-gram drafter once, at construction,
  as DeviceLoop's own n-gram lookup does), so the cascade takes the same member and the same tokens as
  CascadeDrafter.propose with chains.
- a vote (drafters/vote.py): the members' drafts are paths in a token tree; at each depth the heaviest child
  (the sum of its members' weights; ties: the child of the earliest member) continues the voted path, as
  vote_path does (vote()). The weights are float64 on the device, per slot and pooled, and learn as
  VoteDrafter.on_commit does, from the committed tokens: for each row that drafted and is still live after the
  commit, a member whose path contradicts them is multiplied by beta, then the weights are renormalised (the same
  IEEE operations in the same order: the per-slot ones row by row, the pooled ones row after row in slot order,
  each sum taken member after member). A new request's weights are the pooled ones at its admission.

What differs from the host (docs/gpu.md): the host admits a request into a freed slot one step earlier than the
device step does (the device learns of a finish one step behind), so at several slots a request can start from
pooled weights that learnt from one more step; a slot that a stop string finishes teaches the pooled weights its
last step and the one after it (the host cuts stop strings, the device does not know them). Either changes which
drafts are verified, never the output.
"""

from __future__ import annotations

import torch

from ..drafters.cascade import CascadeDrafter
from ..drafters.model import FeatureDrafter
from ..drafters.ngram import NgramDrafter
from ..drafters.vote import VoteDrafter
from .device_draft import DraftChain, StepDraft, chain_problem
from .device_feature import FeatureChain


def draft_problem(drafter) -> str | None:
    """Why a drafter cannot draft on the device step, or None: n-gram, native model drafters (feature-reading ones
    included), and cascades and votes of them."""
    if isinstance(drafter, (CascadeDrafter, VoteDrafter)):
        for member in drafter.members.values():
            problem = draft_problem(member)
            if problem:
                return f"{drafter.kind} {drafter.name!r}: {problem}"
        return None
    return None if isinstance(drafter, NgramDrafter) else chain_problem(drafter)


def step_draft(drafter, target, cache, slots: int, max_len: int, width: int, min_prob: float,
               ngram_op) -> StepDraft:
    """The device step's draft for `drafter`: on `slots` slots of `max_len` positions, drafts up to `width` tokens a
    step (an n-gram lookup gated at min_prob with ngram_op, spin_kernels.ngram_draft or its reference); a model
    chain on `cache` where it drafts over the target's."""
    problem = draft_problem(drafter)
    if problem:
        raise ValueError(problem)

    def of(d) -> StepDraft:
        return step_draft(d, target, cache, slots, max_len, width, min_prob, ngram_op)

    if isinstance(drafter, CascadeDrafter):
        return CascadeDraft([of(m) for m in drafter.members.values()], drafter.min_tokens)
    if isinstance(drafter, VoteDrafter):
        return VoteDraft([of(m) for m in drafter.members.values()], drafter.beta, slots, target.device)
    if isinstance(drafter, NgramDrafter):
        return NgramDraft(drafter, width, min_prob, ngram_op, target.device)
    if isinstance(drafter, FeatureDrafter):
        return FeatureChain(drafter.model, target, slots, max_len, width)
    return DraftChain.of(drafter, cache, slots, max_len)


def ngram_keep(drafter: NgramDrafter, width: int, min_prob: float, device) -> torch.Tensor:
    """[max_ngram + 1] the gate's cap per match length, at the drafter's current rates (width: no cap)."""
    keep = [len(drafter.gated(n, [0] * width, min_prob)) if n in drafter.outcomes else width
            for n in range(drafter.max_ngram + 1)]
    return torch.tensor(keep, dtype=torch.long, device=device)


class NgramDraft(StepDraft):
    """An n-gram member: the lookup over the device history (spin_kernels.ngram_draft), gated by a fixed table."""

    def __init__(self, drafter: NgramDrafter, width: int, min_prob: float, op, device):
        self.op, self.min_ngram, self.max_ngram = op, drafter.min_ngram, drafter.max_ngram
        self.keep = ngram_keep(drafter, width, min_prob, device)

    def draft(self, rows, history, lengths, gamma, width):
        if width == 0:
            zero = torch.zeros(rows.shape[0], dtype=torch.long, device=history.device)
            return zero[:, None][:, :0], zero
        drafts, counts, _ = self.op(rows, history, lengths, gamma, self.keep, width, self.min_ngram, self.max_ngram)
        return drafts, counts


class _Composite(StepDraft):
    def __init__(self, members: list[StepDraft]):
        self.members = members
        self.reads_features = any(m.reads_features for m in members)

    def admit(self, slot, ids, budget, hidden=None):
        for m in self.members:
            m.admit(slot, ids, budget, hidden)

    def verified(self, rows, start, hidden, width):
        for m in self.members:
            m.verified(rows, start, hidden, width)

    def _drafts(self, rows, history, lengths, gamma, width) -> tuple[torch.Tensor, torch.Tensor]:
        """Every member's drafts [M, B, width] and counts [M, B]."""
        got = [m.draft(rows, history, lengths, gamma, width) for m in self.members]
        return torch.stack([d for d, _ in got]), torch.stack([c.long() for _, c in got])


class CascadeDraft(_Composite):
    """Per row, the first member with at least min(min_tokens, gamma) draft tokens, else the last member."""

    def __init__(self, members: list[StepDraft], min_tokens: int):
        super().__init__(members)
        self.min_tokens = min_tokens

    def draft(self, rows, history, lengths, gamma, width):
        drafts, counts = self._drafts(rows, history, lengths, gamma, width)
        enough = counts >= torch.clamp(gamma.long(), max=self.min_tokens)  # [M, B]
        out, n = drafts[-1], counts[-1]
        for k in range(len(self.members) - 2, -1, -1):  # the earliest member that has enough wins
            out = torch.where(enough[k][:, None], drafts[k], out)
            n = torch.where(enough[k], counts[k], n)
        return out, n


def vote(drafts: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vote_path on the device: drafts [M, B, G] and counts [M, B] (the members' paths), weights [B, M] float64 ->
    the voted paths [B, G] (0 past each one's length) and their lengths [B]."""
    M, B, G = drafts.shape
    dev = drafts.device
    member = torch.arange(M, device=dev)
    group = counts > 0  # [M, B]: the members still on the voted path
    zero = weights.new_zeros(())
    picks, n = [], torch.zeros(B, dtype=torch.long, device=dev)
    for j in range(G):
        alive = group & (counts > j)  # [M, B]: the members that continue past depth j
        tok = drafts[:, :, j]  # [M, B]
        same = alive[:, None] & alive[None] & (tok[:, None] == tok[None])  # [M, M, B]: i and i2 share a child
        weight = weights.new_zeros(M, B)
        for i2 in range(M):  # member after member, as sum() adds them: the same float64 sums
            weight = weight + torch.where(same[:, i2], weights[:, i2], zero)
        first = torch.where(same, member[None, :, None], M).amin(1)  # [M, B]: the first member of i's child
        heaviest = torch.where(alive, weight, -1.0).amax(0)  # [B]
        pick = torch.where(alive & (weight == heaviest), first, M).amin(0)  # [B]: ties to the earliest member
        token = tok.gather(0, pick.clamp(max=M - 1)[None])[0]  # [B]
        going = alive.any(0)
        group = alive & (tok == token)
        picks.append(torch.where(going, token, 0))
        n = n + going.long()
    voted = torch.stack(picks, 1) if picks else drafts.new_zeros(B, 0)
    return voted, n


def renormalised(w: torch.Tensor) -> torch.Tensor:
    """w [..., M] float64 over its sum, the sum taken member after member (as sum() over a list)."""
    total = w[..., 0]
    for i in range(1, w.shape[-1]):
        total = total + w[..., i]
    return w / total[..., None]


class VoteDraft(_Composite):
    """The members' weighted-majority vote per position, and its weights' updates; see the module docstring."""

    def __init__(self, members: list[StepDraft], beta: float, slots: int, device):
        super().__init__(members)
        self.beta = torch.tensor(beta, dtype=torch.float64, device=device)
        self.pooled = torch.full((len(members),), 1.0 / len(members), dtype=torch.float64, device=device)  # [M]
        self.weights = self.pooled.repeat(slots, 1)  # [slots, M]
        self.paths: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's member drafts, for committed()

    def admit(self, slot, ids, budget, hidden=None):
        super().admit(slot, ids, budget, hidden)
        self.weights[slot] = self.pooled

    def draft(self, rows, history, lengths, gamma, width):
        drafts, counts = self._drafts(rows, history, lengths, gamma, width)
        counts = torch.minimum(counts, gamma.long()[None])
        self.paths = (drafts, counts)
        return vote(drafts, counts, self.weights[rows])

    def committed(self, rows, before, gamma, lengths, live, history):
        drafts, counts = self.paths
        M, B, G = drafts.shape
        j = torch.arange(G, device=rows.device)
        new = history[rows[:, None], (before[:, None] + j).clamp(max=history.shape[1] - 1)]  # [B, G]
        kept = lengths[rows] - before  # [B] tokens this step committed
        upto = torch.minimum(counts, kept[None])  # [M, B]: the prefix agrees() compares
        differ = ((drafts != new[None]) & (j < upto[..., None])).any(-1)  # [M, B]
        factor = torch.where((counts > 0) & differ, self.beta, 1.0)  # [M, B] float64
        learn = (live[rows] != 0) & (gamma > 0)  # [B]: the rows the host's on_commit reaches with a proposal
        mine = self.weights[rows]  # [B, M]
        self.weights[rows] = torch.where(learn[:, None], renormalised(mine * factor.T), mine)
        pooled = self.pooled
        for b in range(B):  # row after row, in slot order, as the host commits its slots
            pooled = torch.where(learn[b], renormalised(pooled * factor[:, b]), pooled)
        self.pooled.copy_(pooled)
