"""The n-gram drafter's token tree over a device token history, at fixed shapes, no host sync.

The rule is spin_batch.drafters.ngram.NgramDrafter._tree's (with lookup_matches): the continuations of
earlier matches of the history's suffix, longest suffix first and the latest match first within one length,
each continuation starting at a distinct position, at most `matches` of them; each is the up to gamma[r]
tokens that followed its match, capped by keep[n] for a match of length n (the gate's cap, as ngram_draft),
and they merge into a trie of at most `nodes` nodes in insertion order (spin_batch.drafters.trie.Trie). The
host's lookup also stops comparing positions after 512 past its first match; this one looks at the whole
history, so on a history long and repetitive enough to reach that bound the trees may differ.

How, in torch at fixed shapes ([B, L, max_ngram] and [B, M, M, D] comparisons, M = matches, D = depth):

- c[e], for each end position e (the first token after a candidate occurrence), is how many tokens before e
  equal the suffix's last tokens (ngram_draft's count). A continuation starts at e with match length c[e]:
  the host finds it first at that length, and at shorter lengths skips it (a start already taken). So the
  continuations are the M largest keys c[e] * (L + 1) + e with c[e] >= min_ngram, in order.
- Prefix (m, d) is continuation m's first d + 1 tokens. Its trie node is the one of the first continuation
  m' <= m with the same prefix (its owner); a prefix that owns its node adds a node, and the nodes are
  numbered in insertion order, (m, d) lexicographic among owners, the first `nodes` kept. A node's parent is
  the node of its prefix one shorter (-1 at d = 0).

Outputs: tokens [B, nodes] and parents [B, nodes] (padding past each row's count: token 0, parent -1),
counts [B]. As spin_kernels.tree takes them.
"""

from __future__ import annotations

import torch

MATCHES = 32  # continuations a tree considers (the host's MAX_MATCHES)


def ngram_tree(rows, history, lengths, gamma, keep, nodes: int, depth: int, min_ngram: int = 1,
               max_ngram: int = 3, matches: int = MATCHES):
    """(tokens [B, nodes], parents [B, nodes], counts [B]) long; see the module docstring. rows [B] slot per row,
    history [P, L], lengths [P], gamma [B] (each row's depth, at most `depth`), keep [max_ngram + 1]."""
    if history.dim() != 2 or lengths.shape != (history.shape[0],) or rows.dim() != 1 or gamma.shape != rows.shape:
        raise ValueError("history [P, L], lengths [P], rows and gamma [B]")
    if not 1 <= min_ngram <= max_ngram or keep.shape != (max_ngram + 1,):
        raise ValueError(f"need 1 <= min_ngram <= max_ngram and keep [max_ngram + 1], got {min_ngram}, "
                         f"{max_ngram}, {tuple(keep.shape)}")
    if nodes < 0 or depth < 0 or matches < 1:
        raise ValueError("nodes and depth must be >= 0 and matches >= 1")
    dev, (P, L), B = history.device, history.shape, rows.shape[0]
    i64 = dict(dtype=torch.long, device=dev)
    if nodes == 0 or depth == 0:
        return torch.zeros(B, nodes, **i64), torch.full((B, nodes), -1, **i64), torch.zeros(B, **i64)
    hist = history[rows.long()].long()  # [B, L]
    size = lengths[rows.long()].long()[:, None]  # [B, 1]
    e = torch.arange(L, device=dev)
    u = torch.arange(1, max_ngram + 1, device=dev)
    sfx = hist.gather(1, (size - u).clamp(min=0))  # [B, N]: the suffix's last tokens, last first
    back = e[:, None] - u  # [L, N]
    window = hist[:, back.clamp(min=0)]  # [B, L, N]
    eq = (window == sfx[:, None, :]) & (back >= 0) & ((e >= 1) & (e[None] <= size - 1))[:, :, None]
    c = eq.long().cumprod(-1).sum(-1)  # [B, L]
    key = torch.where(c >= min_ngram, c * (L + 1) + e, -1)
    M = min(matches, L)
    top = key.topk(M, dim=1).values  # [B, M] descending: the continuations in the host's order
    found = top >= 0
    n = torch.where(found, top // (L + 1), 0)
    at = torch.where(found, top % (L + 1), 0)  # [B, M] each continuation's first position
    g = gamma.long()[:, None].clamp(0, depth)
    length = torch.where(found, torch.minimum(torch.minimum(g, size - at), keep.long()[n]), 0)  # [B, M]
    d = torch.arange(depth, device=dev)
    cont = hist.gather(1, (at[:, :, None] + d).clamp(max=L - 1).reshape(B, M * depth)).view(B, M, depth)
    valid = d < length[:, :, None]  # [B, M, D]
    same = (cont[:, :, None, :] == cont[:, None, :, :]).long().cumprod(-1).bool()  # [B, M, M', D]: equal prefixes
    same = same & valid[:, :, None, :] & valid[:, None, :, :]
    owner = same.long().argmax(2)  # [B, M, D] the first continuation with the same prefix (itself, when valid)
    owns = valid & (owner == torch.arange(M, device=dev)[:, None])
    rank = owns.view(B, M * depth).long().cumsum(1).view(B, M, depth) - 1  # node number of an owned prefix
    node = rank.gather(1, owner)  # [B, M, D] the node of prefix (m, d)
    parent = torch.cat([torch.full((B, M, 1), -1, **i64), node[:, :, :-1]], 2)
    put = torch.where(owns & (rank < nodes), rank, nodes).view(B, M * depth)  # column `nodes`: dropped
    tokens = torch.zeros(B, nodes + 1, **i64).scatter_(1, put, cont.reshape(B, M * depth))[:, :nodes]
    parents = torch.full((B, nodes + 1), -1, **i64).scatter_(1, put, parent.reshape(B, M * depth))[:, :nodes]
    counts = owns.view(B, -1).long().sum(1).clamp(max=nodes)
    return tokens, parents, counts
