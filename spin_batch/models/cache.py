"""Preallocated per-slot KV cache.

One cache per model: K and V of shape [layers, slots, kv_heads, max_len, head_dim]. A slot's
valid length is owned by the caller (the batch loop): rollback is moving that length back,
and later writes overwrite whatever lay beyond it. Nothing is ever copied to roll back.
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
