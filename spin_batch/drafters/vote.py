"""Collective drafting (after Smurfs, SC 2025): a weighted majority vote over member drafters.

Each member's proposal is a path in a token tree rooted at the slot's last committed token.
A node's weight is the sum of the weights of the members whose path passes through it. The
voted path descends from the root to the heaviest child at every level (ties go to the child
of the earliest member in the configured order) until no member continues. For a chain request only that one
path is verified, so verification costs what one drafter's would.

Weights follow the weighted-majority rule: after each verification, a member whose proposal
contradicts the verified tokens has its weight multiplied by beta, then the weights are
renormalised. Weights are kept per request (slot) and start from pooled weights, which get
the same updates from every request.

The vote is a deterministic proposal (q one-hot), which stays lossless under sampling. It
runs no model passes beyond its members'.

Token trees (DraftRequest.nodes > 1): instead of the voted path alone, the whole members' tree is
verified (union_tree), heaviest child first at every level so the voted path is nodes 0.., capped at
`nodes` nodes: the voted path is kept, then the heaviest other nodes, so the lightest branches go
first. Its siblings are distinct tokens chosen by rule, so q stays one-hot (exact). Each member
votes for one path, so members are asked for chains (nodes 0): a chain is the member's full draft,
where a tree of the same budget would cut its first path; a member that answers with a tree anyway
votes for its first root-to-leaf path. The weights learn as with chains, from each member's path.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .base import Drafter, DraftRequest, Proposal, common_prefix
from .trie import Trie, first_path, is_chain


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


def union_tree(paths: list[list[int]], weights: list[float], nodes: int) -> tuple[list[int], list[int]]:
    """The members' paths merged into one token tree of at most `nodes` nodes, as (tokens, parents).

    A node weighs the sum of the weights of the members whose path passes through it. Nodes are in
    preorder, heaviest child first (ties: the child of the earliest member, as in vote_path), so
    nodes 0.. are the voted path. Over budget, the voted path is kept first, then the heaviest other
    nodes (ties: preorder); a node weighs no more than its parent and comes after it in preorder, so
    the kept nodes form a tree.
    """
    trie = Trie(sum(len(p) for p in paths))
    placed = [trie.insert(path) for path in paths]  # node ids follow the member order
    weight = [0.0] * trie.size
    for along, w in zip(placed, weights):
        for node in along:
            weight[node] += w
    kids: list[list[int]] = [[] for _ in range(trie.size + 1)]  # row 0: the root, 1 + i: node i
    for i, a in enumerate(trie.parents):
        kids[a + 1].append(i)
    order, stack = [], [-1]  # preorder, heaviest child first; a tie goes to the lower id
    while stack:
        node = stack.pop()
        order.extend([node] if node >= 0 else [])
        stack.extend(sorted(kids[node + 1], key=lambda c: (weight[c], -c)))
    voted = set()
    for k, node in enumerate(order):  # the voted path: each node the first child of the one before
        if trie.parents[node] != (order[k - 1] if k else -1):
            break
        voted.add(node)
    rank = {node: k for k, node in enumerate(order)}
    keep = set(sorted(order, key=lambda c: (c not in voted, -weight[c], rank[c]))[:nodes])
    kept = [n for n in order if n in keep]
    index = {node: k for k, node in enumerate(kept)}
    return [trie.tokens[n] for n in kept], [index.get(trie.parents[n], -1) for n in kept]


def member_path(prop: Proposal, j: int) -> list[int]:
    """A member's path for request j: its chain, or its tree's first root-to-leaf path."""
    shape = prop.tree(j)
    return prop.tokens[j] if shape is None else first_path(prop.tokens[j], shape)


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
    trees = True  # the members' union tree, whatever the members can do

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
        asked = [replace(r, nodes=0) if r.nodes > 1 else r for r in reqs]  # a member votes for one path
        props = [m.propose(asked) for m in self.members.values()]
        drafts, shapes = [], []
        for j, r in enumerate(reqs):
            paths = [member_path(p, j)[: r.gamma] for p in props]
            w = self.weights[r.slot]
            voted, _ = vote_path(paths, w)
            best = max(range(len(w)), key=lambda i: (w[i], -i))
            self.pending[r.slot] = _Pending(len(r.tokens), paths, voted, best)
            draft, shape = voted, None
            if r.nodes > 1:
                draft, parents = union_tree(paths, w, r.nodes)
                shape = None if is_chain(parents) else parents
            drafts.append(draft)
            shapes.append(shape)
        trees = any(s is not None for s in shapes)
        return Proposal(drafts, [None] * len(reqs), shapes if trees else None)

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
