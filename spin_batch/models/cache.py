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

    def write(
        self,
        layer: int,
        token_slots: torch.Tensor,  # [N] long
        positions: torch.Tensor,  # [N] long
        k: torch.Tensor,  # [N, kv_heads, head_dim]
        v: torch.Tensor,  # [N, kv_heads, head_dim]
    ) -> None:
        """Scatter new K/V rows into the cache at (slot, position)."""
        # Advanced indices separated by a slice put the index dimension first: [N, kv_heads, head_dim].
        self.k[layer][token_slots, :, positions] = k
        self.v[layer][token_slots, :, positions] = v
