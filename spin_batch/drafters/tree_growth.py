"""Growing a draft token tree from the draft's own confidence (after EAGLE-2), best first.

A node's score is the product of the draft's probabilities along its path from the root: the
draft's own estimate of the chance that the target accepts the whole path, so the expected
number of accepted tokens of a tree is about the sum of its nodes' scores. Best-first growth
keeps the `budget` nodes of highest score, which maximises that sum for the budget, under two
limits: no node deeper than `depth_cap` (gamma), and none whose score falls below `floor` (the
price of verifying one more token, the chain gate's floor: a node must be worth its row).

Growth runs in rounds, one draft forward each: every node added in a round is expanded in the
next (its `top_k` likeliest children become candidates), and each round adds the up-to-`width`
best candidates so far, wherever they hang. The top-k of one distribution are distinct tokens,
so siblings are distinct. The tokens are picked by rank, not drawn, so the tree is a
deterministic proposal (q one-hot per node), which keeps sampling exact (engine/tree_verify.py).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

TREE_WIDTH = 4  # nodes added (and so expanded) per draft forward
TREE_TOP_K = 4  # children offered per expanded node


@dataclass
class TreeGrowth:
    """One request's tree while it grows: node i has token tokens[i] and parent parents[i] (-1: root)."""

    budget: int  # most nodes
    depth_cap: int  # deepest node (gamma)
    floor: float = 0.0  # least score a node may have
    width: int = TREE_WIDTH
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    _pool: list[tuple[float, int, int, int]] = field(default_factory=list)  # (-score, order, parent, token)
    _offered: int = 0  # candidates offered so far: ties go to the earlier one

    def offer(self, parent: int, children: list[tuple[int, float]]) -> None:
        """The expanded node's likeliest children as candidates: (token, draft probability) each."""
        base = 1.0 if parent < 0 else self.scores[parent]
        depth = 1 if parent < 0 else self.depths[parent] + 1
        if depth > self.depth_cap:
            return
        for token, p in children:
            score = base * p
            if score >= self.floor and score > 0:
                heapq.heappush(self._pool, (-score, self._offered, parent, token))
                self._offered += 1

    def grow(self) -> list[int]:
        """Add the best candidates (at most `width`, within the budget); returns the new nodes' indices."""
        new = []
        while self._pool and len(new) < self.width and len(self.tokens) < self.budget:
            neg, _, parent, token = heapq.heappop(self._pool)
            new.append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(-neg)
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return new

    def to_expand(self, new: list[int]) -> list[int]:
        """The new nodes whose children could still join the tree (budget left, not at the depth cap)."""
        if len(self.tokens) >= self.budget:
            return []
        return [n for n in new if self.depths[n] < self.depth_cap]

    def path(self, n: int) -> list[int]:
        """The tokens from the root to node n, n included (-1: the root, no token)."""
        out: list[int] = []
        while n >= 0:
            out.append(self.tokens[n])
            n = self.parents[n]
        return out[::-1]

    def segment_parents(self) -> list[int]:
        """The tree with its root as token 0 (Segments' `parents`): node i is token 1 + i."""
        return [-1] + [a + 1 for a in self.parents]
