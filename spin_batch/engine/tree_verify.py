"""Acceptance on token trees: which path of a slot's draft tree stands, greedy or sampled, lossless.

The loop takes it for a batch in which some slot drafted a tree (BatchLoop.accept), every other
segment as a chain; a batch of chains keeps verify.py (and its Triton kernel). A chain is the tree
whose every node has one child, and on it this module gives verify.rejection_sample's verdicts,
randoms included.

Terms as in verify.py: the accepted nodes form a path from the root; the step yields
len(path) + 1 new tokens, the path's tokens and then the recovered token (every child of the last
accepted node rejected) or the bonus token (the last accepted node is a leaf).

One slot's tree is ragged (DraftTree): flat node tokens [T] with parents [T] (-1: a child of the
root, which is the last committed token), every parent before its children. Target rows [T + 1, V]:
row 0 is the root's next-token distribution, row 1 + i node i's.

Sampling is recursive rejection sampling over siblings (SpecInfer's multi-step speculative
sampling; with the draft updated after each rejection as in Recursive Speculative Decoding):

    at a node with target distribution p and children c_1..c_k (tried in index order):
        r <- p
        for j in 1..k: accept c_j (token x_j, draft distribution q_j) with probability
                       min(1, r(x_j) / q_j(x_j)), and descend to c_j;
                       on rejection r <- norm(max(r - q_j, 0))
        every child rejected: the next token is a draw from r.

Why it is exact. Let q_j be the distribution x_j was drawn from given everything drawn before it
(earlier siblings, their rejections, the path above). Claim: given the history up to child j, the
token the loop emits from child j on follows r_j. For j = k + 1 it is a draw from r_{k+1}. For j <= k:
x_j ~ q_j; it is emitted with probability q_j(x) min(1, r_j(x)/q_j(x)) = min(q_j(x), r_j(x)); with
the remaining probability beta = 1 - sum_x min(q_j(x), r_j(x)) = sum_x max(r_j(x) - q_j(x), 0) the loop
goes on, and by the claim for j + 1 emits r_{j+1} = max(r_j - q_j, 0) / beta, which depends on r_j
and q_j only, not on x_j. Sum: min(q_j, r_j) + max(r_j - q_j, 0) = r_j. So the node emits p. An
accepted child then repeats the argument one row down with the child's own p, which gives the
joint law of the path and the next token as the target's, position after position.

The Gumbel sampler (gumbel.py) needs none of this: every row has one target token, its Gumbel-max
token under the noise of the row's position (the root's position plus the node's depth: siblings
share it), and the walk is the greedy one on those tokens. A node is accepted iff its token is its
parent row's target token; q plays no part.

What q_j must be, per kind of sibling (rejection sampling):
- drawn i.i.d. from one q (SpecInfer's case): q_j = q for every j;
- deterministic (n-gram continuations, the draft's top-k taken greedily, any token not sampled):
  q_j = None, which stands for one-hot at x_j; the test accepts with probability r(x_j) and the
  residual is r without x_j. Distinct deterministic siblings are therefore exact. Passing the
  drafter's own q for tokens it did not sample (top-k by rank) would NOT be exact;
- drawn from q without replacement (Gumbel-top-k, Sequoia, RSD): q_j = q with x_1..x_{j-1} removed
  and renormalised (without_replacement_probs).
Mixed siblings compose, as long as each q_j is that sibling's law given the ones before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..models.cpu_decoder import argmax
from ..models.segments import tree_depths
from ..sampling import SamplingParams, inverse_cdf, probs_per_row
from .verify import Uniforms, gumbel_walk, recovered_probs, uses_gumbel


@dataclass(frozen=True)
class DraftTree:
    """One slot's draft tree: node i has token tokens[i] and parent parents[i] (-1: the root)."""

    tokens: list[int]  # [T]
    parents: list[int]  # [T], parents[i] < i
    probs: list[torch.Tensor | None] | None = None  # [T] each [V] q of node i given its earlier siblings;
    # None (the list or an entry): deterministic, q one-hot at the node's token

    def __post_init__(self):
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"draft tree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, a in enumerate(self.parents):
            if not -1 <= a < i:
                raise ValueError(f"draft tree: node {i} has parent {a}; a parent must be -1 or an earlier node")
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError(f"draft tree: {len(self.tokens)} tokens but {len(self.probs)} draft distributions")

    @classmethod
    def chain(cls, tokens: list[int], q: torch.Tensor | None = None) -> DraftTree:
        """A chain draft (verify.py's segment) as a tree; q [gamma, V] or None."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), None if q is None else list(q))

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        """[T + 1] per row (0: the root, 1 + i: node i), the node indices of its children in order."""
        out: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, a in enumerate(self.parents):
            out[a + 1].append(i)
        return out

    def segment_parents(self) -> list[int]:
        """[T + 1] the tree as the verify segment that carries it (Segments' `parents`): token 0 is the
        root (the last committed token), token 1 + i is node i."""
        return [-1] + [a + 1 for a in self.parents]

    def depths(self) -> list[int]:
        """[T] each node's depth (1: a child of the root), its position past the root."""
        return tree_depths(self.segment_parents())[1:]

    def q(self, node: int) -> torch.Tensor | None:
        return None if self.probs is None else self.probs[node]


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root to leaf: the nodes whose K/V the cache keeps
    tokens: list[int]  # new tokens: the path's tokens, then the recovered / bonus token

    @property
    def accepted(self) -> int:
        return len(self.path)

    def segment_path(self) -> list[int]:
        """The accepted nodes as the verify segment's token indices (node i is token 1 + i), which
        KVCache.keep_path takes."""
        return [n + 1 for n in self.path]


def without_replacement_probs(q: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """Siblings drawn from q [V] without replacement, in order: each one's q given the earlier ones."""
    out, left = [], q.clone()
    for x in tokens:
        out.append(left / left.sum())
        left = left.clone()
        left[x] = 0.0
    return out


def _check_rows(rows: torch.Tensor, tree: DraftTree) -> None:
    if rows.shape[0] != tree.size + 1:
        raise ValueError(f"a tree of {tree.size} nodes needs {tree.size + 1} target rows, got {rows.shape[0]}")


def _verdict(tree: DraftTree, path: list[int], last: int) -> TreeVerdict:
    return TreeVerdict(path, [tree.tokens[n] for n in path] + [last])


def accept_tree_greedy(target_logits: torch.Tensor, tree: DraftTree) -> TreeVerdict:
    """From the root, follow the child whose token is the target's argmax (the first such sibling)
    while one exists; then the argmax at the last accepted row."""
    _check_rows(target_logits, tree)
    return greedy_walk(tree, argmax(target_logits).tolist())  # [T + 1]: the one host sync


def greedy_walk(tree: DraftTree, best: list[int]) -> TreeVerdict:
    """accept_tree_greedy on the target's argmax per row (best [T + 1]), already on the host."""
    kids, path, row = tree.children(), [], 0
    while (nxt := next((c for c in kids[row] if tree.tokens[c] == best[row]), None)) is not None:
        path.append(nxt)
        row = nxt + 1
    return _verdict(tree, path, best[row])


def tree_rejection_sample(p: torch.Tensor, tree: DraftTree, rand: Uniforms) -> TreeVerdict:
    """Recursive rejection sampling over siblings (the module docstring: rule and proof).

    p [T + 1, V] target probs. rand.accept(i) is node i's test, rand.draw() the last token's draw;
    on a chain the randoms are consumed as in verify.rejection_sample.
    """
    _check_rows(p, tree)
    kids, path, row = tree.children(), [], 0
    while True:
        r, nxt = p[row], None  # [V] the residual at this row
        for c in kids[row]:
            x, q = tree.tokens[c], tree.q(c)
            qx = 1.0 if q is None else float(q[x])
            if qx > 0 and rand.accept(c) < min(1.0, float(r[x]) / qx):
                nxt = c
                break
            r = recovered_probs(r, q, x)
        if nxt is None:
            return _verdict(tree, path, inverse_cdf(r, rand.draw()))
        path.append(nxt)
        row = nxt + 1


def tree_rows(trees: list[DraftTree]) -> list[int]:
    """First target row of each tree when the trees' rows lie end to end (T_i + 1 each)."""
    return [0, *accumulate(t.size + 1 for t in trees)][:-1]


def accept_trees(
    target_logits: torch.Tensor,  # [R, V] every tree's rows, end to end
    trees: list[DraftTree],  # [S]
    gens: list[torch.Generator | None],  # [S] each request's random stream (None: a greedy request)
    sps: list[SamplingParams],  # [S]
    starts: list[int] | None = None,  # [S] each root's next position (the Gumbel sampler's noise)
) -> list[TreeVerdict]:
    """Every slot's tree verdict (the torch rule; no kernel yet). All greedy: the argmax walk; the Gumbel
    sampler: the same walk on each row's target token; else rejection sampling, a greedy request's rows
    one-hot (which accepts and draws its argmax)."""
    rows = tree_rows(trees)
    if target_logits.shape[0] != sum(t.size + 1 for t in trees):
        raise ValueError(f"{len(trees)} trees need {sum(t.size + 1 for t in trees)} target rows, "
                         f"got {target_logits.shape[0]}")
    if uses_gumbel(sps):
        if starts is None:
            raise ValueError("the Gumbel sampler needs each tree's position")
        best = gumbel_row_tokens(target_logits, trees, gens, sps, starts)
        return [greedy_walk(t, best[a : a + t.size + 1]) for t, a in zip(trees, rows)]
    if all(sp.greedy for sp in sps):
        best = argmax(target_logits).tolist()  # [R]: the one host sync
        return [greedy_walk(t, best[a : a + t.size + 1]) for t, a in zip(trees, rows)]
    p = probs_per_row(target_logits, [sp for t, sp in zip(trees, sps) for _ in range(t.size + 1)])  # [R, V]
    rands = [Uniforms.zeros() if sp.greedy else Uniforms.from_generator(g) for g, sp in zip(gens, sps)]
    return [tree_rejection_sample(p[a : a + t.size + 1], t, u) for t, a, u in zip(trees, rows, rands)]


def gumbel_row_tokens(target_logits: torch.Tensor, trees: list[DraftTree], gens: list[torch.Generator | None],
                      sps: list[SamplingParams], starts: list[int]) -> list[int]:
    """[R] the target's token per row: the argmax for a greedy request; for a sampled one the Gumbel-max token
    at the row's position (the root's next position plus the node's depth), on the rows of the walk (the
    others keep their argmax, which the walk never reads)."""
    best = argmax(target_logits).tolist()  # [R]
    rows = tree_rows(trees)
    kids = [t.children() for t in trees]

    def follow(i: int, row: int, token: int) -> int | None:
        c = next((c for c in kids[i][row - rows[i]] if trees[i].tokens[c] == token), None)
        return None if c is None else rows[i] + 1 + c

    for row, t in gumbel_walk(target_logits, rows, gens, sps, starts, follow).items():
        best[row] = t
    return best
