"""Token-tree segments in the packed forward, torch and C paths (the Triton kernels' trees: test_tree_triton.py, which
reuses Batch from here; trees through the loop: test_tree_loop.py).

Every node of a tree verified in one forward must get the logits of a plain forward of its root-to-node path;
after KVCache.keep_path, a plain decode step continuing the accepted path must get the logits of a plain forward
of the whole accepted sequence.
"""

from __future__ import annotations

import pytest
import torch

from spin_batch.models import cpu_decoder, execution
from spin_batch.models.attention import AttentionPlan, attention, attention_ref
from spin_batch.models.loader import load_model
from spin_batch.models.segments import Segments, ancestor_mask, tree_depths

ATOL = 1e-5  # float32, same weights: only the summation order differs

# Branching at depths 0, 1, 2 and 3: root 0; children 1, 2, 3; 1 -> 4, 5; 2 -> 6; 4 -> 7, 8; 6 -> 9;
# 7 -> 10; 3 -> 11.
TREE = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 7, 3]
# A wide tree past SHORT_SEGMENT tokens (attention.py): root with 6 children, each with 2 children, then one more level.
WIDE = [-1] + [0] * 6 + [1 + k // 2 for k in range(12)] + [7 + k for k in range(4)]


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, plan=execution.forced("torch"))


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def plain_last_logits(model, seq: list[int]) -> torch.Tensor:
    """[V]: logits after seq, from one ordinary prefill on a fresh cache."""
    cache = model.allocate_cache(slots=1, max_len=64)
    return model.forward(torch.tensor(seq), Segments.build([(0, len(seq), 0)]), cache, logits_rows=[len(seq) - 1])[0]


def path_to(parents: list[int], node: int) -> list[int]:
    """Segment indices from the root's first child down to node (the root excluded)."""
    out = []
    while node > 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


class Batch:
    """A packed verify forward: slot 1 holds a tree over a committed prefix, slots 0 and 3 ordinary segments."""

    def __init__(self, model, parents: list[int], seed: int = 0):
        V = model.spec.vocab_size
        self.parents = parents
        self.committed = ids(9, seed, V)  # the slot's committed tokens; the last one is the tree's root
        self.tree = [self.committed[-1]] + ids(len(parents) - 1, seed + 1, V)
        self.others = {0: ids(7, seed + 2, V), 3: ids(5, seed + 3, V)}  # seqs; their last 3 and 1 tokens are new
        self.new = {0: 3, 3: 1}
        self.cache = model.allocate_cache(slots=4, max_len=64)
        pre = [(1, self.committed[:-1])] + [(s, q[: len(q) - self.new[s]]) for s, q in self.others.items()]
        model.forward(torch.tensor(sum((q for _, q in pre), [])), Segments.build([(s, len(q), 0) for s, q in pre]),
                      self.cache, logits_rows=[])
        self.cache_len = len(self.committed) - 1  # the root goes to row n - 1, as loop.plan feeds it
        parts = [(0, 3, 4), (1, len(parents), self.cache_len), (3, 1, 4)]
        self.seg = Segments.build(parts, parents=[None, parents, None])
        self.tokens = self.others[0][4:] + self.tree + self.others[3][4:]
        self.tree_rows = range(3, 3 + len(parents))

    def run(self, model) -> torch.Tensor:
        return model.forward(torch.tensor(self.tokens), self.seg, self.cache)  # [N, V]

    def node_seq(self, node: int) -> list[int]:
        return self.committed + [self.tree[k] for k in path_to(self.parents, node)]

    def worst_node_error(self, model, logits: torch.Tensor) -> float:
        return max((logits[self.tree_rows[node]] - plain_last_logits(model, self.node_seq(node))).abs().max().item()
                   for node in range(len(self.parents)))


# -- the segment table -----------------------------------------------------------------------------


def test_tree_positions_are_depths_and_rows_scratch_order():
    seg = Segments.build([(2, 2, 5), (0, len(TREE), 7)], parents=[None, TREE])
    depths = tree_depths(TREE)
    assert depths == [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 2]
    assert seg.position_list == [5, 6] + [7 + d for d in depths]
    assert seg.row_list == [5, 6] + list(range(7, 7 + len(TREE)))
    assert seg.positions.tolist() == seg.position_list and seg.rows.tolist() == seg.row_list
    mask = ancestor_mask(TREE)
    assert mask[10].nonzero().flatten().tolist() == [0, 1, 4, 7, 10]
    assert mask[11].nonzero().flatten().tolist() == [0, 3, 11]
    plain = Segments.build([(0, 3, 4)])
    assert not plain.has_trees and plain.rows is plain.positions


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1], [-1, 0]])
def test_bad_parents_rejected(parents):
    n = 3 if parents == [-1, 0] else len(parents)  # [-1, 0] for 3 tokens: wrong length
    with pytest.raises(ValueError, match="segment 0"):
        Segments.build([(0, n, 4)], parents=[parents])


# -- attention -------------------------------------------------------------------------------------


def test_planned_attention_matches_reference_with_trees():
    """Mixed batch: decodes, verify runs, a prefill chunk, a short tree and a tree past SHORT_SEGMENT."""
    g = torch.Generator().manual_seed(3)
    parts = [(0, 1, 10), (1, 4, 6), (2, len(TREE), 3), (3, 20, 0), (4, len(WIDE), 5), (5, 4, 2)]
    parents = [None, None, TREE, None, WIDE, None]
    seg = Segments.build(parts, parents=parents)
    H, KV, D = 4, 2, 8
    q = torch.randn(seg.num_tokens, H, D, generator=g)
    ck, cv = torch.randn(6, KV, 40, D, generator=g), torch.randn(6, KV, 40, D, generator=g)
    plan = AttentionPlan(seg, H // KV, torch.float32, torch.device("cpu"))
    assert 2 in plan.long and 4 in plan.long
    torch.testing.assert_close(attention(q, ck, cv, seg, plan), attention_ref(q, ck, cv, seg), atol=1e-6, rtol=0)


def test_tree_attention_sees_only_ancestors():
    """A node's output must not move when a non-ancestor's key or value changes, and must when an ancestor's does."""
    g = torch.Generator().manual_seed(4)
    c, n, D = 5, len(TREE), 8
    seg = Segments.build([(0, n, c)], parents=[TREE])
    q = torch.randn(n, 2, D, generator=g)
    ck, cv = torch.randn(1, 2, c + n, D, generator=g), torch.randn(1, 2, c + n, D, generator=g)
    base = attention_ref(q, ck, cv, seg)
    for changed in range(n):
        ck2, cv2 = ck.clone(), cv.clone()
        ck2[0, :, c + changed] += 1.0
        cv2[0, :, c + changed] += 1.0
        moved = (attention_ref(q, ck2, cv2, seg) - base).abs().amax(dim=(1, 2)) > 1e-6  # [n]
        assert moved.tolist() == ancestor_mask(TREE)[:, changed].tolist()


# -- the forward ---------------------------------------------------------------------------------


@pytest.mark.parametrize("parents", [TREE, WIDE, [-1, 0, 1, 2]], ids=["tree", "wide", "chain"])
def test_tree_forward_matches_each_root_to_node_path(model, parents):
    check_tree_forward(model, parents)


def check_tree_forward(model, parents: list[int]) -> None:
    """Every tree node against a plain forward of its root-to-node path, and the ordinary segments beside
    the tree: their last rows against plain forwards of their sequences."""
    batch = Batch(model, parents)
    logits = batch.run(model)
    assert batch.worst_node_error(model, logits) < ATOL
    for slot, row in ((0, 2), (3, len(logits) - 1)):
        torch.testing.assert_close(logits[row], plain_last_logits(model, batch.others[slot]), atol=ATOL, rtol=0)


def test_two_trees_in_one_forward(model):
    """Two tree segments side by side (slots 1 and 2) plus a decode token, each node against its path."""
    V = model.spec.vocab_size
    pre = {1: ids(6, 10, V), 2: ids(11, 11, V), 0: ids(4, 12, V)}
    cache = model.allocate_cache(slots=3, max_len=64)
    model.forward(torch.tensor(sum((q[:-1] for q in pre.values()), [])),
                  Segments.build([(s, len(q) - 1, 0) for s, q in pre.items()]), cache, logits_rows=[])
    trees = {1: TREE, 2: [-1, 0, 0, 1, 2, 2]}
    toks = {s: [pre[s][-1]] + ids(len(p) - 1, 20 + s, V) for s, p in trees.items()}
    seg = Segments.build([(1, len(TREE), 5), (0, 1, 3), (2, 6, 10)], parents=[TREE, None, trees[2]])
    logits = model.forward(torch.tensor(toks[1] + [pre[0][-1]] + toks[2]), seg, cache)
    torch.testing.assert_close(logits[len(TREE)], plain_last_logits(model, pre[0]), atol=ATOL, rtol=0)
    for s, first in ((1, 0), (2, len(TREE) + 1)):
        for node in range(len(trees[s])):
            seq = pre[s] + [toks[s][k] for k in path_to(trees[s], node)]
            torch.testing.assert_close(logits[first + node], plain_last_logits(model, seq), atol=ATOL, rtol=0)


def test_wrong_tree_mask_is_caught(model, monkeypatch):
    """The path comparison fails by a wide margin when the tree is attended with a plain causal mask
    (positions still depths), or fed as an ordinary segment."""
    causal = Batch(model, TREE)
    monkeypatch.setattr(Segments, "tree_mask", lambda self, i: torch.ones(len(TREE), len(TREE)).tril().bool())
    assert causal.worst_node_error(model, causal.run(model)) > 1e-2
    monkeypatch.undo()
    flat = Batch(model, TREE)
    flat.seg = Segments.build([(0, 3, 4), (1, len(TREE), flat.cache_len), (3, 1, 4)])
    assert flat.worst_node_error(model, flat.run(model)) > 1e-2


# -- the C attention and the fused C decoder (cpu_decoder.c: spin_attention_tree) -------------------

# (plan, model, dtype): the fused C decoder and torch layers with the C attention; the qwen2 model has one
# KV head and a QKV bias; bfloat16 runs the tree attention's bfloat16 loads and stores
C_MODELS = [("c", "llama", "float32"), ("torch+c_attention", "llama", "float32"), ("c", "qwen2", "bfloat16"),
            ("torch+c_attention", "qwen2", "float32")]


@pytest.fixture(scope="module", params=C_MODELS, ids=lambda p: "-".join(p))
def c_model(request, tiny_dir, tiny_qwen_dir):
    plan, which, dtype = request.param
    m = load_model(tiny_qwen_dir if which == "qwen2" else tiny_dir, dtype, torch.device("cpu"),
                   plan=execution.forced(plan))
    if m.plan.attention != "c" or (plan == "c" and m.c_decoder is None):
        pytest.skip(f"the {plan} path does not build or apply here")
    return m


def test_c_attention_matches_reference_with_trees():
    """spin_attention_tree against attention_ref: a mixed batch with a 64-token tree (bit 63 in use)."""
    lib = cpu_decoder.library()
    if lib is None:
        pytest.skip(cpu_decoder.unavailable_reason())
    g = torch.Generator().manual_seed(5)
    big = [-1] + [(k - 1) // 2 for k in range(1, 64)]  # a binary tree of 64 tokens
    parts = [(0, 1, 10), (1, len(TREE), 3), (2, 20, 0), (3, len(big), 5), (4, len(WIDE), 2)]
    parents = [None, TREE, None, big, WIDE]
    seg = Segments.build(parts, parents=parents)
    H, KV, D = 4, 2, 16
    q, k, v = (torch.randn(seg.num_tokens, n, D, generator=g) for n in (H, KV, KV))
    ck, cv = torch.randn(5, KV, 80, D, generator=g), torch.randn(5, KV, 80, D, generator=g)
    anc = cpu_decoder.tree_bits(parents, seg.lengths())
    out = cpu_decoder.attention(lib, q, k, v, ck, cv, seg.token_slots, seg.rows, anc)
    rows = seg.rows
    assert torch.equal(ck[seg.token_slots, :, rows], k) and torch.equal(cv[seg.token_slots, :, rows], v)
    torch.testing.assert_close(out, attention_ref(q, ck, cv, seg), atol=1e-5, rtol=0)
    causal = cpu_decoder.attention(lib, q, k, v, ck, cv, seg.token_slots, seg.rows)  # no mask: plain causal
    assert (causal - out).abs().max() > 1e-2


@pytest.mark.parametrize("parents", [TREE, WIDE, [-1, 0, 1, 2]], ids=["tree", "wide", "chain"])
def test_c_tree_forward_matches_each_root_to_node_path(c_model, parents):
    check_tree_forward(c_model, parents)


@pytest.mark.parametrize("parents", [TREE, WIDE], ids=["tree", "wide"])
def test_c_decoder_tree_nodes_are_bitwise_their_paths(c_model, parents):
    """On the fused C decoder (`c`: every row computed alone) a tree node's attention reads its keys in the
    order of its root-to-node path, so its logits are bit for bit those of the path decoded in place: what
    makes greedy tree output the autoregressive output exactly, not only up to rounding."""
    if c_model.c_decoder is None:
        pytest.skip("bitwise only on the fused C decoder (its GEMM computes each row alone)")
    batch = Batch(c_model, parents)
    logits = batch.run(c_model)
    assert batch.worst_node_error(c_model, logits) == 0.0


def test_c_wrong_tree_mask_is_caught(c_model, monkeypatch):
    """With the masks of a plain causal run (positions still depths) the path comparison fails widely."""
    def causal_bits(parents_per_segment, lengths):
        return torch.tensor(sum(([0] * n if p is None else [(2 << i) - 1 for i in range(n)]
                                 for p, n in zip(parents_per_segment, lengths)), []), dtype=torch.long)

    batch = Batch(c_model, TREE)
    monkeypatch.setattr(cpu_decoder, "tree_bits", causal_bits)
    assert batch.worst_node_error(c_model, batch.run(c_model)) > 1e-2


def test_c_refuses_trees_over_64_tokens(c_model):
    chain = list(range(-1, 64))  # 65 tokens
    seg = Segments.build([(0, len(chain), 0)], parents=[chain])
    cache = c_model.allocate_cache(slots=1, max_len=80)
    with pytest.raises(NotImplementedError, match="at most 64"):
        c_model.forward(torch.zeros(len(chain), dtype=torch.long), seg, cache)


# -- keeping the accepted path ---------------------------------------------------------------------


@pytest.mark.parametrize("node", [0, 5, 10, 9, 11], ids=lambda n: f"to{n}")
def test_keep_path_then_decode_matches_plain_forward(model, node):
    """Accept the path to `node` (node 0: nothing accepted), compact, then decode the bonus token in the next
    step beside slot 0's ordinary decode: logits equal a plain forward of the whole accepted sequence."""
    batch = Batch(model, TREE)
    batch.run(model)
    path = path_to(TREE, node)
    end = batch.cache.keep_path(1, batch.cache_len, path)
    assert end == len(batch.committed) + len(path)
    bonus = ids(1, 99, model.spec.vocab_size)[0]
    accepted = batch.node_seq(node) + [bonus]
    nxt = ids(1, 98, model.spec.vocab_size)[0]
    seg = Segments.build([(1, 1, end), (0, 1, 7)])
    logits = model.forward(torch.tensor([bonus, nxt]), seg, batch.cache)
    torch.testing.assert_close(logits[0], plain_last_logits(model, accepted), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], plain_last_logits(model, batch.others[0] + [nxt]), atol=ATOL, rtol=0)


def test_keep_path_without_compaction_is_caught(model):
    """Decoding after a branch off the scratch order without keep_path gives other logits (the test can fail)."""
    batch = Batch(model, TREE)
    batch.run(model)
    path = path_to(TREE, 9)  # [2, 6, 9]: rows 10, 14, 17 must move to 9, 10, 11
    end = batch.cache_len + 1 + len(path)
    bonus = 7
    logits = model.forward(torch.tensor([bonus]), Segments.build([(1, 1, end)]), batch.cache)
    assert (logits[0] - plain_last_logits(model, batch.node_seq(9) + [bonus])).abs().max() > 1e-2


@pytest.mark.parametrize("path", [[0, 1], [2, 2], [3, 1], [40]])
def test_keep_path_rejects_bad_paths(model, path):
    cache = model.allocate_cache(slots=1, max_len=32)
    with pytest.raises(ValueError, match="keep_path"):
        cache.keep_path(0, 0, path)
