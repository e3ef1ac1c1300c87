"""Scatter the new tokens' K/V rows into one layer of the per-slot KV cache.

One program per new token: it reads the token's [KV, D] rows of k and v and writes them at
(its slot, its cache row) of the cache. The row is Segments.rows: the token's position, except
in a token tree, where row cache_len + i holds token i whatever its depth (segments.py). The
equivalent of KVCache.write for one layer, without the index_put machinery.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, launcher, require_triton, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)

if HAVE_TRITON:

    @triton.jit
    def _kv_write_kernel(
        ck_ptr,  # [slots, KV, max_len, D]
        cv_ptr,  # [slots, KV, max_len, D]
        slots_ptr,  # [N]
        rows_ptr,  # [N]
        k_ptr,  # [N, KV, D]
        v_ptr,  # [N, KV, D]
        stride_cks, stride_ckh, stride_ckl, stride_ckd,
        stride_cvs, stride_cvh, stride_cvl, stride_cvd,
        stride_kn, stride_kh, stride_kd,
        stride_vn, stride_vh, stride_vd,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr,  # KV_HEADS rounded up to a power of two
        BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        row = tl.load(rows_ptr + t).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

        k = tl.load(k_ptr + t * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
        v = tl.load(v_ptr + t * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
        ck = ck_ptr + slot * stride_cks + row * stride_ckl + offs_h[:, None] * stride_ckh + offs_d[None, :] * stride_ckd
        cv = cv_ptr + slot * stride_cvs + row * stride_cvl + offs_h[:, None] * stride_cvh + offs_d[None, :] * stride_cvd
        tl.store(ck, k, mask=mask)
        tl.store(cv, v, mask=mask)

else:
    _kv_write_kernel = None


def _check_args(cache_k_layer, cache_v_layer, token_slots, rows, k, v) -> None:
    if cache_k_layer.dim() != 4 or cache_k_layer.shape != cache_v_layer.shape:
        raise ValueError(
            "cache_k_layer/cache_v_layer must both be [slots, KV, max_len, D], "
            f"got {tuple(cache_k_layer.shape)} and {tuple(cache_v_layer.shape)}"
        )
    _, KV, _, D = cache_k_layer.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (KV, D):
        raise ValueError(f"k and v must both be [N, {KV}, {D}], got {tuple(k.shape)} and {tuple(v.shape)}")
    N = k.shape[0]
    dt = cache_k_layer.dtype
    if dt not in _FLOAT_DTYPES or any(t.dtype != dt for t in (cache_v_layer, k, v)):
        raise TypeError(
            f"cache and k/v must share one dtype of fp32/bf16/fp16, got "
            f"{cache_k_layer.dtype}, {cache_v_layer.dtype}, {k.dtype}, {v.dtype}"
        )
    dev = cache_k_layer.device
    for name, t in (("cache_v_layer", cache_v_layer), ("k", k), ("v", v), ("token_slots", token_slots),
                    ("rows", rows)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but the cache on {dev}")
    for name, t in (("token_slots", token_slots), ("rows", rows)):
        if t.dtype not in _INDEX_DTYPES or t.dim() != 1 or t.numel() != N:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor of {N} entries")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def kv_write(
    cache_k_layer: torch.Tensor,  # [slots, KV, max_len, D] written in place
    cache_v_layer: torch.Tensor,  # [slots, KV, max_len, D] written in place
    token_slots: torch.Tensor,  # [N] int32/int64: slot of each new token
    rows: torch.Tensor,  # [N] int32/int64: cache row of each new token (Segments.rows, not its RoPE position)
    k: torch.Tensor,  # [N, KV, D]
    v: torch.Tensor,  # [N, KV, D]
) -> None:
    """cache[slot[t], :, row[t]] = k[t] (and v) for every token t. No host sync.

    Caller's promises (not checked): 0 <= slot < slots, 0 <= row < max_len, and no two tokens
    write the same (slot, row).
    """
    require_triton("kv_write")
    _check_args(cache_k_layer, cache_v_layer, token_slots, rows, k, v)
    N, KV, D = k.shape
    if N == 0:
        return
    kernel = launcher(_kv_write_kernel, k.device)
    kernel[(N,)](
        cache_k_layer, cache_v_layer, token_slots, rows, k, v,
        *cache_k_layer.stride(), *cache_v_layer.stride(), *k.stride(), *v.stride(),
        KV_HEADS=KV, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(KV), BLOCK_D=triton.next_power_of_2(D),
        num_warps=1 if KV * D <= 512 else 4,
    )


def kv_write_ref(
    cache_k_layer: torch.Tensor,  # [slots, KV, max_len, D]
    cache_v_layer: torch.Tensor,  # [slots, KV, max_len, D]
    token_slots: torch.Tensor,  # [N]
    rows: torch.Tensor,  # [N]
    k: torch.Tensor,  # [N, KV, D]
    v: torch.Tensor,  # [N, KV, D]
) -> None:
    """Torch reference: the same scatter as KVCache.write."""
    # advanced indices split by a slice put the index dimension first: [N, KV, D]
    cache_k_layer[token_slots.long(), :, rows.long()] = k
    cache_v_layer[token_slots.long(), :, rows.long()] = v
