"""Prompt-lookup drafting over a device token history: one program per row, no host sync.

Row r drafts for slot rows[r] from its history [L] of lengths[slot] tokens (prompt + generated).
The rule is spin_batch.drafters.ngram.lookup_match's: the longest suffix n-gram, n from
min(max_ngram, size - 1) down to min_ngram, that occurred earlier with at least one token after
it; among that n's occurrences the latest; the draft is the up to gamma[r] tokens that followed
it (fewer where the history ends first). With a confidence gate, keep[n] caps the draft after a
match of length n (NgramDrafter.gated's length for the drafter's current rates); pass keep >= G
everywhere for no gate.

Found in one pass over the end positions e (the first token after a candidate occurrence,
1 <= e <= size - 1): c[e] is how many tokens before e equal the suffix's last tokens (at most
max_ngram); the match is the largest c[e] >= min_ngram, the latest e on a tie, taken as the
largest key c[e] * (L + 1) + e.

Outputs: drafts [B, G] (0 past each row's count), counts [B], and the match length [B] (0: none).
ngram_draft_ref is the same in torch, without a host read.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, launcher, require_triton, tl, triton

if HAVE_TRITON:

    @triton.jit
    def _ngram_kernel(
        rows_ptr,  # [B]
        hist_ptr,  # [P, L]
        len_ptr,  # [P]
        gamma_ptr,  # [B]
        keep_ptr,  # [max_ngram + 1]
        drafts_ptr,  # [B, G] out
        counts_ptr,  # [B] out
        match_ptr,  # [B] out
        L, G, stride_h, stride_d,
        MIN_N: tl.constexpr,
        MAX_N: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_G: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        s = tl.load(rows_ptr + r).to(tl.int64)
        size = tl.load(len_ptr + s).to(tl.int64)
        g = tl.load(gamma_ptr + r).to(tl.int64)
        hist = hist_ptr + s * stride_h
        best = size * 0 - 1
        for e0 in range(0, L, BLOCK):
            e = e0 + tl.arange(0, BLOCK).to(tl.int64)
            run = (e >= 1) & (e <= size - 1)
            c = e * 0
            for u in tl.static_range(1, MAX_N + 1):
                w = tl.load(hist + e - u, mask=run & (e - u >= 0), other=-1)
                sfx = tl.load(hist + size - u, mask=size - u >= 0, other=-2)
                run = run & (e - u >= 0) & (w == sfx)
                c += run.to(tl.int64)
            key = tl.where(c >= MIN_N, c * (L + 1) + e, -1)
            best = tl.maximum(best, tl.max(key, 0))
        found = best >= 0
        n = tl.where(found, best // (L + 1), 0)
        e = tl.where(found, best % (L + 1), 0)
        keep = tl.load(keep_ptr + n).to(tl.int64)
        count = tl.where(found & (g > 0), tl.minimum(tl.minimum(g, size - e), keep), 0)
        offs = tl.arange(0, BLOCK_G)
        d = tl.load(hist + e + offs, mask=offs < count, other=0)
        tl.store(drafts_ptr + r * stride_d + offs, d.to(drafts_ptr.dtype.element_ty), mask=offs < G)
        tl.store(counts_ptr + r, count)
        tl.store(match_ptr + r, n)

else:
    _ngram_kernel = None


def _check(rows, history, lengths, gamma, keep, width, min_ngram, max_ngram) -> None:
    if history.dim() != 2 or lengths.shape != (history.shape[0],):
        raise ValueError("history must be [P, L] and lengths [P]")
    if rows.dim() != 1 or gamma.shape != rows.shape:
        raise ValueError("rows and gamma must be [B]")
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    if keep.shape != (max_ngram + 1,):
        raise ValueError(f"keep must be [max_ngram + 1] = [{max_ngram + 1}]")
    if width < 0:
        raise ValueError("width must be >= 0")
    dev = history.device
    for t in (rows, history, lengths, gamma, keep):
        if t.device != dev or t.dtype.is_floating_point:
            raise ValueError(f"every input must be an integer tensor on {dev}")
    if history.stride(1) != 1:
        raise ValueError("history needs contiguous rows")


def ngram_draft(rows, history, lengths, gamma, keep, width: int, min_ngram: int = 1, max_ngram: int = 3):
    """(drafts [B, width], counts [B], match length [B]) int64; see the module docstring."""
    require_triton("ngram_draft")
    _check(rows, history, lengths, gamma, keep, width, min_ngram, max_ngram)
    B, dev = rows.shape[0], history.device
    drafts = torch.zeros(B, width, dtype=torch.int64, device=dev)
    counts = torch.zeros(B, dtype=torch.int64, device=dev)
    match = torch.zeros(B, dtype=torch.int64, device=dev)
    if B == 0:
        return drafts, counts, match
    kernel = launcher(_ngram_kernel, dev)
    L = history.shape[1]
    kernel[(B,)](
        rows, history, lengths, gamma, keep, drafts, counts, match, L, width, history.stride(0), max(width, 1),
        MIN_N=min_ngram, MAX_N=max_ngram, BLOCK=min(1024, triton.next_power_of_2(L)),
        BLOCK_G=max(2, triton.next_power_of_2(max(width, 1))), num_warps=4,
    )
    return drafts, counts, match


def ngram_draft_ref(rows, history, lengths, gamma, keep, width: int, min_ngram: int = 1, max_ngram: int = 3):
    """ngram_draft in torch: [B, L, max_ngram] comparisons, no host read."""
    _check(rows, history, lengths, gamma, keep, width, min_ngram, max_ngram)
    dev, L = history.device, history.shape[1]
    hist = history[rows.long()].long()  # [B, L]
    size = lengths[rows.long()].long()[:, None]  # [B, 1]
    e = torch.arange(L, device=dev)  # [L]
    u = torch.arange(1, max_ngram + 1, device=dev)  # [M]
    sfx = hist.gather(1, (size - u).clamp(min=0))  # [B, M]: the suffix's last tokens, last first
    back = e[:, None] - u  # [L, M]
    window = hist[:, back.clamp(min=0)]  # [B, L, M]
    eq = (window == sfx[:, None, :]) & (back >= 0) & ((e >= 1) & (e[None] <= size - 1))[:, :, None]
    c = eq.long().cumprod(-1).sum(-1)  # [B, L]
    key = torch.where(c >= min_ngram, c * (L + 1) + e, -1)
    best = key.max(1).values  # [B]
    found = best >= 0
    n = torch.where(found, best // (L + 1), 0)
    at = torch.where(found, best % (L + 1), 0)
    g = gamma.long()
    count = torch.where(found & (g > 0), torch.minimum(torch.minimum(g, size[:, 0] - at), keep.long()[n]), 0)
    j = torch.arange(width, device=dev)
    drafts = torch.where(j < count[:, None], hist.gather(1, (at[:, None] + j).clamp(max=L - 1)), 0)
    return drafts, count, n
