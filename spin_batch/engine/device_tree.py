"""Token trees on the device step (engine/device_step.py): the n-gram drafter's tree, verified and kept at fixed
shapes, no host read.

A tree step replaces the chain step's draft, verify and accept for a bucket of token trees (models/buckets.py,
Bucket.tree): B rows of T + 1 tokens, T the node bucket of the drafting's tree budget (DeviceDrafting.nodes),
whatever the trees are. On the device:

1. each live row's tree: the n-gram drafter's trie of continuations over the row's history
   (spin_kernels.ngram_tree, NgramDrafter._tree's rule), no deeper than the row's gamma (capped by the room
   left, as a chain), with the gate's caps per match length; padded to T nodes;
2. its layout (spin_kernels.tree_layout: each token's ancestor bitmask and depth), then the verify forward of
   the roots and nodes with the tree attention mask (PaddedTreeSegments), the LM head and a batched argmax;
3. the greedy walk (spin_kernels.tree_walk: the longest root path whose every node is the target's argmax at
   its parent, engine/tree_verify.greedy_walk's rule), given as a chain: its tokens, the target's tokens along
   it and the bonus token;
4. keep_path (spin_kernels.keep_path): the accepted nodes' K/V rows move to the rows right after the root, in
   every layer of the target's cache, so the slot continues as after a chain;
5. the chain's accept and commit (spin_kernels.accept_commit) on the walk's chain: it accepts exactly the
   path, and cuts, counts (the tree's nodes as the drafted tokens, as BatchLoop counts them) and records as
   for a chain.

Where the target runs on the Triton kernels, 3 and 4 are the Triton kernels, else their torch references; 1
and 2 are torch at fixed shapes on every path. A step in which no row asks for a draft runs as the chain step
of width 0 (the root alone is the same step).
"""

from __future__ import annotations

import torch

from ..drafters.ngram import NgramDrafter
from ..models.buckets import TREE_BUCKETS, Bucket, PaddedTreeSegments, padded_hidden, round_up, tree_ops
from ..models.cpu_decoder import argmax


def tree_problem(drafting, drafter) -> str | None:
    """Why the device step cannot draft trees with this drafter, or None (n-gram trees only, so far)."""
    if drafter is not None and not isinstance(drafter, NgramDrafter):
        return f"token trees on the device step are the n-gram drafter's only, not {drafter.name!r}'s"
    if drafting.nodes > TREE_BUCKETS[-1]:
        return f"a tree takes at most {TREE_BUCKETS[-1]} nodes on the device step, got {drafting.nodes}"
    return None


class TreeStep:
    """The tree step of a DeviceLoop whose drafting grows trees; see the module docstring."""

    def __init__(self, target, nodes: int, min_ngram: int, max_ngram: int):
        self.nodes = round_up(nodes, TREE_BUCKETS, "tree nodes")  # T: every tree bucket's node count
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.draft, self.layout, self.walk, self.keep_path = tree_ops(target)

    @classmethod
    def of(cls, target, drafting, drafter) -> "TreeStep | None":
        """The tree step of this drafting (None: it drafts chains, nodes <= 1 or gamma 0); ValueError if the device
        step cannot draft its trees."""
        if drafting.nodes <= 1 or not drafting.gamma:
            return None
        problem = tree_problem(drafting, drafter)
        if problem:
            raise ValueError(problem)
        return cls(target, drafting.nodes, drafting.min_ngram, drafting.max_ngram)

    def bucket(self, chain: Bucket) -> Bucket:
        """The step's bucket: a tree bucket of the same rows where the chain bucket drafts, else the chain's."""
        return chain if chain.width == 0 else Bucket(chain.rows, self.nodes, tree=True)

    def step(self, loop, bucket: Bucket) -> None:
        """One tree step of `loop` (a DeviceLoop) on the device, at the tree bucket's shape."""
        B, T, D = bucket.rows, bucket.width, loop.width
        rows, asked = loop.inputs[0, :B], loop.inputs[1, :B]
        n = loop.lengths[rows]  # [B] committed tokens
        room = torch.minimum(loop.max_len[rows] - n, loop.max_tokens[rows] - (n - loop.prompt_lens[rows]) - 1)
        gamma = torch.where(loop.live[rows] != 0, torch.minimum(asked, room.clamp(min=0)), 0)
        tokens, parents, counts = self.draft(rows, loop.history, loop.lengths, gamma, loop.keep, T, D,
                                             self.min_ngram, self.max_ngram)  # [B, T], [B, T], [B]
        bits, depth = self.layout(parents)  # [B, T + 1] each
        root = (n - 1).clamp(min=0)  # [B] the root's cache row
        last = loop.history[rows, root][:, None]  # [B, 1]
        seg = PaddedTreeSegments(rows, root, bits, depth)
        h = padded_hidden(loop.target, torch.cat([last, tokens], 1).reshape(-1), seg, loop.cache)
        best = argmax(loop.target.logits(h)).view(B, T + 1)
        drafts, target, path, k = self.walk(tokens, parents, counts, best, D)
        self.keep_path(loop.cache.k, loop.cache.v, rows, root, path, k)
        loop.commit_op(rows, drafts, counts, target, loop.history, loop.lengths, loop.prompt_lens, loop.max_tokens,
                       loop.max_len, loop.stops, loop.live, loop.counters, loop.record)
