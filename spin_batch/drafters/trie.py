"""Token tries for drafters that merge several draft paths into one token tree (n-gram, vote, cascade).

A tree is flat, as Proposal.parents has it: node i has token tokens[i] and parent parents[i] (-1: the
root, the slot's last committed token), every parent before its children. Merging paths into a trie
makes shared prefixes one path, so the children of any node are distinct tokens.
"""

from __future__ import annotations


class Trie:
    """Paths from the root merged into a tree of at most `limit` nodes, in insertion order."""

    def __init__(self, limit: int):
        self.limit = limit
        self.tokens: list[int] = []  # [T]
        self.parents: list[int] = []  # [T]
        self._child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return self.size >= self.limit

    def insert(self, path: list[int]) -> list[int]:
        """Merge a path from the root; returns the nodes of its prefix that is now in the trie (the whole
        path unless the node limit cut it)."""
        node, nodes = -1, []
        for token in path:
            nxt = self._child.get((node, token))
            if nxt is None:
                if self.full:
                    break
                nxt = self.size
                self.tokens.append(token)
                self.parents.append(node)
                self._child[(node, token)] = nxt
            nodes.append(nxt)
            node = nxt
        return nodes

    def shape(self) -> list[int] | None:
        """The parents for Proposal.parents, or None when the trie is one chain (verified as a chain)."""
        return None if is_chain(self.parents) else list(self.parents)


def is_chain(parents: list[int]) -> bool:
    """Whether every node is the child of the node before it (a chain written as a tree)."""
    return all(a == i - 1 for i, a in enumerate(parents))


def tree_depth(parents: list[int]) -> int:
    """The longest root-to-leaf path of a tree, in nodes (0: empty)."""
    depths: list[int] = []
    for a in parents:
        depths.append(1 + (depths[a] if a >= 0 else 0))
    return max(depths, default=0)


def first_path(tokens: list[int], parents: list[int]) -> list[int]:
    """The tree's first root-to-leaf path: from the root's first child, each node's first child."""
    kids: dict[int, int] = {}
    for i, a in enumerate(parents):
        kids.setdefault(a, i)
    path, node = [], kids.get(-1)
    while node is not None:
        path.append(tokens[node])
        node = kids.get(node)
    return path
