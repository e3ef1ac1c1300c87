"""Packed varlen attention over per-slot KV caches (decode, verify and prefill in one launch).

The flat batch holds S segments laid end to end: segment s owns queries
[seg_starts[s], seg_starts[s+1]) and reads cache slot seg_slots[s], whose first
seg_cache_lens[s] positions were there before this forward and whose next n_s positions hold
this segment's own K/V (written by the caller before the call). Query i of a segment sits at
absolute position cache_len + i and sees keys at positions <= cache_len + i.

Token trees (segments.py; optional `tree_mask`, a constexpr flag: no cost without it): per flat
token an int64 ancestor bitmask, bit j set when token j of its segment is an ancestor of the token
or the token itself (cpu_decoder.tree_bits makes it); 0 for every token of an ordinary segment. A
token with a nonzero mask sees its slot's keys at rows < cache_len plus those at cache_len + j for
each bit j set, so a tree segment holds at most 64 tokens. Its keys still end at its own row
(ancestors precede their descendants), and key 0 stays visible to every row (a cached row, or the
root, an ancestor of every token), so the loop and its bounds are the causal ones.

Kernel layout: one program per (segment, row block, KV head). The rows of a block are
(query, head in the GQA group) pairs, so the H / KV query heads that share one KV head are
computed together and every K/V tile is read once for the whole group. Each program walks its
slot's keys in blocks with an online softmax (fp32 running max, sum and accumulator) and stops
at the last key its rows can see; nothing beyond a slot's valid length is read.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, is_interpreted, launcher, require_triton, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256

if HAVE_TRITON:

    @triton.jit
    def _varlen_attention_kernel(
        q_ptr,  # [N, H, D]
        k_ptr,  # [slots, KV, max_len, D]
        v_ptr,  # [slots, KV, max_len, D]
        o_ptr,  # [N, H, D]
        slots_ptr,  # [S]
        starts_ptr,  # [S + 1]
        cache_lens_ptr,  # [S]
        tree_ptr,  # [N] int64 ancestor bitmasks (0: a causal row); read only when HAS_TREE
        stride_qn, stride_qh, stride_qd,
        stride_ks, stride_kh, stride_kl, stride_kd,
        stride_vs, stride_vh, stride_vl, stride_vd,
        stride_on, stride_oh, stride_od,
        qk_scale,  # softmax scale * log2(e): scores live in the exp2 domain
        HEAD_DIM: tl.constexpr,
        GROUP: tl.constexpr,  # H // KV query heads per KV head
        BLOCK_M: tl.constexpr,  # rows (query, head-in-group) per program
        BLOCK_N: tl.constexpr,  # keys per step
        BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
        DOT_FP32: tl.constexpr,  # do both products in fp32 (fp32 inputs, or the interpreter)
        HAS_TREE: tl.constexpr,  # tree_ptr holds masks (else it is not read)
    ):
        seg = tl.program_id(0)
        row0 = tl.program_id(1) * BLOCK_M
        kvh = tl.program_id(2)

        start = tl.load(starts_ptr + seg).to(tl.int64)
        n = tl.load(starts_ptr + seg + 1).to(tl.int64) - start  # new tokens in this segment
        if row0 < n * GROUP:
            slot = tl.load(slots_ptr + seg).to(tl.int64)
            cache_len = tl.load(cache_lens_ptr + seg).to(tl.int64)

            rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M] row = query * GROUP + head in group
            row_ok = rows < n * GROUP
            # rows past the segment's end compute a copy of its last query and are not stored,
            # so no row is ever fully masked (no -inf - -inf in the online softmax)
            qi = tl.minimum(rows // GROUP, n - 1)  # [BLOCK_M] query index inside the segment
            head = kvh * GROUP + rows % GROUP  # [BLOCK_M] query head
            q_pos = cache_len + qi  # [BLOCK_M] absolute position: sees keys <= q_pos
            offs_d = tl.arange(0, BLOCK_D)
            d_ok = offs_d < HEAD_DIM
            if HAS_TREE:
                bits = tl.load(tree_ptr + start + qi)  # [BLOCK_M] int64: ancestor-and-self bits, 0 if causal
                in_tree = bits != 0  # [BLOCK_M]

            q_ptrs = q_ptr + (start + qi)[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
            q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            if DOT_FP32:
                q = q.to(tl.float32)

            # the last key any row of this block can see, + 1 (<= cache_len + n <= max_len)
            kv_end = cache_len + tl.minimum((row0 + BLOCK_M - 1) // GROUP, n - 1) + 1
            k_base = k_ptr + slot * stride_ks + kvh * stride_kh
            v_base = v_ptr + slot * stride_vs + kvh * stride_vh

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (exp2 domain)
            l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of p @ V
            for k0 in range(0, kv_end, BLOCK_N):
                offs_n = k0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
                n_ok = offs_n < kv_end
                kt = tl.load(  # [BLOCK_D, BLOCK_N]
                    k_base + offs_n[None, :] * stride_kl + offs_d[:, None] * stride_kd,
                    mask=n_ok[None, :] & d_ok[:, None],
                    other=0.0,
                )
                v = tl.load(  # [BLOCK_N, BLOCK_D]
                    v_base + offs_n[:, None] * stride_vl + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                if DOT_FP32:
                    s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
                else:
                    s = tl.dot(q, kt)
                s = s * qk_scale  # [BLOCK_M, BLOCK_N] fp32
                visible = offs_n[None, :] <= q_pos[:, None]  # [BLOCK_M, BLOCK_N] causal + valid length
                if HAS_TREE:
                    # a tree row sees the cached rows and the rows of its bits; the shift is clamped to
                    # 0..63 (keys outside the segment's rows are decided by the other terms)
                    j = tl.minimum(tl.maximum(offs_n - cache_len, 0), 63)  # [BLOCK_N] key's index in the segment
                    ancestor = ((bits[:, None] >> j[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
                    seen = (offs_n[None, :] < cache_len) | ancestor
                    visible = visible & (~in_tree[:, None] | seen)
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: key 0 is visible to every row
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
                l_i = l_i * alpha + tl.sum(p, 1)
                if DOT_FP32:
                    pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(v.dtype), v)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            out = acc / l_i[:, None]
            o_ptrs = o_ptr + (start + qi)[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :] * stride_od
            tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

else:
    _varlen_attention_kernel = None


def _check_index(name: str, t: torch.Tensor, numel: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor")
    if t.dim() != 1 or t.numel() != numel:
        raise ValueError(f"{name} must be 1-D with {numel} entries, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_args(q, cache_k, cache_v, seg_slots, seg_starts, seg_cache_lens, max_seg_len, tree_mask) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [N, H, D], got shape {tuple(q.shape)}")
    if cache_k.dim() != 4 or cache_k.shape != cache_v.shape:
        raise ValueError(
            "cache_k/cache_v must both be [slots, KV, max_len, D], "
            f"got {tuple(cache_k.shape)} and {tuple(cache_v.shape)}"
        )
    H, D = q.shape[1], q.shape[2]
    KV = cache_k.shape[1]
    if cache_k.shape[3] != D:
        raise ValueError(f"head_dim mismatch: q has {D}, the cache {cache_k.shape[3]}")
    if KV == 0 or H % KV != 0:
        raise ValueError(f"num heads {H} must be a multiple of kv heads {KV}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} is not supported (1..{MAX_HEAD_DIM})")
    if q.dtype not in _FLOAT_DTYPES or cache_k.dtype != q.dtype or cache_v.dtype != q.dtype:
        raise TypeError(
            "q, cache_k, cache_v must share one dtype of fp32/bf16/fp16, "
            f"got {q.dtype}, {cache_k.dtype}, {cache_v.dtype}"
        )
    if cache_k.device != q.device or cache_v.device != q.device:
        raise ValueError(f"q is on {q.device} but the cache on {cache_k.device}/{cache_v.device}")
    S = seg_slots.numel() if isinstance(seg_slots, torch.Tensor) else -1
    _check_index("seg_slots", seg_slots, S, q.device)
    _check_index("seg_starts", seg_starts, S + 1, q.device)
    _check_index("seg_cache_lens", seg_cache_lens, S, q.device)
    if not isinstance(max_seg_len, int) or max_seg_len < 0:
        raise ValueError(f"max_seg_len must be a non-negative int, got {max_seg_len!r}")
    if tree_mask is not None:
        if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.int64:
            raise TypeError("tree_mask must be an int64 tensor (one ancestor bitmask per flat token)")
        _check_index("tree_mask", tree_mask, q.shape[0], q.device)


def varlen_attention(
    q: torch.Tensor,  # [N, H, D] queries of the new tokens, RoPE applied
    cache_k: torch.Tensor,  # [slots, KV, max_len, D] one layer; the new tokens' K already written
    cache_v: torch.Tensor,  # [slots, KV, max_len, D]
    seg_slots: torch.Tensor,  # [S] int32/int64: cache slot of each segment
    seg_starts: torch.Tensor,  # [S + 1] int32/int64: segment offsets in the flat batch
    seg_cache_lens: torch.Tensor,  # [S] int32/int64: tokens in the slot before this forward
    max_seg_len: int,  # >= every segment's length (host int: sizes the grid, no device sync)
    tree_mask: torch.Tensor | None = None,  # [N] int64 ancestor bitmasks (module docstring), or None: no trees
) -> torch.Tensor:  # [N, H, D], q's dtype
    """Causal attention of each segment's queries over its slot's cache (a tree segment's: over its
    cached rows and its ancestors, per tree_mask). No host sync.

    Empty segments are allowed. Caller's promises (not checked, as checking would sync):
    segment lengths <= max_seg_len, cache_len + n <= max_len, starts nondecreasing; rows of q
    outside every segment are left uninitialised in the output; with tree_mask, every token of a
    tree segment (at most 64 tokens) has a nonzero mask that is its tree's (tree_bits), every token
    of an ordinary segment 0.
    """
    require_triton("varlen_attention")
    _check_args(q, cache_k, cache_v, seg_slots, seg_starts, seg_cache_lens, max_seg_len, tree_mask)
    N, H, D = q.shape
    KV = cache_k.shape[1]
    group = H // KV
    out = torch.empty((N, H, D), dtype=q.dtype, device=q.device)
    S = seg_slots.numel()
    if S == 0 or N == 0 or max_seg_len == 0:
        return out

    kernel = launcher(_varlen_attention_kernel, q.device)
    dot_fp32 = q.dtype == torch.float32 or is_interpreted(kernel)  # the interpreter cannot dot bf16
    block_d = max(16, triton.next_power_of_2(D))
    rows = max_seg_len * group  # rows of the longest segment
    block_m = 16 if rows <= 16 else (32 if rows <= 32 or (dot_fp32 and block_d >= 256) else 64)
    block_n = 32 if block_d >= 256 or (dot_fp32 and block_d >= 128) else 64
    grid = (S, triton.cdiv(rows, block_m), KV)
    kernel[grid](
        q, cache_k, cache_v, out,
        seg_slots, seg_starts, seg_cache_lens, seg_starts if tree_mask is None else tree_mask,
        *q.stride(), *cache_k.stride(), *cache_v.stride(), *out.stride(),
        (1.0 / math.sqrt(D)) * 1.4426950408889634,
        HEAD_DIM=D, GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_FP32=dot_fp32,
        HAS_TREE=tree_mask is not None,
        num_warps=4 if block_m * block_d <= 64 * 64 else 8,
        num_stages=2 if dot_fp32 else 3,  # fp32 tiles are twice the size: keep shared memory < 160 KiB
    )
    return out


def varlen_attention_ref(
    q: torch.Tensor,  # [N, H, D]
    cache_k: torch.Tensor,  # [slots, KV, max_len, D]
    cache_v: torch.Tensor,  # [slots, KV, max_len, D]
    seg_slots: torch.Tensor,  # [S]
    seg_starts: torch.Tensor,  # [S + 1]
    seg_cache_lens: torch.Tensor,  # [S]
    max_seg_len: int,  # unused (kept for the same signature)
    tree_mask: torch.Tensor | None = None,  # [N] int64, as for varlen_attention
) -> torch.Tensor:  # [N, H, D]
    """Torch reference, a scaled_dot_product_attention call per segment: query i of a segment sees its slot's
    keys at rows <= cache_len + i; a tree token, the rows < cache_len and cache_len + j for each bit j of its
    mask (ValueError where a segment's masks are not a tree's: trees_from_mask). Syncs to the host."""
    slots, starts, cache_lens = seg_slots.tolist(), seg_starts.tolist(), seg_cache_lens.tolist()
    bits = None if tree_mask is None else [x & ((1 << 64) - 1) for x in tree_mask.tolist()]  # as uint64
    trees = [None] * len(slots) if bits is None else trees_from_mask(bits, starts)
    out = torch.empty_like(q)
    for s, slot in enumerate(slots):
        a, b, c = starts[s], starts[s + 1], cache_lens[s]
        n = b - a
        if n == 0:
            continue
        total = c + n
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ks = cache_k[slot, :, :total].unsqueeze(0)  # [1, KV, total, D]
        vs = cache_v[slot, :, :total].unsqueeze(0)
        mask = None
        if trees[s] is not None:
            own = torch.tensor([[x >> j & 1 == 1 for j in range(n)] for x in bits[a:b]], device=q.device)  # [n, n]
            mask = torch.cat((torch.ones(n, c, dtype=torch.bool, device=q.device), own), dim=1)  # [n, total]
        elif n > 1:
            key_pos = torch.arange(total, device=q.device)
            query_pos = torch.arange(c, total, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, total]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)  # [1, H, n, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


def trees_from_mask(bits: list[int], starts: list[int]) -> list[list[int] | None]:
    """[S] per segment: None where its tokens' masks are all 0, else the parents of its tree (each token's
    parent is its latest ancestor; the root, token 0, has -1). ValueError where the masks are not exactly
    that tree's: every token's mask is its parent's plus its own bit, and only token 0 has no parent."""
    out: list[list[int] | None] = []
    for s, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        seg_bits = [x & ((1 << 64) - 1) for x in bits[a:b]]  # as uint64
        if not any(seg_bits):
            out.append(None)
            continue
        if b - a > 64:
            raise ValueError(f"tree_mask: segment {s} has {b - a} tokens; a tree takes at most 64")
        parents = [max((j for j in range(i) if x >> j & 1), default=-1) for i, x in enumerate(seg_bits)]
        tree = all((p >= 0 or i == 0) and x == (1 << i) | (seg_bits[p] if p >= 0 else 0)
                   for i, (p, x) in enumerate(zip(parents, seg_bits)))
        if not tree:
            raise ValueError(f"tree_mask: segment {s}'s masks are not the ancestor-and-self masks of a tree")
        out.append(parents)
    return out
