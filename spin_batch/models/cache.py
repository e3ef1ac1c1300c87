"""Preallocated per-slot KV cache.

One cache per model: K and V of shape [layers, slots, kv_heads, max_len, head_dim]. A slot's
valid length is owned by the caller (the batch loop): rollback is moving that length back,
and later writes overwrite whatever lay beyond it. Nothing is ever copied to roll back.

After a token-tree verify (segments.py) the accepted nodes lie scattered
over the tree's scratch rows: keep_path moves them into place (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    k: torch.Tensor  # [layers, slots, kv_heads, max_len, head_dim]
    v: torch.Tensor  # [layers, slots, kv_heads, max_len, head_dim]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> "KVCache":
        shape = (num_layers, slots, kv_heads, max_len, head_dim)
        # zeros, not empty: a stale NaN beyond a slot's length must never reach a masked softmax.
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def rows(self, token_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N * kv_heads] flat row of each (token, kv head) in one layer's cache viewed as
        [slots * kv_heads * max_len, head_dim]; computed once per forward, used by every layer."""
        kv_heads, max_len = self.k.shape[2], self.k.shape[3]
        heads = torch.arange(kv_heads, device=token_slots.device)
        return ((token_slots[:, None] * kv_heads + heads) * max_len + positions[:, None]).view(-1)

    def write(
        self,
        layer: int,
        rows: torch.Tensor,  # [N * kv_heads] long, from rows()
        k: torch.Tensor,  # [N, kv_heads, head_dim]
        v: torch.Tensor,  # [N, kv_heads, head_dim]
    ) -> None:
        """Scatter new K/V rows into the cache at (slot, position)."""
        d = self.k.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, rows, v.reshape(-1, d))

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Slot dst's first n rows, every layer, K and V, become slot src's (a prompt shared by samples)."""
        for t in (self.k, self.v):
            t[:, dst, :, :n] = t[:, src, :, :n]

    def keep_path(self, slot: int, cache_len: int, path: list[int]) -> int:
        """Keep one accepted path of a tree segment verified at cache_len in this slot; returns the
        slot's valid length after it, cache_len + 1 + len(path).

        The tree segment wrote its token i at row cache_len + i of every layer; token 0 is the root
        (the last committed token, which the loop feeds at row cache_len = committed length - 1) and
        stays where it is. path lists the accepted draft nodes below the root, root excluded, in
        order from the root down (path[0]'s parent is 0, path[k]'s parent is path[k - 1]), so it
        increases strictly and path[k] >= k + 1. Row cache_len + path[k] moves to cache_len + 1 + k
        in every layer, K and V; rows past the returned length are left as they are (stale, never read).
        """
        if any(b <= a for a, b in zip([0] + path, path)):
            raise ValueError(f"keep_path: path {path} must increase strictly from the root (0), root excluded")
        end = cache_len + 1 + len(path)
        if path and cache_len + path[-1] >= self.max_len:
            raise ValueError(f"keep_path: row {cache_len + path[-1]} is past the cache's {self.max_len} rows")
        moved = [k for k, p in enumerate(path) if p != k + 1]
        if moved:
            src = torch.tensor([cache_len + path[k] for k in moved], device=self.k.device)
            dst = torch.tensor([cache_len + 1 + k for k in moved], device=self.k.device)
            for t in (self.k, self.v):
                rows = t[:, slot]  # [layers, kv_heads, max_len, head_dim], a view
                rows[:, :, dst] = rows[:, :, src]  # the source rows are gathered before any is written
        return end
