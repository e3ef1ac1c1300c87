"""Token trees on device-owned step state: the layout of a padded tree, its greedy walk and keep_path, no host sync.

A step's trees are padded to T nodes per row: node tokens [B, T], parents [B, T] (-1: a child of the root, the
row's last committed token; a parent precedes its children), and counts [B], the nodes that count (the rest
are padding: children of the root that are never accepted). The row's verify segment is the root and then the
T nodes: segment token 0 is the root, token 1 + i is node i.

- tree_layout: per segment token, its ancestor-and-self bitmask (bit j: segment token j, as the C and Triton
  attention take it, models/segments.py) and its depth (the root 0), by pointer jumping: ceil(log2(T + 1))
  rounds of gathers, whatever the trees.
- tree_walk: the greedy acceptance of spin_batch.engine.tree_verify.greedy_walk: from the root, follow the
  first child (lowest index) whose token is the target's argmax at its parent while one exists. Its result is
  the accepted path as a chain, the form spin_kernels.accept_commit takes: drafts [B, D] (the path's tokens,
  then -1, which no target token equals), target [B, D + 1] (the target's argmax at the root and at each path
  node, then 0), the path's segment token indices [B, D] (1 + node; past the path, 1 + d: keep nothing), and
  the accepted count [B]. accept_commit on them accepts exactly the path and appends the bonus token.
- keep_path: KVCache.keep_path for every row at once: row cache_len + path[d] moves to cache_len + 1 + d, in
  every layer, K and V, for d below the accepted count. Sources never lie below their destinations and no
  source is an earlier destination, so the rows move in place, in order of d.

tree_walk and keep_path are Triton kernels with torch references beside them (`*_ref`); tree_layout is torch
(gathers at fixed shapes), on every path.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, launcher, require_triton, tl, triton

MAX_TREE_NODES = 63  # nodes of one padded tree: with its root, 64 tokens, one int64 mask each (bit 63: the sign)


def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bits [B, T + 1] int64, depth [B, T + 1] long) of padded trees' segments; parents [B, T] (see the module
    docstring). Bit j of bits[b, i]: segment token j is token i or one of its ancestors."""
    B, T = parents.shape
    if T > MAX_TREE_NODES:
        raise ValueError(f"a padded tree takes at most {MAX_TREE_NODES} nodes, got {T}")
    dev = parents.device
    up = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), parents.long() + 1], 1)  # [B, T + 1], root: 0
    idx = torch.arange(T + 1, device=dev)
    bits = torch.bitwise_left_shift(torch.ones_like(up), idx).expand(B, T + 1).contiguous()
    depth = (idx != 0).long().expand(B, T + 1).contiguous()  # distance to `up`
    for _ in range(max(1, T.bit_length())):  # 2^rounds > T: every token reaches the root, which points at itself
        bits = bits | bits.gather(1, up)
        depth = depth + depth.gather(1, up)
        up = up.gather(1, up)
    return bits, depth


if HAVE_TRITON:

    @triton.jit
    def _walk_kernel(
        tokens_ptr,  # [B, T]
        parents_ptr,  # [B, T]
        counts_ptr,  # [B]
        best_ptr,  # [B, T + 1]
        drafts_ptr,  # [B, D] out
        target_ptr,  # [B, D + 1] out
        path_ptr,  # [B, D] out
        k_ptr,  # [B] out
        T, D,
        stride_n, stride_p, stride_b, stride_d, stride_t, stride_q,
        BLOCK_T: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_T)
        count = tl.load(counts_ptr + r).to(tl.int64)
        real = (offs < T) & (offs < count)
        tok = tl.load(tokens_ptr + r * stride_n + offs, mask=real, other=-1).to(tl.int64)
        par = tl.load(parents_ptr + r * stride_p + offs, mask=real, other=-2).to(tl.int64)
        cur = count * 0 - 1  # the last accepted node (-1: the root)
        k = count * 0
        going = count >= 0
        b = tl.load(best_ptr + r * stride_b).to(tl.int64)
        tl.store(target_ptr + r * stride_t, b)
        for d in range(0, D):
            hit = real & (par == cur) & (tok == b)
            nxt = tl.min(tl.where(hit, offs, BLOCK_T), 0).to(tl.int64)
            going = going & (nxt < BLOCK_T)
            cur = tl.where(going, nxt, cur)
            k += going.to(tl.int64)
            b = tl.load(best_ptr + r * stride_b + 1 + cur).to(tl.int64)
            tl.store(drafts_ptr + r * stride_d + d, tl.where(going, tl.sum(tl.where(offs == nxt, tok, 0), 0), -1))
            tl.store(target_ptr + r * stride_t + 1 + d, tl.where(going, b, 0))
            tl.store(path_ptr + r * stride_q + d, tl.where(going, 1 + cur, 1 + d))
        tl.store(k_ptr + r, k)

    @triton.jit
    def _keep_path_kernel(
        k_cache_ptr,  # [layers, P, KV, max_len, head_dim] in/out
        v_cache_ptr,
        rows_ptr,  # [B]
        cache_lens_ptr,  # [B]
        path_ptr,  # [B, D]
        k_ptr,  # [B]
        KV, D, HD,
        stride_l, stride_s, stride_h, stride_t, stride_q,
        BLOCK_HD: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        lh = tl.program_id(1).to(tl.int64)
        s = tl.load(rows_ptr + r).to(tl.int64)
        c = tl.load(cache_lens_ptr + r).to(tl.int64)
        k = tl.load(k_ptr + r).to(tl.int64)
        base = (lh // KV) * stride_l + s * stride_s + (lh % KV) * stride_h
        offs = tl.arange(0, BLOCK_HD)
        inside = offs < HD
        for d in range(0, D):
            src = c + tl.load(path_ptr + r * stride_q + d).to(tl.int64)
            dst = c + 1 + d
            move = inside & (offs * 0 + d < k)
            kv = tl.load(k_cache_ptr + base + src * stride_t + offs, mask=move)
            vv = tl.load(v_cache_ptr + base + src * stride_t + offs, mask=move)
            tl.store(k_cache_ptr + base + dst * stride_t + offs, kv, mask=move)
            tl.store(v_cache_ptr + base + dst * stride_t + offs, vv, mask=move)

else:
    _walk_kernel = None
    _keep_path_kernel = None


def _check_walk(tokens, parents, counts, best, depth: int) -> None:
    B, T = tokens.shape
    if parents.shape != (B, T) or counts.shape != (B,) or best.shape != (B, T + 1):
        raise ValueError(f"tokens and parents [B, T], counts [B], best [B, T + 1]; got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(counts.shape)}, {tuple(best.shape)}")
    if depth < 0:
        raise ValueError("depth must be >= 0")
    for t in (tokens, parents, counts, best):
        if t.device != tokens.device or t.dtype.is_floating_point:
            raise ValueError(f"every input must be an integer tensor on {tokens.device}")


def _walk_outputs(B: int, depth: int, dev) -> tuple[torch.Tensor, ...]:
    i64 = dict(dtype=torch.long, device=dev)
    return (torch.empty(B, depth, **i64), torch.empty(B, depth + 1, **i64), torch.empty(B, depth, **i64),
            torch.empty(B, **i64))


def tree_walk(tokens, parents, counts, best, depth: int):
    """(drafts [B, depth], target [B, depth + 1], path [B, depth], k [B]) long; see the module docstring."""
    require_triton("tree_walk")
    _check_walk(tokens, parents, counts, best, depth)
    B, T = tokens.shape
    out = _walk_outputs(B, depth, tokens.device)
    if B == 0:
        return out
    drafts, target, path, k = out
    kernel = launcher(_walk_kernel, tokens.device)
    kernel[(B,)](
        tokens, parents, counts, best, drafts, target, path, k, T, depth,
        tokens.stride(0), parents.stride(0), best.stride(0), drafts.stride(0), target.stride(0), path.stride(0),
        BLOCK_T=max(2, triton.next_power_of_2(max(T, 1))), num_warps=1,
    )
    return out


def tree_walk_ref(tokens, parents, counts, best, depth: int):
    """tree_walk in torch: [B, T, T] comparisons, no host read."""
    _check_walk(tokens, parents, counts, best, depth)
    B, T = tokens.shape
    dev = tokens.device
    i = torch.arange(T, device=dev)
    par = parents.long()
    real = i < counts.long()[:, None]  # [B, T]
    hit = real & (tokens.long() == best.long().gather(1, (par + 1).clamp(min=0)))  # its token: argmax at its parent
    earlier = (par[:, :, None] == par[:, None, :]) & (i[None, :] < i[:, None])  # [B, T, T]: j an earlier sibling of i
    first = hit & ~(earlier & hit[:, None, :]).any(2)  # the first sibling that is the argmax
    bits, level = tree_layout(parents)
    mask = torch.bitwise_left_shift(torch.ones_like(i), i)  # node i's bit, as a node mask
    good = (first.long() * mask).sum(1, keepdim=True)  # [B, 1]: the nodes that are their parent's pick
    # [B, T]: each node's ancestors and itself, as nodes (the shift keeps int64's sign: bit 63, node 62's, is cleared)
    nodes = torch.bitwise_right_shift(bits[:, 1:], 1) & 0x7FFF_FFFF_FFFF_FFFF
    level = level[:, 1:]
    on = real & ((nodes & ~good) == 0) & (level <= depth)  # every node from the root down to it is picked
    k = on.long().sum(1)
    slot = torch.where(on, level - 1, depth)  # [B, T]: its place on the path (depth: none)
    at = torch.full((B, depth + 1), -1, dtype=torch.long, device=dev).scatter_(1, slot, i.expand(B, T).contiguous())
    at = at[:, :depth]  # [B, depth] the path's nodes, -1 past it
    d = torch.arange(depth, device=dev)
    kept = d < k[:, None]
    node = at.clamp(min=0)
    drafts = torch.where(kept, tokens.long().gather(1, node), -1)
    target = torch.cat([best[:, :1].long(), torch.where(kept, best.long().gather(1, node + 1), 0)], 1)
    path = torch.where(kept, node + 1, d + 1)
    return drafts, target, path, k


def _check_keep(k_cache, v_cache, rows, cache_lens, path, k) -> None:
    if k_cache.dim() != 5 or v_cache.shape != k_cache.shape:
        raise ValueError("the caches must be [layers, slots, kv_heads, max_len, head_dim], K and V alike")
    B = rows.shape[0]
    if cache_lens.shape != (B,) or k.shape != (B,) or path.dim() != 2 or path.shape[0] != B:
        raise ValueError("rows, cache_lens and k [B], path [B, D]")
    if k_cache.stride(4) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("the caches need contiguous rows and the same strides")


def keep_path(k_cache, v_cache, rows, cache_lens, path, k) -> None:
    """Move every row's accepted path into place in both caches, in place; see the module docstring.

    k_cache, v_cache [layers, P, KV, max_len, head_dim]; rows [B] (slot per row), cache_lens [B] (the root's
    cache row), path [B, D] (segment token index of the d-th accepted node), k [B] (accepted nodes)."""
    require_triton("keep_path")
    _check_keep(k_cache, v_cache, rows, cache_lens, path, k)
    B, D = path.shape
    layers, _, KV, _, HD = k_cache.shape
    if B == 0 or D == 0:
        return
    kernel = launcher(_keep_path_kernel, k_cache.device)
    kernel[(B, layers * KV)](
        k_cache, v_cache, rows, cache_lens, path, k, KV, D, HD,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), path.stride(0),
        BLOCK_HD=max(2, triton.next_power_of_2(HD)), num_warps=1,
    )


def keep_path_ref(k_cache, v_cache, rows, cache_lens, path, k) -> None:
    """keep_path in torch: every source row gathered, then written (past k a row is written onto itself)."""
    _check_keep(k_cache, v_cache, rows, cache_lens, path, k)
    B, D = path.shape
    if B == 0 or D == 0:
        return
    d = torch.arange(D, device=path.device)
    c = cache_lens.long()[:, None]
    dst = c + 1 + d  # [B, D]
    src = torch.where(d < k.long()[:, None], c + path.long(), dst)
    s = rows.long()[:, None].expand(B, D)
    for t in (k_cache, v_cache):
        t[:, s, :, dst] = t[:, s, :, src]  # [B, D, layers, KV, head_dim] gathered before any is written
