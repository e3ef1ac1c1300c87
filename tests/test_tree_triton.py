"""Token-tree segments on the Triton kernels (spin_kernels; on CPU under the interpreter, slow: shapes stay tiny).

varlen_attention with a tree mask against its reference and the runtime's attention_ref, and the packed forward of
a LlamaModel on the Triton kernels: every node of a tree verified in one forward gets the logits of a plain forward
of its root-to-node path (test_tree_attention.py checks the same on the torch and C paths).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not importable")

from spin_kernels import varlen_attention, varlen_attention_ref  # noqa: E402
from spin_kernels.varlen_attention import trees_from_mask  # noqa: E402
from test_tree_attention import TREE, WIDE, Batch, plain_last_logits  # noqa: E402

from spin_batch.models import cpu_decoder, cuda_graphs, execution  # noqa: E402
from spin_batch.models.attention import attention_ref  # noqa: E402
from spin_batch.models.execution import Execution  # noqa: E402
from spin_batch.models.loader import load_model  # noqa: E402
from spin_batch.models.segments import Segments  # noqa: E402

if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET"):
    DEVICE = torch.device("cuda")
elif os.environ.get("TRITON_INTERPRET"):
    DEVICE = torch.device("cpu")
else:
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

BIG = [-1] + [(k - 1) // 2 for k in range(1, 64)]  # a binary tree of 64 tokens: bit 63 in use
ATOL = 1e-4  # float32: the kernel's dots against torch's, only the summation order differs


def _inputs(parts, parents, H=4, KV=2, D=16, dtype=torch.float32, seed=0, max_len=80):
    """(q, cache_k, cache_v, slots, starts, cache_lens, longest), the tree mask, and the Segments.

    The new tokens' K/V are already at their rows; rows past each slot's cache_len + n hold NaN, so a key read
    beyond them poisons the output."""
    g = torch.Generator().manual_seed(seed)
    seg = Segments.build(parts, parents=parents)
    slots = max(seg.slots) + 1
    ck = torch.full((slots, KV, max_len, D), float("nan"))  # [slots, KV, max_len, D]
    cv = torch.full((slots, KV, max_len, D), float("nan"))
    for slot, n, c in parts:
        ck[slot, :, : c + n] = torch.randn(KV, c + n, D, generator=g)
        cv[slot, :, : c + n] = torch.randn(KV, c + n, D, generator=g)
    q = torch.randn(seg.num_tokens, H, D, generator=g)  # [N, H, D]
    to = dict(device=DEVICE)
    args = (q.to(dtype=dtype, **to), ck.to(dtype=dtype, **to), cv.to(dtype=dtype, **to),
            torch.tensor(seg.slots, **to), torch.tensor(seg.starts, **to), torch.tensor(seg.cache_lens, **to),
            max(seg.lengths(), default=0))
    mask = cpu_decoder.tree_bits(parents, seg.lengths()).to(DEVICE)  # [N] int64
    return args, mask, seg


# decode, a verify run, a small tree at cache_len 0 (the root is key 0), a prefill chunk, a 20-token tree past
# SHORT_SEGMENT, an empty segment, and a tree that crosses the 32/64-key block edges
MIXED = ([(0, 1, 10), (1, 4, 6), (2, len(TREE), 0), (3, 9, 0), (4, len(WIDE), 5), (5, 0, 3), (6, len(TREE), 58)],
         [None, None, TREE, None, WIDE, None, TREE])


@pytest.mark.parametrize("H,KV", [(4, 2), (2, 1)])
def test_kernel_matches_references_with_trees(H, KV):
    args, mask, seg = _inputs(*MIXED, H=H, KV=KV, seed=H)
    out = varlen_attention(*args, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, varlen_attention_ref(*args, mask), atol=ATOL, rtol=0)
    torch.testing.assert_close(out.cpu(), attention_ref(*(t.cpu() for t in args[:3]), seg), atol=ATOL, rtol=0)
    # the ordinary segments equal a run with no mask at all; the tree rows do not (the mask is read)
    plain = varlen_attention(*args)
    tree_rows = torch.tensor([seg.is_tree(s) for s in range(seg.num_segments) for _ in range(seg.lengths()[s])])
    torch.testing.assert_close(out[~tree_rows], plain[~tree_rows], atol=0, rtol=0)
    assert (out[tree_rows] - plain[tree_rows]).abs().max() > 1e-2


def test_reference_with_trees_is_the_runtimes_attention_ref():
    """spin_kernels' own reference (it imports nothing of spin_batch) gives attention_ref's output bit for bit."""
    args, mask, seg = _inputs(*MIXED, seed=3)
    ref = varlen_attention_ref(*args, mask).cpu()
    torch.testing.assert_close(ref, attention_ref(*(t.cpu() for t in args[:3]), seg), atol=0, rtol=0)


def test_kernel_with_a_64_token_tree_and_bfloat16():
    parts, parents = [(0, 2, 7), (1, len(BIG), 4)], [None, BIG]
    args, mask, seg = _inputs(parts, parents, H=2, KV=1, D=16, dtype=torch.bfloat16, seed=7)
    assert mask[-1].item() < 0  # token 63's own bit is the sign bit
    out = varlen_attention(*args, mask)
    ref = attention_ref(*(t.cpu().float() for t in args[:3]), seg)
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=1e-2)


def test_a_wrong_mask_moves_the_output():
    """The kernel's comparison can fail: a causal mask in place of the tree's gives other outputs, and one
    ancestor bit dropped moves exactly that row."""
    args, mask, seg = _inputs([(0, len(TREE), 6)], [TREE])
    out = varlen_attention(*args, mask)
    causal = torch.tensor([(2 << i) - 1 for i in range(len(TREE))], dtype=torch.long, device=DEVICE)
    assert (varlen_attention(*args, causal) - out).abs().max() > 1e-2
    dropped = mask.clone()
    dropped[10] &= ~(1 << 4)  # token 10's ancestor 4
    moved = (varlen_attention(*args, dropped) - out).abs().amax(dim=(1, 2)) > 1e-6  # [N]
    assert moved.nonzero().flatten().tolist() == [10]


def test_reference_reads_the_trees_back_and_refuses_other_masks():
    seg = Segments.build(*MIXED[:1], parents=MIXED[1])
    bits = cpu_decoder.tree_bits(seg.parents, seg.lengths()).tolist()
    assert trees_from_mask(bits, seg.starts) == MIXED[1]
    big_bits = cpu_decoder.tree_bits([BIG], [64]).tolist()
    assert trees_from_mask(big_bits, [0, 64]) == [BIG]
    n = len(TREE)
    for bad in ([(2 << i) - 1 for i in range(n - 1)] + [0],  # one token of a tree with no mask
                [1 << i for i in range(n)],  # no ancestors
                [b & ~1 for b in bits[:n]]):  # the root's bit missing everywhere
        with pytest.raises(ValueError, match="not the ancestor-and-self masks"):
            trees_from_mask(bad, [0, n])
    with pytest.raises(ValueError, match="at most 64"):
        trees_from_mask([1] * 65, [0, 65])


def test_kernel_rejects_bad_masks():
    args, mask, _ = _inputs([(0, len(TREE), 6)], [TREE])
    with pytest.raises(TypeError, match="int64"):
        varlen_attention(*args, mask.int())
    with pytest.raises(ValueError, match="tree_mask"):
        varlen_attention(*args, mask[:-1])


# -- the forward on the Triton kernels ------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_model(tiny_dir):
    return load_model(tiny_dir, plan=execution.forced("torch"))


@pytest.fixture(scope="module")
def triton_model(tiny_dir):
    if DEVICE.type != "cpu":
        pytest.skip("test_tree_attention.Batch builds its inputs on the CPU: these run under the interpreter")
    m = load_model(tiny_dir, device=DEVICE, plan=execution.forced("torch"),
                   execution=Execution(kernels="triton", cpu="torch", triton=True))
    assert m.kernels is not None
    return m


@pytest.mark.parametrize("parents", [TREE, WIDE, [-1, 0, 1, 2]], ids=["tree", "wide", "chain"])
def test_triton_tree_forward_matches_each_root_to_node_path(triton_model, torch_model, parents):
    batch = Batch(triton_model, parents)
    logits = batch.run(triton_model).cpu()
    for node in range(len(parents)):
        expected = plain_last_logits(torch_model, batch.node_seq(node))
        torch.testing.assert_close(logits[batch.tree_rows[node]], expected, atol=ATOL, rtol=0)
    for slot, row in ((0, 2), (3, len(logits) - 1)):
        torch.testing.assert_close(logits[row], plain_last_logits(torch_model, batch.others[slot]), atol=ATOL, rtol=0)


def test_triton_tree_forward_writes_rows_not_positions(triton_model, torch_model):
    """The K/V of the tree's tokens land at rows cache_len + i (the torch path's rows), not at their depths."""
    caches = {}
    for name, m in (("triton", triton_model), ("torch", torch_model)):
        batch = Batch(m, TREE)
        batch.run(m)
        caches[name] = batch.cache
    rows = slice(batch.cache_len, batch.cache_len + len(TREE))  # slot 1's tree
    for part in ("k", "v"):
        ours, expected = getattr(caches["triton"], part), getattr(caches["torch"], part)  # [L, slots, KV, len, D]
        torch.testing.assert_close(ours[:, 1, :, rows].cpu(), expected[:, 1, :, rows], atol=ATOL, rtol=0)


def test_triton_refuses_trees_over_64_tokens(triton_model):
    chain = list(range(-1, 64))  # 65 tokens
    seg = Segments.build([(0, len(chain), 0)], parents=[chain], device=DEVICE)
    cache = triton_model.allocate_cache(slots=1, max_len=80)
    with pytest.raises(NotImplementedError, match="Triton attention take token trees of at most 64"):
        triton_model.forward(torch.zeros(len(chain), dtype=torch.long, device=DEVICE), seg, cache)


def test_cuda_graphs_leave_tree_forwards_eager():
    """A graph carries no rows or tree mask: a tree forward must run eagerly, even a shape seen often enough to be
    captured (capture_after=1 captures at first sight; a capture here would fail: there is no model)."""
    graphs = cuda_graphs.StepGraphs(model=None, capture_after=1)
    seg = Segments.build([(0, len(TREE), 4), (1, 1, 3)], parents=[TREE, None])
    assert graphs.hidden(torch.zeros(seg.num_tokens, dtype=torch.long), seg, cache=None, num_layers=1) is None
    assert not graphs.graphs
