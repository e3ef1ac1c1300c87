"""Collective drafting (after Smurfs, SC 2025): a weighted majority vote over member drafters.

Each member's proposal is a path in a token tree rooted at the slot's last committed token.
A node's weight is the sum of the weights of the members whose path passes through it. The
voted path descends from the root to the heaviest child at every level (ties go to the child
of the earliest member in the configured order) until no member continues. Only that one
path is verified, so verification costs what one drafter's would.

Weights follow the weighted-majority rule: after each verification, a member whose proposal
contradicts the verified tokens has its weight multiplied by beta, then the weights are
renormalised. Weights are kept per request (slot) and start from pooled weights, which get
the same updates from every request.

The vote is a deterministic proposal (q one-hot), which stays lossless under sampling. It
runs no model passes beyond its members'.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Drafter, DraftRequest, Proposal, common_prefix


def vote_path(paths: list[list[int]], weights: list[float]) -> tuple[list[int], list[int]]:
    """The heaviest path through the members' token tree, and the members that propose it whole."""
    group = [i for i, p in enumerate(paths) if p]
    chosen: list[int] = []
    depth = 0
    while True:
        children: dict[int, list[int]] = {}
        for i in group:
            if len(paths[i]) > depth:
                children.setdefault(paths[i][depth], []).append(i)
        if not children:
            return chosen, group
        # heaviest child; ties: the child whose first member comes earliest
        token, members = max(children.items(), key=lambda kv: (sum(weights[i] for i in kv[1]), -kv[1][0]))
        chosen.append(token)
        group = members
        depth += 1


def agrees(path: list[int], outcome: list[int]) -> bool | None:
    """Whether a proposal is consistent with the verified tokens (None: it proposed nothing)."""
    if not path:
        return None
    n = min(len(path), len(outcome))
    return path[:n] == outcome[:n]


@dataclass
class _Pending:
    base: int  # committed length when the proposal was made
    paths: list[list[int]]  # each member's proposal
    voted: list[int]
    best: int  # index of the member with the highest weight at proposal time


class VoteDrafter(Drafter):
    kind = "vote"

    def __init__(self, name: str, members: dict[str, Drafter], beta: float = 0.5, slots: int = 1):
        super().__init__(name)
        if len(members) < 2:
            raise ValueError(f"vote drafter {name!r} needs at least 2 members")
        self.members = members
        self.beta = beta
        self.pooled = [1.0 / len(members)] * len(members)
        self.weights: list[list[float]] = [list(self.pooled) for _ in range(slots)]
        self.pending: list[_Pending | None] = [None] * slots
        self.counters = {"proposals": 0, "overrode_best_member": 0, "override_gain_tokens": 0}

    def on_admit(self, slot: int) -> None:
        self.weights[slot] = list(self.pooled)
        self.pending[slot] = None

    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        props = [m.propose(reqs) for m in self.members.values()]
        drafts = []
        for j, r in enumerate(reqs):
            paths = [p.tokens[j][: r.gamma] for p in props]
            w = self.weights[r.slot]
            voted, _ = vote_path(paths, w)
            best = max(range(len(w)), key=lambda i: (w[i], -i))
            self.pending[r.slot] = _Pending(len(r.tokens), paths, voted, best)
            drafts.append(voted)
        return Proposal(drafts, [None] * len(reqs))

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        # members are configured drafters too: the loop commits them itself
        pend = self.pending[slot]
        if pend is None:
            return
        self.pending[slot] = None
        outcome = tokens[pend.base:]  # accepted drafts + recovered/bonus token (may be cut by a stop)
        self.counters["proposals"] += 1
        if pend.voted != pend.paths[pend.best]:
            self.counters["overrode_best_member"] += 1
            self.counters["override_gain_tokens"] += (common_prefix(pend.voted, outcome)
                                                      - common_prefix(pend.paths[pend.best], outcome))
        for w in (self.weights[slot], self.pooled):
            for i, path in enumerate(pend.paths):
                if agrees(path, outcome) is False:
                    w[i] *= self.beta
            total = sum(w)
            w[:] = [x / total for x in w]

    def stats(self) -> dict[str, float]:
        return {**self.counters, **{f"pooled_weight.{n}": w for n, w in zip(self.members, self.pooled)}}
