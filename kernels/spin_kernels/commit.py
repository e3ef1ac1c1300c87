"""Greedy accept and commit on device-owned step state: one program per verified row, no host sync.

The state is per slot (P slots, one of them a scratch slot that padding rows point at, never live):
token history [P, L] (prompt + generated), lengths [P], prompt lengths, max_tokens, the context
limit, a stop-token table [P, K] (-1 pads it), a live flag and counters. A step verified B rows (a
padded bucket): row r is slot rows[r], with drafts [B, G] of which draft_len[r] count, and the
target's argmax tokens [B, G + 1].

Per live row (spin_batch.engine.verify's greedy rule, then engine.stopping's token cuts):
- accepted k: the longest draft prefix equal to the target's tokens; the new tokens are the
  target's tokens 0..k (the accepted drafts, then the recovered or bonus token);
- they are appended one by one; the completion ends at the first that is a stop token (finish 1,
  "stop") or that reaches max_tokens generated or the context limit (finish 2, "length"), and the
  tokens after it are dropped;
- lengths grow by the tokens kept; the live flag clears on a finish; counters [P, 3] add (drafting
  rows only) one step, the draft length, and the accepted drafts that were kept (min(k, kept)).
Rows that are not live (padding, or a slot that finished at an earlier step) change nothing.

Every row writes its slot's record [5 + W] int32: accepted, kept, finish (0 going on, 1 stop,
2 length), the new length, the drafts it verified, then the kept tokens (-1 after them). A host that reads the record
mirrors the slot's tokens without reading the history.

accept_commit_ref is the same rule in torch, at fixed shapes and with no host read either (the
device step's path where the kernel does not run).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, launcher, require_triton, tl, triton

RECORD_HEAD = 5  # accepted, kept, finish, length, drafted; the kept tokens follow
FINISH_STOP = 1
FINISH_LENGTH = 2

if HAVE_TRITON:

    @triton.jit
    def _commit_kernel(
        rows_ptr,  # [B] slot of each row
        drafts_ptr,  # [B, G]
        dlen_ptr,  # [B]
        target_ptr,  # [B, G + 1]
        hist_ptr,  # [P, L] in/out
        len_ptr,  # [P] in/out
        prompt_ptr,  # [P]
        maxtok_ptr,  # [P]
        maxlen_ptr,  # [P]
        stops_ptr,  # [P, K]
        live_ptr,  # [P] in/out
        cnt_ptr,  # [P, 3] in/out
        rec_ptr,  # [P, 5 + W] out
        G, L, K, W,
        stride_d, stride_t, stride_h, stride_s, stride_c, stride_r,
        BLOCK_K: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        s = tl.load(rows_ptr + r).to(tl.int64)
        live = tl.load(live_ptr + s)
        is_live = live != 0
        n = tl.load(len_ptr + s).to(tl.int64)
        dl = tl.where(is_live, tl.load(dlen_ptr + r).to(tl.int64), 0)

        k = n * 0  # accepted drafts (int64 zero)
        going = is_live
        for j in range(0, G):
            x = tl.load(drafts_ptr + r * stride_d + j).to(tl.int64)
            t = tl.load(target_ptr + r * stride_t + j).to(tl.int64)
            going = going & (j < dl) & (x == t)
            k += going.to(tl.int64)

        prompt = tl.load(prompt_ptr + s).to(tl.int64)
        max_tok = tl.load(maxtok_ptr + s).to(tl.int64)
        max_len = tl.load(maxlen_ptr + s).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K)
        stops = tl.load(stops_ptr + s * stride_s + offs_k, mask=offs_k < K, other=-1).to(tl.int64)
        added = n * 0
        finish = n * 0
        open_ = is_live
        for j in range(0, G + 1):
            t = tl.load(target_ptr + r * stride_t + j).to(tl.int64)
            take = open_ & (j <= k)
            tl.store(hist_ptr + s * stride_h + n + j, t.to(hist_ptr.dtype.element_ty), mask=take & (n + j < L))
            hit = tl.sum(((stops == t) & (offs_k < K)).to(tl.int32), 0) > 0
            after = n + j + 1
            over = (after - prompt >= max_tok) | (after >= max_len)
            why = tl.where(hit, 1, tl.where(over, 2, 0)).to(tl.int64)
            added = tl.where(take, n * 0 + j + 1, added)
            finish = tl.where(take, why, finish)
            open_ = take & (why == 0)

        tl.store(len_ptr + s, (n + added).to(len_ptr.dtype.element_ty))
        tl.store(live_ptr + s, tl.where(finish != 0, 0, live).to(live_ptr.dtype.element_ty))
        drafting = dl > 0
        c0 = tl.load(cnt_ptr + s * stride_c)
        c1 = tl.load(cnt_ptr + s * stride_c + 1)
        c2 = tl.load(cnt_ptr + s * stride_c + 2)
        tl.store(cnt_ptr + s * stride_c, tl.where(drafting, c0 + 1, c0))
        tl.store(cnt_ptr + s * stride_c + 1, tl.where(drafting, c1 + dl, c1))
        tl.store(cnt_ptr + s * stride_c + 2, tl.where(drafting, c2 + tl.minimum(k, added), c2))

        rec = rec_ptr + s * stride_r
        tl.store(rec, k.to(tl.int32))
        tl.store(rec + 1, added.to(tl.int32))
        tl.store(rec + 2, finish.to(tl.int32))
        tl.store(rec + 3, (n + added).to(tl.int32))
        tl.store(rec + 4, dl.to(tl.int32))
        offs_w = tl.arange(0, BLOCK_W)
        kept = tl.load(target_ptr + r * stride_t + offs_w, mask=(offs_w < added) & (offs_w <= G), other=-1)
        tl.store(rec + 5 + offs_w, kept.to(tl.int32), mask=offs_w < W)

else:
    _commit_kernel = None


def _check(rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops, live,
           counters, record) -> None:
    B, G = drafts.shape
    P, L = history.shape
    if target.shape != (B, G + 1) or rows.shape != (B,) or draft_len.shape != (B,):
        raise ValueError(f"rows [B], drafts [B, G], draft_len [B], target [B, G + 1]; got {tuple(rows.shape)}, "
                         f"{tuple(drafts.shape)}, {tuple(draft_len.shape)}, {tuple(target.shape)}")
    for name, t in (("lengths", lengths), ("prompt_lens", prompt_lens), ("max_tokens", max_tokens),
                    ("max_len", max_len), ("live", live)):
        if t.shape != (P,):
            raise ValueError(f"{name} must be [P] = [{P}], got {tuple(t.shape)}")
    if stops.dim() != 2 or stops.shape[0] != P or counters.shape != (P, 3):
        raise ValueError("stops must be [P, K] and counters [P, 3]")
    if record.dim() != 2 or record.shape[0] != P or record.shape[1] < RECORD_HEAD + G + 1 or record.dtype != torch.int32:
        raise ValueError(f"record must be int32 [P, >= {RECORD_HEAD + G + 1}], got {tuple(record.shape)} {record.dtype}")
    dev = history.device
    for t in (rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops, live,
              counters, record):
        if t.device != dev or t.dtype.is_floating_point:
            raise ValueError(f"every input must be an integer tensor on {dev}")
    for t in (drafts, target, history, stops, counters, record):
        if t.stride(1) != 1:
            raise ValueError("2-D inputs need contiguous rows")


def accept_commit(rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops, live,
                  counters, record) -> None:
    """Accept and commit every row in one launch, in place; see the module docstring.

    rows [B] (slot per row), drafts [B, G], draft_len [B], target [B, G + 1]; per slot: history
    [P, L], lengths, prompt_lens, max_tokens, max_len [P], stops [P, K], live [P], counters [P, 3];
    record [P, 5 + W] int32 (W >= G + 1).
    """
    require_triton("accept_commit")
    _check(rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops, live,
           counters, record)
    B, G = drafts.shape
    if B == 0:
        return
    K, W = stops.shape[1], record.shape[1] - RECORD_HEAD
    kernel = launcher(_commit_kernel, history.device)
    kernel[(B,)](
        rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops, live, counters,
        record, G, history.shape[1], K, W,
        drafts.stride(0), target.stride(0), history.stride(0), stops.stride(0), counters.stride(0), record.stride(0),
        BLOCK_K=max(2, triton.next_power_of_2(max(K, 1))), BLOCK_W=max(2, triton.next_power_of_2(W)),
        num_warps=1,
    )


def accept_commit_ref(rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops,
                      live, counters, record) -> None:
    """accept_commit in torch: the same rule and the same in-place writes, at fixed shapes, without a host read."""
    _check(rows, drafts, draft_len, target, history, lengths, prompt_lens, max_tokens, max_len, stops, live,
           counters, record)
    B, G = drafts.shape
    if B == 0:
        return
    L, W, dev = history.shape[1], record.shape[1] - RECORD_HEAD, history.device
    s = rows.long()
    on = live[s] != 0  # [B]
    n = lengths[s].long()  # [B]
    dl = torch.where(on, draft_len.long(), 0)
    j = torch.arange(G, device=dev)
    match = (drafts.long() == target[:, :G].long()) & (j < dl[:, None])  # [B, G]
    k = match.long().cumprod(1).sum(1)  # [B]
    tok = target.long()  # [B, G + 1]
    jj = torch.arange(G + 1, device=dev)
    hit = (tok[:, :, None] == stops[s].long()[:, None, :]).any(-1)  # [B, G + 1]
    after = n[:, None] + jj + 1
    over = (after - prompt_lens[s].long()[:, None] >= max_tokens[s].long()[:, None]) | (
        after >= max_len[s].long()[:, None])
    cut = (hit | over) & (jj <= k[:, None])
    any_cut = cut.any(1)
    last = torch.where(any_cut, cut.long().argmax(1), k)  # the last token kept
    added = torch.where(on, last + 1, 0)
    why = torch.where(hit.gather(1, last[:, None])[:, 0], FINISH_STOP, FINISH_LENGTH)
    finish = torch.where(on & any_cut, why, 0)

    pos = torch.arange(L, device=dev)
    rel = pos - n[:, None]  # [B, L]
    write = (rel >= 0) & (rel < added[:, None])
    history[s] = torch.where(write, tok.gather(1, rel.clamp(0, G)).to(history.dtype), history[s])
    lengths[s] = (n + added).to(lengths.dtype)
    live[s] = torch.where(finish != 0, 0, live[s])
    drafting = (dl > 0).long()
    counters[s] = counters[s] + (torch.stack([drafting, dl, torch.minimum(k, added)], 1) * drafting[:, None]).to(
        counters.dtype)
    w = torch.arange(W, device=dev)
    kept = torch.where(w < added[:, None], tok.gather(1, w.clamp(max=G).expand(B, W)), -1)
    record[s] = torch.cat([torch.stack([k, added, finish, n + added, dl], 1), kept], 1).to(torch.int32)
