"""Packed attention over per-slot KV caches, in torch: the reference and the planned batched path.

A forward's tokens are packed as segments (segments.py), each a run of new tokens of one slot that
attends to its slot's cached prefix plus itself causally. attention_ref attends segment by segment;
attention follows an AttentionPlan, which groups the short segments (decode, verify) into a few
batched calls and leaves the long ones (prefill chunks) a call each. The same plan serves the
transformers backend (hf_attention.py). A tree segment (segments.py; not yet fed by the loop) is
attended by attention_ref with its tree mask, a call each, whatever its length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import Segments


def attention_ref(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, seg: Segments, only: list[int] | None = None
) -> torch.Tensor:
    """Torch reference for packed varlen attention over per-slot caches.

    q: [N, H, D]; cache_k/cache_v: [slots, KV, max_len, D] (this segment's K/V already written).
    Returns [N, H, D]. Segment s's query i (cache row cache_len + i) sees its slot's keys at
    rows <= cache_len + i; in a tree segment, the rows < cache_len plus those of its ancestors and
    itself (Segments.tree_mask). `only` restricts it to those segment indices (other rows of the
    result are left unset).
    """
    out = torch.empty_like(q)
    for i in range(seg.num_segments) if only is None else only:
        slot, a, b, c = seg.slots[i], seg.starts[i], seg.starts[i + 1], seg.cache_lens[i]
        n = b - a
        if n == 0:
            continue
        total = c + n
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ks = cache_k[slot, :, :total].unsqueeze(0)  # [1, KV, total, D]
        vs = cache_v[slot, :, :total].unsqueeze(0)
        mask = None
        if seg.is_tree(i):
            prefix = torch.ones(n, c, dtype=torch.bool, device=q.device)
            mask = torch.cat((prefix, seg.tree_mask(i).to(q.device)), dim=1)  # [n, total]
        elif n > 1:
            key_pos = torch.arange(total, device=q.device)
            query_pos = torch.arange(c, total, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, total]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)  # [1, H, n, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


# Segments with at most this many new tokens (decode, verify) are attended in batched calls,
# grouped by AttentionPlan; longer ones (prefill chunks) keep a call each.
SHORT_SEGMENT = 16


class _ShortGroup:
    """Short segments (decode tokens, verify runs) attended in one batched call.

    Their queries are laid out in a grid of [slot, nmax] rows, nmax the longest of them: cells no
    segment fills are padding, computed and dropped. Only the attention's queries are padded; the
    linear layers stay packed. The grid spans the slots from the lowest member to the highest, so
    the keys are a view of the cache: gathering the members' caches instead copies them at every
    layer, which costs several padded rows per slot. Each KV head's G query heads are folded into
    its query rows ([R, KV, G * nmax, D]), so the call is plain multi-head attention over the
    cache's KV heads: no grouped-query expansion, which on CPU costs more than the attention
    itself at decode sizes. An additive mask hides keys past each query's own position (so also
    another slot's longer context); a padded query sees what its segment's last query sees, and a
    slot of the span with no segment sees its first key only, so no row is all masked. A lone
    decode token (one segment, n = 1) sees exactly its slot's keys: no mask.
    """

    def __init__(self, seg: Segments, members: list[int], groups: int, dtype: torch.dtype,
                 device: torch.device):
        slots = [seg.slots[i] for i in members]
        starts = [seg.starts[i] for i in members]
        lens = [seg.starts[i + 1] - seg.starts[i] for i in members]
        ctxs = [seg.cache_lens[i] for i in members]
        self.nmax = nmax = max(lens)
        self.ctx = max(c + n for c, n in zip(ctxs, lens))
        lo, hi = min(slots), max(slots)
        if len(set(slots)) == len(slots):
            self.slots: slice | torch.Tensor = slice(lo, hi + 1)  # a view of the cache
            grid = [s - lo for s in slots]
            self.grid_rows = hi - lo + 1
        else:  # a slot twice (not made by the loop): gather its cache per segment
            self.slots = torch.tensor(slots, dtype=torch.long, device=device)
            grid = list(range(len(slots)))
            self.grid_rows = len(slots)
        R = self.grid_rows
        # flat query row of each grid cell (padding repeats its segment's last row, or row 0)
        src = [starts[0]] * (R * nmax)
        qpos = [[0] * nmax for _ in range(R)]  # query position of each cell: what it may see
        take: list[int] = []  # grid cell of each member row, in flat order
        for r, a, n, c in zip(grid, starts, lens, ctxs):
            for j in range(nmax):
                src[r * nmax + j] = a + min(j, n - 1)
                qpos[r][j] = c + min(j, n - 1)
            take.extend(r * nmax + j for j in range(n))
        count = sum(lens)
        contiguous = all(starts[k + 1] == starts[k] + lens[k] for k in range(len(members) - 1))
        self.rows: slice | torch.Tensor = (
            slice(starts[0], starts[0] + count) if contiguous
            else torch.tensor([a + j for a, n in zip(starts, lens) for j in range(n)], device=device)
        )  # the members' flat rows, in flat order
        # No padding and the grid in flat order: the queries are a view and so is the output.
        exact = take == list(range(R * nmax)) and contiguous
        self.q_index: slice | torch.Tensor = (
            slice(starts[0], starts[0] + count) if exact else torch.tensor(src, dtype=torch.long, device=device))
        self.take = None if exact else torch.tensor(take, dtype=torch.long, device=device)
        self.mask = None
        if R > 1 or nmax > 1:
            pos = torch.tensor(qpos, device=device)  # [R, nmax]
            visible = torch.arange(self.ctx, device=device) <= pos[..., None]  # [R, nmax, ctx]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self.mask = mask.repeat(1, groups, 1)[:, None]  # [R, 1, G * nmax, ctx]: row g * nmax + j is query j

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """The members' rows of the output, in flat order, [rows, H, D]. Query head h reads KV head h // G."""
        _, H, D = q.shape
        KV = cache_k.shape[1]
        G, R, n = H // KV, self.grid_rows, self.nmax
        qs = q[self.q_index].view(R, n, KV, G, D).permute(0, 2, 3, 1, 4).reshape(R, KV, G * n, D)
        k = cache_k[self.slots, :, : self.ctx]  # [R, KV, ctx, D]
        v = cache_v[self.slots, :, : self.ctx]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=self.mask)  # [R, KV, G * n, D]
        o = o.view(R, KV, G, n, D).permute(0, 3, 1, 2, 4).reshape(R * n, H, D)
        return o if self.take is None else o[self.take]


# What one more attention call costs, in padded query rows: the grouping below weighs the two.
GROUP_CALL_ROWS = 4


class AttentionPlan:
    """How one forward's segments are attended; built once per forward, shared by all layers.

    Short segments are grouped by length: a group pads its queries to its longest member over the
    span of slots it covers (see _ShortGroup). One group for all pads every slot to the longest
    draft; one group per length covers the span once per length. The groups are the runs of
    sorted distinct lengths that minimise the padded rows plus GROUP_CALL_ROWS per call (a small
    dynamic programme over at most SHORT_SEGMENT lengths). Tree segments join no group: they go
    with the long ones, a masked reference call each (`long`).
    """

    def __init__(self, seg: Segments, groups: int, dtype: torch.dtype, device: torch.device):
        by_len: dict[int, list[int]] = {}
        self.long: list[int] = []
        for i, n in enumerate(seg.lengths()):
            if seg.has_trees and n > 0 and seg.is_tree(i):
                self.long.append(i)
            elif 0 < n <= SHORT_SEGMENT:
                by_len.setdefault(n, []).append(i)
            elif n > SHORT_SEGMENT:
                self.long.append(i)
        self.groups = [_ShortGroup(seg, sorted(members), groups, dtype, device)
                       for members in self._partition(seg, by_len)]
        # One group holding every row in flat order (a decode or verify step without prefill): its output is the result.
        rows = self.groups[0].rows if len(self.groups) == 1 and not self.long else None
        self.whole = isinstance(rows, slice) and rows == slice(0, seg.num_tokens)

    @staticmethod
    def _partition(seg: Segments, by_len: dict[int, list[int]]) -> list[list[int]]:
        lens = sorted(by_len)
        if len(lens) <= 1:
            return [by_len[n] for n in lens]

        def cost(i: int, j: int) -> int:  # one group for lengths lens[i..j]
            slots = [seg.slots[m] for n in lens[i : j + 1] for m in by_len[n]]
            return GROUP_CALL_ROWS + (max(slots) - min(slots) + 1) * lens[j]

        best = [0] + [None] * len(lens)  # best[j]: cheapest grouping of lens[:j]
        cut = [0] * (len(lens) + 1)
        for j in range(1, len(lens) + 1):
            best[j], cut[j] = min((best[i] + cost(i, j - 1), i) for i in range(j))
        out, j = [], len(lens)
        while j:
            out.append([m for n in lens[cut[j] : j] for m in by_len[n]])
            j = cut[j]
        return out[::-1]


def attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, seg: Segments, plan: AttentionPlan
) -> torch.Tensor:
    """Packed attention per the plan: a batched call per group of short segments, a call per long or tree segment."""
    if plan.whole:
        return plan.groups[0].attend(q, cache_k, cache_v)
    out = attention_ref(q, cache_k, cache_v, seg, only=plan.long) if plan.long else torch.empty_like(q)
    for group in plan.groups:
        out[group.rows] = group.attend(q, cache_k, cache_v)
    return out
