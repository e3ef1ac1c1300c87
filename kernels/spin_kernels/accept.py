"""Fused acceptance of packed speculative drafts: one program per segment, no host sync.

Layout (as in spin_batch.engine.verify): the drafts of all S segments are one flat list
draft_tokens [T] with draft_offsets [S+1]; segment s has gamma_s = draft_offsets[s+1] -
draft_offsets[s] drafts (0 allowed) and gamma_s + 1 target rows starting at row_offsets[s].

The rule is spin_batch.engine.verify's (accepted / recovered / bonus), and its torch reference
there, verify.accept_ref, takes this kernel's arguments. Greedy (temperature == 0): the longest
draft prefix equal to the rows' argmax (first index on ties, as torch.argmax), then the argmax of
row `accepted`; no randoms are used. Sampling (temperature > 0): p = softmax(logits / temperature)
per row in fp32; verify.rejection_sample's accept test with u[i], then the recovered or bonus
token by verify's inverse CDF at the segment's u2[s] (here summed in fp32 block by block).

The randoms are inputs (u [T], u2 [S], uniform on [0, 1)), so results are reproducible and the
reference gives the same answers from the same randoms up to rounding at a decision boundary
(p/q within ~1e-6 of u, or u2 * sum within ~1e-6 of a CDF step).

Top-k / top-p: the kernel applies only temperature and softmax. To sample from
probs_from_logits(logits, sp) (temperature, then top-k/top-p), pass
target_logits = probs_from_logits(logits, sp).log() with temperature = 1.0: filtered tokens
get -inf and softmax(log p) = p. draft_probs are probabilities (rows sum to 1), already
transformed the same way.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, launcher, require_triton, tl, triton

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)

if HAVE_TRITON:

    @triton.jit
    def _row_argmax(row_ptr, V, BLOCK_V: tl.constexpr):
        """Index of the row's max, the first one on ties."""
        offs = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: max seen so far
        best_idx = offs  # per lane: first index holding it
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(row_ptr + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            better = x > best  # strict: an earlier index keeps a tie
            best_idx = tl.where(better, v0 + offs, best_idx)
            best = tl.where(better, x, best)
        m = tl.max(best, 0)
        return tl.min(tl.where(best == m, best_idx, V), 0)

    @triton.jit
    def _softmax_stats(row_ptr, V, temperature, BLOCK_V: tl.constexpr):
        """(max, sum of exp(x - max)) of x = row / temperature, in fp32."""
        offs = tl.arange(0, BLOCK_V)
        m_vec = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane running max
        z_vec = tl.zeros([BLOCK_V], tl.float32)  # per lane running sum of exp(x - m_vec)
        for v0 in range(0, V, BLOCK_V):
            x = tl.load(row_ptr + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m_vec, x)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep 0, not nan
            z_vec = z_vec * tl.exp(m_vec - m_safe) + tl.exp(x - m_safe)
            m_vec = m_new
        m = tl.max(m_vec, 0)
        z = tl.sum(z_vec * tl.exp(m_vec - m), 0)
        return m, z

    @triton.jit
    def _residual_block(row_ptr, q_row_ptr, v0, V, x_tok, m, z, temperature, mode, HAS_Q: tl.constexpr,
                        BLOCK_V: tl.constexpr):
        """One block of the distribution to draw from; mode 0: p, 1: residual after rejecting x_tok."""
        offs = v0 + tl.arange(0, BLOCK_V)
        ok = offs < V
        x = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        p = tl.exp(x - m) / z
        if HAS_Q:
            use_q = ok & ((offs * 0 + mode) == 1)  # [BLOCK_V] (a full-shape mask: the interpreter needs one)
            q = tl.load(q_row_ptr + offs, mask=use_q, other=0.0).to(tl.float32)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where((offs == x_tok) & (mode == 1), 0.0, p)
        return tl.where(ok, r, 0.0)

    @triton.jit
    def _accept_kernel(
        logits_ptr,  # [R, V]
        drafts_ptr,  # [T]
        draft_off_ptr,  # [S + 1]
        row_off_ptr,  # [S + 1]
        q_ptr,  # [T, V] draft probs (unused unless HAS_Q)
        u_ptr,  # [T] accept-test randoms (unused when GREEDY)
        u2_ptr,  # [S] next-token randoms (unused when GREEDY)
        accepted_ptr,  # [S] out
        next_ptr,  # [S] out
        stride_lr,
        stride_qt,
        V,
        temperature,
        GREEDY: tl.constexpr,
        HAS_Q: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        s = tl.program_id(0)
        d0 = tl.load(draft_off_ptr + s).to(tl.int64)
        gamma = tl.load(draft_off_ptr + s + 1).to(tl.int64) - d0
        r0 = tl.load(row_off_ptr + s).to(tl.int64)
        i = gamma * 0  # drafts accepted so far (int64 zero)

        if GREEDY:
            tok = _row_argmax(logits_ptr + r0 * stride_lr, V, BLOCK_V).to(tl.int64)
            x = tl.load(drafts_ptr + d0 + i, mask=i < gamma, other=-1).to(tl.int64)
            while x == tok:  # x is -1 past the last draft
                i += 1
                tok = _row_argmax(logits_ptr + (r0 + i) * stride_lr, V, BLOCK_V).to(tl.int64)
                x = tl.load(drafts_ptr + d0 + i, mask=i < gamma, other=-1).to(tl.int64)
            tl.store(accepted_ptr + s, i)
            tl.store(next_ptr + s, tok)
        else:
            going = gamma > 0
            while going:
                row_ptr = logits_ptr + (r0 + i) * stride_lr
                m, z = _softmax_stats(row_ptr, V, temperature, BLOCK_V)
                x = tl.load(drafts_ptr + d0 + i).to(tl.int64)
                px = tl.exp(tl.load(row_ptr + x).to(tl.float32) / temperature - m) / z
                uu = tl.load(u_ptr + d0 + i)
                if HAS_Q:
                    qx = tl.load(q_ptr + (d0 + i) * stride_qt + x).to(tl.float32)
                    ratio = px / tl.where(qx > 0.0, qx, 1.0)  # q[x] == 0 is rejected below
                    ok = (qx > 0.0) & (uu < tl.minimum(ratio, 1.0))
                else:
                    ok = uu < tl.minimum(px, 1.0)  # q[x] = 1
                i = tl.where(ok, i + 1, i)
                going = ok & (i < gamma)

            # draw the recovered (i < gamma) or bonus (i == gamma) token from row i
            row_ptr = logits_ptr + (r0 + i) * stride_lr
            q_row_ptr = q_ptr + (d0 + i) * stride_qt
            m, z = _softmax_stats(row_ptr, V, temperature, BLOCK_V)
            x_tok = tl.load(drafts_ptr + d0 + i, mask=i < gamma, other=-1).to(tl.int64)
            mode = (i < gamma).to(tl.int32)
            total = tl.sum(tl.zeros([BLOCK_V], tl.float32), 0)  # fp32 zero
            for v0 in range(0, V, BLOCK_V):
                r = _residual_block(row_ptr, q_row_ptr, v0, V, x_tok, m, z, temperature, mode, HAS_Q, BLOCK_V)
                total += tl.sum(r, 0)
            if total <= 0.0:  # the residual has no mass (p == q up to rounding): draw from p
                mode = mode * 0
                total = total * 0.0
                for v0 in range(0, V, BLOCK_V):
                    r = _residual_block(row_ptr, q_row_ptr, v0, V, x_tok, m, z, temperature, mode, HAS_Q,
                                        BLOCK_V)
                    total += tl.sum(r, 0)
            target = tl.load(u2_ptr + s) * total
            carry = total * 0.0  # cumulative mass before this block
            count = i * 0  # indices whose cumulative mass is <= target
            last = i * 0  # last index with mass
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                r = _residual_block(row_ptr, q_row_ptr, v0, V, x_tok, m, z, temperature, mode, HAS_Q, BLOCK_V)
                cs = carry + tl.cumsum(r, 0)  # nondecreasing: its max is its last entry
                count += tl.sum(((cs <= target) & (offs < V)).to(tl.int64), 0)
                last = tl.maximum(last, tl.max(tl.where(r > 0.0, offs, 0), 0).to(tl.int64))
                carry = tl.max(cs, 0)
            tl.store(accepted_ptr + s, i)
            tl.store(next_ptr + s, tl.minimum(count, last))

else:
    _accept_kernel = None


def _check_args(target_logits, draft_tokens, draft_offsets, row_offsets, draft_probs, u, u2, temperature):
    if target_logits.dim() != 2 or target_logits.dtype not in _FLOAT_DTYPES:
        raise ValueError("target_logits must be a [R, V] float tensor")
    if target_logits.stride(1) != 1:
        raise ValueError("target_logits rows must be contiguous (stride 1 along V)")
    dev = target_logits.device
    S = draft_offsets.numel() - 1
    T = draft_tokens.numel()
    for name, t, numel in (("draft_tokens", draft_tokens, T), ("draft_offsets", draft_offsets, S + 1),
                           ("row_offsets", row_offsets, S + 1)):
        if t.dtype not in _INDEX_DTYPES or t.dim() != 1 or t.numel() != numel:
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor")
        if t.device != dev or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous and on {dev}")
    if S < 0:
        raise ValueError("draft_offsets needs S + 1 >= 1 entries")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return
    if draft_probs is not None:
        if draft_probs.dim() != 2 or draft_probs.shape != (T, target_logits.shape[1]):
            raise ValueError(f"draft_probs must be [T, V] = [{T}, {target_logits.shape[1]}]")
        if draft_probs.dtype not in _FLOAT_DTYPES or draft_probs.device != dev or draft_probs.stride(1) != 1:
            raise ValueError(f"draft_probs must be a float tensor on {dev} with contiguous rows")
    for name, t, numel in (("u", u, T), ("u2", u2, S)):
        if t is None:
            raise ValueError(f"{name} is required when temperature > 0")
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != numel or t.device != dev or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D float32 tensor of {numel} entries on {dev}")


def accept(
    target_logits: torch.Tensor,  # [R, V] target logits, segments' rows end to end
    draft_tokens: torch.Tensor,  # [T] int32/int64 drafts of all segments end to end
    draft_offsets: torch.Tensor,  # [S + 1] int32/int64
    row_offsets: torch.Tensor,  # [S + 1] int32/int64: first target row of each segment
    draft_probs: torch.Tensor | None = None,  # [T, V] q, or None for deterministic drafts
    u: torch.Tensor | None = None,  # [T] float32 uniforms for the accept tests (sampling only)
    u2: torch.Tensor | None = None,  # [S] float32 uniforms for the next-token draw (sampling only)
    temperature: float = 0.0,  # 0: greedy
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [S] int64, next_token [S] int64
    """Accept or reject every segment's drafts in one launch; see the module docstring."""
    require_triton("accept")
    _check_args(target_logits, draft_tokens, draft_offsets, row_offsets, draft_probs, u, u2, temperature)
    dev = target_logits.device
    S = draft_offsets.numel() - 1
    accepted = torch.empty(S, dtype=torch.int64, device=dev)
    next_token = torch.empty(S, dtype=torch.int64, device=dev)
    if S == 0:
        return accepted, next_token
    V = target_logits.shape[1]
    greedy = temperature == 0
    has_q = not greedy and draft_probs is not None
    dummy = draft_tokens  # placeholder pointer for unused inputs
    kernel = launcher(_accept_kernel, dev)
    kernel[(S,)](
        target_logits, draft_tokens, draft_offsets, row_offsets,
        draft_probs if has_q else target_logits,
        u if not greedy else dummy,
        u2 if not greedy else dummy,
        accepted, next_token,
        target_logits.stride(0), draft_probs.stride(0) if has_q else 0,
        V, float(temperature) if not greedy else 1.0,
        GREEDY=greedy, HAS_Q=has_q, BLOCK_V=min(2048, triton.next_power_of_2(V)),
        num_warps=4,
    )
    return accepted, next_token
