"""Triton kernels against their torch references.

Runs on CUDA tensors when a GPU is present and TRITON_INTERPRET is unset (scripts/gpu_check.sh);
otherwise on CPU tensors under the Triton interpreter, which is slow: sizes here stay small.
"""

import os

import torch  # torch does not import triton

ON_GPU = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not importable")

from spin_batch.sampling import SamplingParams, probs_from_logits  # noqa: E402
from spin_batch.engine.verify import accept_fused, accept_greedy, accept_ref  # noqa: E402
from spin_kernels import (  # noqa: E402
    accept,
    kv_write,
    kv_write_ref,
    problem,
    triton_available,
    varlen_attention,
    varlen_attention_ref,
)
from spin_batch.models.attention import attention_ref  # noqa: E402
from spin_batch.models.cache import KVCache  # noqa: E402
from spin_batch.models.segments import Segments  # noqa: E402

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
ROOT = Path(__file__).resolve().parent.parent

# fp32: both sides compute in fp32 (the kernel's dots in ieee fp32), so only summation order differs.
# bf16/fp16: both sides round the output to 8 (11) mantissa bits and the GPU kernel rounds the
# softmax weights to bf16/fp16 before P @ V; outputs reach |o| ~ 4, where one bf16 ulp is 0.0156,
# hence atol 2e-2 plus rtol 1e-2 (fp16: 5e-3 and 5e-3).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- varlen attention ------------------------------------------------------------------------

MAX_LEN = 80
# (slot, new tokens, cache_len): empty segments first, middle and last; cache_len 0; cache_len + n
# == MAX_LEN; odd lengths 1, 3, 7, 13; a 13-token chunk and others that cross the 64-key block edge.
PARTS = [
    (5, 0, 7),
    (2, 1, 0),
    (0, 3, 45),
    (1, 7, 73),
    (4, 13, 0),
    (3, 1, 79),
    (7, 5, 60),
    (8, 13, 67),
    (6, 0, 0),
]
NUM_SLOTS = 9


def _attention_inputs(parts, H, KV, D, dtype, seed=0, index_dtype=torch.int32, q_strided=False):
    g = _gen(seed)
    # NaN everywhere a slot holds no valid K/V: reading past a slot's length would poison the output
    ck = torch.full((NUM_SLOTS, KV, MAX_LEN, D), float("nan"))  # [slots, KV, max_len, D]
    cv = torch.full((NUM_SLOTS, KV, MAX_LEN, D), float("nan"))
    for slot, n, c in parts:
        ck[slot, :, : c + n] = torch.randn(KV, c + n, D, generator=g)
        cv[slot, :, : c + n] = torch.randn(KV, c + n, D, generator=g)
    seg = Segments.build(list(parts))
    N = seg.num_tokens
    if q_strided:  # q as a view into a fused qkv projection, like llama's split
        qkv = torch.randn(N, (H + 2 * KV) * D, generator=g).to(device=DEVICE, dtype=dtype)
        q = qkv[:, : H * D].view(N, H, D)
    else:
        q = torch.randn(N, H, D, generator=g).to(device=DEVICE, dtype=dtype)  # [N, H, D]
    to = dict(device=DEVICE)
    tensors = (
        q,
        ck.to(dtype=dtype, **to),
        cv.to(dtype=dtype, **to),
        torch.tensor(seg.slots, dtype=index_dtype, **to),
        torch.tensor(seg.starts, dtype=index_dtype, **to),
        torch.tensor(seg.cache_lens, dtype=index_dtype, **to),
        max(seg.lengths(), default=0),
    )
    return tensors, seg


@pytest.mark.parametrize("H,KV", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_varlen_attention_matches_ref(H, KV, D, dtype):
    args, _ = _attention_inputs(PARTS, H, KV, D, dtype, seed=H * 100 + KV * 10 + D)
    out = varlen_attention(*args)
    ref = varlen_attention_ref(*args)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_varlen_attention_odd_head_dim_int64_strided_q(dtype):
    # head_dim 24 (padded to 32 inside), int64 segment tensors, q a strided view
    args, _ = _attention_inputs(PARTS, 6, 2, 24, dtype, seed=7, index_dtype=torch.int64, q_strided=True)
    assert not args[0].is_contiguous()
    torch.testing.assert_close(varlen_attention(*args).float(), varlen_attention_ref(*args).float(), **TOL[dtype])


def test_varlen_attention_half_precision_dot_path(monkeypatch):
    """The GPU path for bf16/fp16 (dots on half inputs, softmax weights cast to the input dtype),
    run under the interpreter with fp16, whose numpy matmul is sound (bf16's is not)."""
    mod = importlib.import_module("spin_kernels.varlen_attention")
    monkeypatch.setattr(mod, "is_interpreted", lambda kernel: False)
    args, _ = _attention_inputs(PARTS, 6, 2, 32, torch.float16, seed=5)
    torch.testing.assert_close(varlen_attention(*args).float(), varlen_attention_ref(*args).float(),
                               **TOL[torch.float16])


def test_varlen_attention_ref_matches_llama_attention_ref():
    args, seg = _attention_inputs(PARTS, 4, 2, 16, torch.float32, seed=3)
    q, ck, cv = args[:3]
    seg.device = DEVICE
    torch.testing.assert_close(varlen_attention_ref(*args), attention_ref(q, ck, cv, seg), atol=0, rtol=0)


def test_varlen_attention_decode_only_and_empty_batches():
    # a pure decode batch (every segment 1 token) in one launch
    parts = [(s, 1, c) for s, c in zip(range(NUM_SLOTS), [0, 1, 5, 63, 64, 65, 79, 30, 2])]
    args, _ = _attention_inputs(parts, 4, 2, 32, torch.float32, seed=11)
    torch.testing.assert_close(varlen_attention(*args), varlen_attention_ref(*args), **TOL[torch.float32])
    # only empty segments: nothing to compute
    args, _ = _attention_inputs([(0, 0, 3), (1, 0, 0)], 4, 2, 32, torch.float32)
    assert varlen_attention(*args).shape == (0, 4, 32)
    # no segments at all
    args, _ = _attention_inputs([], 4, 2, 32, torch.float32)
    assert varlen_attention(*args).shape == (0, 4, 32)


def test_varlen_attention_rejects_bad_inputs():
    args, _ = _attention_inputs(PARTS[:3], 4, 2, 16, torch.float32)
    q, ck, cv, slots, starts, lens, m = args
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q[:, :3], ck, cv, slots, starts, lens, m)
    with pytest.raises(TypeError, match="dtype"):
        varlen_attention(q.double(), ck, cv, slots, starts, lens, m)
    with pytest.raises(TypeError, match="int32 or int64"):
        varlen_attention(q, ck, cv, slots.float(), starts, lens, m)
    with pytest.raises(ValueError, match="seg_starts"):
        varlen_attention(q, ck, cv, slots, starts[:-1], lens, m)
    with pytest.raises(ValueError, match="head_dim"):
        big = torch.zeros(1, 1, 512, device=DEVICE)
        varlen_attention(big, torch.zeros(1, 1, 4, 512, device=DEVICE), torch.zeros(1, 1, 4, 512, device=DEVICE),
                         slots[:1], starts[:2], lens[:1], 1)


# -- kv write --------------------------------------------------------------------------------


@pytest.mark.parametrize("KV,D", [(1, 16), (2, 32), (3, 24), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_write_matches_ref(KV, D, dtype):
    g = _gen(KV * 100 + D)
    layers, slots, max_len = 2, 5, 12
    cache = KVCache.allocate(layers, slots, KV, max_len, D, dtype, DEVICE)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    ref = KVCache(cache.k.clone(), cache.v.clone())
    seg = Segments.build([(3, 1, 0), (0, 3, 9), (4, 0, 2), (1, 7, 5), (2, 1, 11)], device=DEVICE)  # pos 0 .. 11
    N = seg.num_tokens
    qkv = torch.randn(N, (4 + 2 * KV) * D, generator=g).to(device=DEVICE, dtype=dtype)
    k = qkv[:, 4 * D : (4 + KV) * D].view(N, KV, D)  # strided views, as split from a fused qkv
    v = qkv[:, (4 + KV) * D :].view(N, KV, D)
    positions = seg.positions.to(torch.int32)
    kv_write(cache.k[1], cache.v[1], seg.token_slots, positions, k, v)
    kv_write_ref(ref.k[1], ref.v[1], seg.token_slots, positions, k, v)
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
    # and the same as KVCache.write
    ref.write(0, ref.rows(seg.token_slots, seg.positions), k, v)
    kv_write(cache.k[0], cache.v[0], seg.token_slots, seg.positions, k, v)
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)


def test_kv_write_rejects_bad_inputs():
    ck = torch.zeros(2, 2, 4, 16, device=DEVICE)
    k = torch.zeros(3, 2, 16, device=DEVICE)
    idx = torch.zeros(3, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="dtype"):
        kv_write(ck, ck, idx, idx, k.bfloat16(), k.bfloat16())
    with pytest.raises(ValueError, match=r"\[N, 2, 16\]"):
        kv_write(ck, ck, idx, idx, k[:, :1], k[:, :1])
    with pytest.raises(ValueError, match="rows"):
        kv_write(ck, ck, idx, idx[:2], k, k)
    kv_write(ck, ck, idx[:0], idx[:0], k[:0], k[:0])  # no tokens: a no-op


# -- acceptance ------------------------------------------------------------------------------

GAMMAS = [0, 1, 2, 3, 4, 5, 3, 0, 5, 2]  # a mixed batch: plain decode rows and verify runs


def _accept_inputs(seed, V=97, gammas=GAMMAS, agree=0.75, ties=False, with_q=False, logits_dtype=torch.float32):
    g = _gen(seed)
    S, T = len(gammas), sum(gammas)
    R = T + S
    if ties:  # few distinct values: argmax ties everywhere
        logits = torch.randint(0, 3, (R, V), generator=g).float()
    else:
        logits = torch.randn(R, V, generator=g) * 2.0
    logits = logits.to(logits_dtype)
    best = logits.float().argmax(-1)
    d_off, r_off, drafts = [0], [0], []
    for s, gam in enumerate(gammas):
        for j in range(gam):
            if torch.rand((), generator=g) < agree:
                drafts.append(int(best[r_off[s] + j]))
            else:
                drafts.append(int(torch.randint(0, V, (), generator=g)))
        d_off.append(d_off[-1] + gam)
        r_off.append(r_off[-1] + gam + 1)
    q = None
    if with_q:
        q = torch.softmax(torch.randn(T, V, generator=g) * 2.0, -1)  # [T, V]
        # make the drafts likely under q, as a real drafter's samples would be
        for t, x in enumerate(drafts):
            q[t, x] += 0.5
        q = q / q.sum(-1, keepdim=True)
        q = q.to(DEVICE)
    u = torch.rand(T, generator=g).to(DEVICE)  # [T]
    u2 = torch.rand(S, generator=g).to(DEVICE)  # [S]
    to = dict(device=DEVICE)
    return dict(
        target_logits=logits.to(**to),
        draft_tokens=torch.tensor(drafts, dtype=torch.int64, **to),
        draft_offsets=torch.tensor(d_off, dtype=torch.int32, **to),
        row_offsets=torch.tensor(r_off, dtype=torch.int64, **to),
        draft_probs=q,
        u=u,
        u2=u2,
    ), [drafts[a:b] for a, b in zip(d_off[:-1], d_off[1:])]


def _assert_same(got, want):
    assert got[0].tolist() == want[0].tolist(), "accepted"
    assert got[1].tolist() == want[1].tolist(), "next_token"


@pytest.mark.parametrize("seed,ties,logits_dtype", [(0, False, torch.float32), (1, True, torch.float32),
                                                    (2, False, torch.bfloat16)])
def test_accept_greedy_matches_ref_and_verify(seed, ties, logits_dtype):
    kw, drafts = _accept_inputs(seed, ties=ties, agree=0.85, logits_dtype=logits_dtype)
    got = accept(**kw)
    _assert_same(got, accept_ref(**kw))
    verdict = accept_greedy(kw["target_logits"], drafts)
    assert got[0].tolist() == verdict.accepted
    assert got[1].tolist() == [t[-1] for t in verdict.tokens]
    assert any(a == len(d) and len(d) > 0 for a, d in zip(verdict.accepted, drafts)), "want a full accept"
    assert any(a < len(d) for a, d in zip(verdict.accepted, drafts)), "want a rejection"


@pytest.mark.parametrize("with_q", [False, True], ids=["no_q", "q"])
@pytest.mark.parametrize("seed,temperature", [(0, 1.0), (1, 0.7), (2, 1.5)])
def test_accept_sampling_matches_ref(seed, temperature, with_q):
    kw, _ = _accept_inputs(seed + 10, with_q=with_q, agree=0.9)
    got = accept(**kw, temperature=temperature)
    _assert_same(got, accept_ref(**kw, temperature=temperature))


def test_accept_sampling_edge_cases():
    kw, drafts = _accept_inputs(21, V=64, with_q=True, agree=1.0)
    T, S = kw["u"].numel(), kw["u2"].numel()
    q, logits = kw["draft_probs"], kw["target_logits"]
    d_off, r_off = kw["draft_offsets"].tolist(), kw["row_offsets"].tolist()
    # segment 1: p == q == one-hot at the draft (exact on both sides) and u = 1.0, so the draft is
    # rejected with no residual mass left: the draw falls back to p, i.e. the draft token itself
    x1 = drafts[1][0]
    logits[r_off[1]] = float("-inf")
    logits[r_off[1], x1] = 0.0
    q[d_off[1]] = 0.0
    q[d_off[1], x1] = 1.0
    kw["u"][d_off[1]] = 1.0
    # segment 2: q[x] == 0 at its first draft: always rejected
    x = drafts[2][0]
    q[d_off[2], x] = 0.0
    q[d_off[2]] /= q[d_off[2]].sum()
    # u2 at the ends of [0, 1)
    kw["u2"][0] = 0.0
    kw["u2"][S - 1] = 1.0 - 2.0**-24
    kw["u"][T - 1] = 0.0  # always accepted where q[x] > 0
    got = accept(**kw, temperature=1.0)
    _assert_same(got, accept_ref(**kw, temperature=1.0))
    assert (got[0][1].item(), got[1][1].item()) == (0, x1)
    assert got[0][2].item() == 0


def test_accept_top_k_top_p_via_log_probs():
    kw, _ = _accept_inputs(31, V=50, with_q=False, agree=0.5)
    sp = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    kw["target_logits"] = probs_from_logits(kw["target_logits"], sp).log()  # -inf where filtered
    got = accept(**kw, temperature=1.0)
    _assert_same(got, accept_ref(**kw, temperature=1.0))
    allowed = torch.isfinite(kw["target_logits"])
    rows = kw["row_offsets"][:-1] + got[0]  # the row each next token was drawn from
    assert allowed[rows, got[1]].all(), "a filtered token was drawn"


def test_accept_ref_is_a_speculative_sampler():
    """Statistical check of the reference's rule (the kernel equals it draw for draw, above):
    draft x ~ q, then accept/recover; the first emitted token must be distributed as p."""
    g = _gen(5)
    V, draws = 6, 4000
    logits = torch.randn(2, V, generator=g)
    q_row = torch.softmax(torch.randn(V, generator=g), -1)
    p = torch.softmax(logits[0], -1)
    xs = torch.multinomial(q_row, draws, replacement=True, generator=g)  # [draws] one draft each
    acc, nxt = accept_ref(
        logits.repeat(draws, 1),  # [2 draws, V]
        xs,
        torch.arange(draws + 1),
        torch.arange(0, 2 * draws + 1, 2),
        q_row.expand(draws, V),
        torch.rand(draws, generator=g),
        torch.rand(draws, generator=g),
        1.0,
    )
    first = torch.where(acc == 1, xs, nxt)
    freq = torch.bincount(first, minlength=V).float() / draws
    assert (freq - p).abs().max() < 4 * (0.25 / draws) ** 0.5


def test_accept_no_segments_and_bad_inputs():
    kw, _ = _accept_inputs(0, gammas=[])
    acc, nxt = accept(**kw)
    assert acc.shape == (0,) and nxt.shape == (0,)
    kw, _ = _accept_inputs(0)
    with pytest.raises(ValueError, match="u is required"):
        accept(**{**kw, "u": None}, temperature=1.0)
    with pytest.raises(ValueError, match="draft_probs"):
        accept(**{**kw, "draft_probs": torch.zeros(3, 3, device=DEVICE)}, temperature=1.0)


# -- the loop's fused accept (engine.verify.accept_fused) --------------------------------------


@pytest.mark.parametrize("ties", [False, True])
def test_accept_fused_greedy_equals_accept_greedy(ties):
    import spin_kernels as K

    kw, drafts = _accept_inputs(40 + ties, ties=ties, agree=0.85)
    want = accept_greedy(kw["target_logits"], drafts)
    got = accept_fused(K, kw["target_logits"], drafts, None, [None] * len(drafts), [SamplingParams()] * len(drafts))
    assert got == want
    assert any(a == len(d) and len(d) > 0 for a, d in zip(want.accepted, drafts))
    assert any(a < len(d) for a, d in zip(want.accepted, drafts))


@pytest.mark.parametrize("sp", [SamplingParams(1.0), SamplingParams(0.8, top_k=4)], ids=["plain", "top_k"])
def test_accept_fused_sampling_is_exact(sp):
    """One launch over many one-token drafts, alternately with q (a model draft) and without (an
    n-gram draft, q one-hot inside accept_fused): the first new token of each must be
    distributed as the target's p, whatever q was (the drafts are drawn from q, or fixed)."""
    import spin_kernels as K

    g = _gen(7)
    V, n = 6, 600  # the interpreter runs each segment's program in Python: keep n small
    logits = torch.randn(2, V, generator=g) * 1.5
    p = probs_from_logits(logits[:1], sp)[0]
    q_row = torch.softmax(torch.randn(V, generator=g), -1)
    drafts, probs = [], []
    for i in range(n):
        if i % 3 == 2:
            drafts.append([]), probs.append(None)  # a plain decode row: drawn from p
        elif i % 3 == 0:
            drafts.append([int(torch.multinomial(q_row, 1, generator=g))]), probs.append(q_row[None])
        else:
            drafts.append([2]), probs.append(None)  # deterministic
    rows = torch.cat([logits[: len(d) + 1] for d in drafts]).to(DEVICE)
    gens = [_gen(100 + i) for i in range(n)]
    v = accept_fused(K, rows, drafts, probs, gens, [sp] * n)
    assert [len(t) for t in v.tokens] == [k + 1 for k in v.accepted]
    assert all(t[: k] == d[: k] for t, k, d in zip(v.tokens, v.accepted, drafts))
    for kind in range(3):
        first = torch.tensor([v.tokens[i][0] for i in range(kind, n, 3)])
        freq = torch.bincount(first, minlength=V).float() / len(first)
        assert (freq - p).abs().max() < 4 * (0.25 / len(first)) ** 0.5, (kind, freq, p)
        assert freq[p == 0].sum() == 0, "a filtered token was drawn"
    # the same streams give the same verdicts
    m = 30
    again = accept_fused(K, rows[: sum(len(d) + 1 for d in drafts[:m])], drafts[:m], probs[:m],
                         [_gen(100 + i) for i in range(m)], [sp] * m)
    assert again.tokens == v.tokens[:m]


# -- dispatch switches -----------------------------------------------------------------------


def test_problem_says_where_the_kernels_run():
    """CUDA tensors need Triton; CPU tensors the interpreter (which this process has unless it runs
    compiled on a GPU); other devices none."""
    assert triton_available()
    assert problem("cuda") is None and problem(torch.device("cuda", 0)) is None
    assert "not on meta" in problem("meta")
    if ON_GPU:
        assert "TRITON_INTERPRET=1" in problem("cpu")
    else:
        assert problem("cpu") is None


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU import path")
def test_cpu_kernels_work_without_triton_interpret_set():
    """Without a GPU, importing spin_kernels turns the interpreter on by itself, so a job's
    target.kernels: triton resolves and runs on CPU tensors in a fresh process."""
    code = (
        "import torch\n"
        "from spin_batch.models.loader import resolve_execution\n"
        "assert resolve_execution('triton', torch.device('cpu')).triton\n"
        "import spin_kernels as K\n"
        "c = torch.zeros(2, 1, 4, 16); k = torch.ones(1, 1, 16)\n"
        "i = torch.tensor([1]); K.kv_write(c, c.clone(), i, torch.tensor([3]), k, k)\n"
        "assert c[1, 0, 3].sum().item() == 16 and c.sum().item() == 16\n"
        "assert K.problem('cpu') is None\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPIN_BATCH_KERNELS")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]


# -- the kernels compile for Hopper (no GPU needed: ptxas ships with triton) -----------------


def _have_nvidia_backend() -> bool:
    try:
        importlib.import_module("triton.backends.nvidia.compiler")
    except Exception:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _have_nvidia_backend(), reason="triton's nvidia backend is not installed")
def test_kernels_compile_for_sm90():
    """Every launch the wrappers make compiles to a cubin and fits in 160 KiB of shared memory.

    In a subprocess: this process decorated the kernels for the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # compiled mode even without a GPU
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "aot_check.py"), "--arch", "90", "--quick"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "all compiled for sm_90" in res.stdout
