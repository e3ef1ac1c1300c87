"""The device step's tree kernels (spin_kernels.ngram_tree, spin_kernels.tree) against the runtime's own Python
rules: the n-gram drafter's trie (NgramDrafter._tree, its gate included), the greedy tree walk
(engine/tree_verify.greedy_walk), KVCache.keep_path, and the tree segments' ancestor bits and depths. The Triton
kernels run on CPU under the Triton interpreter."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402

from spin_batch.drafters.base import DraftRequest  # noqa: E402
from spin_batch.drafters.ngram import NgramDrafter  # noqa: E402
from spin_batch.engine.tree_verify import DraftTree, greedy_walk  # noqa: E402
from spin_batch.models.cache import KVCache  # noqa: E402
from spin_batch.models.cpu_decoder import tree_bits  # noqa: E402
from spin_batch.models.segments import tree_depths  # noqa: E402
from spin_kernels.ngram_tree import ngram_tree  # noqa: E402
from spin_kernels.tree import keep_path_ref, tree_layout, tree_walk_ref  # noqa: E402
from test_device_kernels import needs_triton  # noqa: E402


# -- the n-gram trie ----------------------------------------------------------------------------


def _host_tree(drafter: NgramDrafter, tokens: list[int], gamma: int, nodes: int, min_prob: float):
    """(tokens, parents) of the host drafter's tree (a chain as the tree of one path)."""
    if gamma == 0:
        return [], []
    got, shape, _ = drafter._tree(DraftRequest(0, tokens, gamma, None, min_prob, nodes=nodes))
    return got, shape if shape is not None else list(range(-1, len(got) - 1))


def _check_trees(histories: list[list[int]], rng: random.Random, L: int, rounds: int = 1) -> int:
    """ngram_tree on these histories against NgramDrafter._tree at random settings; the trees that branched."""
    branched = 0
    for _ in range(rounds):
        P = len(histories)
        hist = torch.zeros(P, L, dtype=torch.long)
        for s, h in enumerate(histories):
            hist[s, : len(h)] = torch.tensor(h)
        lengths = torch.tensor([len(h) for h in histories])
        rows = torch.tensor(rng.sample(range(P), P))
        gamma = torch.tensor([rng.choice([0, 1, 3, 4, 8]) for _ in range(P)])
        nodes, depth = rng.choice([4, 8, 16, 32]), 8
        mn, mx = rng.choice([(1, 3), (2, 3), (1, 1), (1, 4), (2, 2)])
        drafter = NgramDrafter("ngram", mn, mx)
        min_prob = rng.choice([0.0, 0.3, 0.5])
        for n in drafter.outcomes:  # random rates: the gate cuts continuations at different depths per length
            drafter.outcomes[n] = [rng.uniform(0.5, 6.0), rng.uniform(0.5, 3.0)]
        keep = torch.tensor([len(drafter.gated(n, [0] * depth, min_prob)) if n in drafter.outcomes else depth
                             for n in range(mx + 1)])  # as DeviceLoop builds it
        toks, pars, counts = ngram_tree(rows, hist, lengths, gamma, keep, nodes, depth, mn, mx)
        for r, s in enumerate(rows.tolist()):
            want = _host_tree(drafter, histories[s], int(gamma[r]), nodes, min_prob)
            c = int(counts[r])
            assert (toks[r, :c].tolist(), pars[r, :c].tolist()) == want, (histories[s], int(gamma[r]), nodes, mn, mx)
            assert toks[r, c:].eq(0).all() and pars[r, c:].eq(-1).all()  # padding: children of the root
            branched += any(a != i - 1 for i, a in enumerate(want[1]))
    return branched


def test_ngram_tree_equals_the_host_trie_on_random_histories():
    rng = random.Random(0)
    branched = 0
    for _ in range(60):
        V = rng.choice([2, 3, 5, 9])
        histories = [[rng.randrange(V) for _ in range(rng.randint(1, 40))] for _ in range(5)]
        branched += _check_trees(histories, rng, 48)
    assert branched > 20  # the trees branched, often


def test_ngram_tree_equals_the_host_trie_on_text(tiny_dir):
    from spin_batch.models.loader import load_tokenizer
    from test_device_step import MANY
    from test_device_tree import REPETITIVE

    tok = load_tokenizer(tiny_dir)
    histories = [tok.encode(p) for p in MANY + REPETITIVE]
    rng = random.Random(1)
    L = max(len(h) for h in histories) + 8
    assert _check_trees(histories, rng, L, rounds=8) > 0


# -- the walk -----------------------------------------------------------------------------------


def _random_tree(rng: random.Random, T: int, V: int) -> tuple[list[int], list[int]]:
    """Random parents (siblings may repeat a token: the walk takes the first) and tokens."""
    parents = [rng.randint(-1, i - 1) if rng.random() < 0.7 else i - 1 for i in range(T)]
    return [rng.randrange(V) for _ in range(T)], parents


def _walk_case(seed: int, B: int = 6, T: int = 16, V: int = 4):
    rng = random.Random(seed)
    tokens = torch.zeros(B, T, dtype=torch.long)
    parents = torch.full((B, T), -1, dtype=torch.long)
    counts = torch.tensor([rng.randint(0, T) for _ in range(B)])
    best = torch.tensor([[rng.randrange(V) for _ in range(T + 1)] for _ in range(B)])
    trees = []
    for r in range(B):
        c = int(counts[r])
        t, p = _random_tree(rng, c, V)
        tokens[r, :c], parents[r, :c] = torch.tensor(t, dtype=torch.long), torch.tensor(p, dtype=torch.long)
        tokens[r, c:] = torch.tensor([rng.randrange(V) for _ in range(T - c)], dtype=torch.long)  # padding: ignored
        tree = DraftTree(t, p)
        kids, row = tree.children(), 0
        while kids[row] and rng.random() < 0.85:  # the target agrees along a random path, often
            ch = rng.choice(kids[row])
            best[r, row] = t[ch]
            row = ch + 1
        trees.append(tree)
    return tokens, parents, counts, best, trees


@pytest.mark.parametrize("seed", range(40))
def test_tree_walk_ref_equals_greedy_walk(seed):
    tokens, parents, counts, best, trees = _walk_case(seed)
    depth = random.Random(seed).choice([4, 8, 16])
    drafts, target, path, k = tree_walk_ref(tokens, parents, counts, best, depth)
    for r, tree in enumerate(trees):
        full = greedy_walk(tree, best[r, : tree.size + 1].tolist()).path
        p = full[:depth]  # a path deeper than the walk's depth is cut there, its last row's argmax after it
        want = [tree.tokens[n] for n in p] + [int(best[r, 1 + p[-1] if p else 0])]
        kk = int(k[r])
        assert kk == len(p)
        assert drafts[r, :kk].tolist() == want[:-1] and drafts[r, kk:].eq(-1).all()
        assert target[r, : kk + 1].tolist() == want and target[r, kk + 1 :].eq(0).all()
        assert path[r, :kk].tolist() == [1 + n for n in p] and path[r, kk:].tolist() == list(range(kk + 1, depth + 1))


def test_tree_walk_ref_accepts_the_last_node_of_a_63_node_tree():
    """Node 62 is bit 63 of the ancestor masks, int64's sign bit: a root whose argmax is that node's token
    accepts it (a right shift that kept the sign once left a stray bit there and accepted nothing)."""
    T = 63
    tokens = torch.arange(T, dtype=torch.long)[None] + 100  # every node a child of the root, distinct tokens
    parents = torch.full((1, T), -1, dtype=torch.long)
    best = torch.zeros(1, T + 1, dtype=torch.long)
    for node in (61, 62):
        best[0, 0] = 100 + node
        drafts, _, path, k = tree_walk_ref(tokens, parents, torch.tensor([T]), best, 4)
        assert int(k[0]) == 1 and int(drafts[0, 0]) == 100 + node and int(path[0, 0]) == 1 + node, node


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_tree_walk_kernel_equals_the_reference(seed):
    from spin_kernels.tree import tree_walk

    tokens, parents, counts, best, _ = _walk_case(100 + seed, B=4, T=8)
    for depth in (3, 8):
        for a, b in zip(tree_walk(tokens, parents, counts, best, depth),
                        tree_walk_ref(tokens, parents, counts, best, depth)):
            assert torch.equal(a, b)


# -- keep_path and the layout -------------------------------------------------------------------


def _keep_case(seed: int):
    rng = random.Random(seed)
    cache = KVCache.allocate(2, 5, 2, 30, 8, torch.float32, "cpu")
    cache.k.normal_(generator=torch.Generator().manual_seed(seed))
    cache.v.normal_(generator=torch.Generator().manual_seed(seed + 1))
    B, D = 4, 6
    rows = torch.tensor(rng.sample(range(5), B))
    cache_lens = torch.tensor([rng.randint(0, 10) for _ in range(B)])
    paths, ks = [], []
    for _ in range(B):
        k = rng.randint(0, D)
        p = sorted(rng.sample(range(1, 13), k))
        paths.append(p + list(range(k + 1, D + 1)))
        ks.append(k)
    return cache, rows, cache_lens, paths, torch.tensor(paths), torch.tensor(ks)


@pytest.mark.parametrize("seed", range(10))
def test_keep_path_ref_equals_the_caches_keep_path(seed):
    cache, rows, cache_lens, paths, path, k = _keep_case(seed)
    got = KVCache(cache.k.clone(), cache.v.clone())
    keep_path_ref(got.k, got.v, rows, cache_lens, path, k)
    for r in range(rows.shape[0]):
        cache.keep_path(int(rows[r]), int(cache_lens[r]), paths[r][: int(k[r])])
    assert torch.equal(got.k, cache.k) and torch.equal(got.v, cache.v)


@needs_triton
@pytest.mark.parametrize("seed", range(4))
def test_keep_path_kernel_equals_the_reference(seed):
    from spin_kernels.tree import keep_path

    cache, rows, cache_lens, _, path, k = _keep_case(50 + seed)
    want = KVCache(cache.k.clone(), cache.v.clone())
    keep_path_ref(want.k, want.v, rows, cache_lens, path, k)
    keep_path(cache.k, cache.v, rows, cache_lens, path, k)
    assert torch.equal(cache.k, want.k) and torch.equal(cache.v, want.v)


def test_tree_layout_equals_the_segments_bits_and_depths():
    rng = random.Random(3)
    for T in (1, 2, 5, 16, 31, 63):
        parents = [[rng.randint(-1, i - 1) for i in range(T)] for _ in range(3)]
        bits, depth = tree_layout(torch.tensor(parents))
        for r, p in enumerate(parents):
            seg = [-1] + [a + 1 for a in p]
            assert bits[r].tolist() == tree_bits([seg], [T + 1]).tolist()
            assert depth[r].tolist() == tree_depths(seg)
    chain = tree_layout(torch.arange(-1, 62)[None])[0][0]  # a chain of 63 nodes: the last token's mask is all ones
    assert chain[-1].item() == -1 and chain[-2].item() == (1 << 63) - 1
    with pytest.raises(ValueError, match="at most 63"):
        tree_layout(torch.full((1, 64), -1))
