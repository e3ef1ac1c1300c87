"""Acceptance on draft trees (engine/tree_verify.py): hand-built trees, the chain case against
verify.py's rule, and statistical tests that tree sampling stays lossless (and a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from spin_batch.engine import tree_verify, verify
from spin_batch.engine.tree_verify import (
    DraftTree, TreeVerdict, accept_tree_greedy, accept_trees, tree_rejection_sample, without_replacement_probs,
)
from spin_batch.sampling import GREEDY, SamplingParams, probs_from_logits

from test_verify import V, one_hot_logits


# -- the representation ----------------------------------------------------------------------

def test_tree_shape_helpers():
    t = DraftTree([5, 6, 7, 1], [-1, -1, 0, 2])
    assert t.children() == [[0, 1], [2], [], [3], []]
    assert t.depths() == [1, 1, 2, 3]
    assert DraftTree.chain([4, 2, 9]).parents == [-1, 0, 1]


@pytest.mark.parametrize("tokens,parents,probs", [
    ([1, 2], [-1], None),  # lengths differ
    ([1, 2], [-1, 1], None),  # a node is its own parent
    ([1, 2], [1, -1], None),  # a child before its parent
    ([1, 2], [-1, -2], None),  # parent out of range
    ([1, 2], [-1, 0], [None]),  # one q for two nodes
])
def test_bad_tree_is_a_clear_error(tokens, parents, probs):
    with pytest.raises(ValueError, match="draft tree"):
        DraftTree(tokens, parents, probs)


def test_wrong_row_count_is_a_clear_error():
    with pytest.raises(ValueError, match="target rows"):
        accept_tree_greedy(one_hot_logits([1, 2]), DraftTree([1, 2], [-1, -1]))
    with pytest.raises(ValueError, match="target rows"):
        accept_trees(one_hot_logits([1, 2]), [DraftTree([1], [-1]), DraftTree([], [])], [None, None], [GREEDY] * 2)


# -- greedy ----------------------------------------------------------------------------------

def test_greedy_empty_tree_is_plain_decoding():
    v = accept_tree_greedy(one_hot_logits([7]), DraftTree([], []))
    assert v == TreeVerdict([], [7]) and v.accepted == 0


def test_greedy_first_level_reject_takes_root_argmax():
    # root's argmax is 3; neither child (1, 2) matches
    v = accept_tree_greedy(one_hot_logits([3, 0, 0, 0]), DraftTree([1, 2, 3], [-1, -1, 0]))
    assert v == TreeVerdict([], [3])


def test_greedy_full_accept_takes_bonus():
    # chain 4 -> 5 -> 6, every row agrees; the leaf's row gives the bonus 2
    v = accept_tree_greedy(one_hot_logits([4, 5, 6, 2]), DraftTree.chain([4, 5, 6]))
    assert v == TreeVerdict([0, 1, 2], [4, 5, 6, 2])


def test_greedy_picks_the_matching_branch():
    #        root
    #      /   |    \
    #    0:1  1:2   2:3
    #    |    / \     \
    #  3:4  4:5 5:6   6:7
    #            |
    #           7:1
    tree = DraftTree([1, 2, 3, 4, 5, 6, 7, 1], [-1, -1, -1, 0, 1, 1, 2, 5])
    # argmax per row: root -> 2 (node 1); node 1 -> 6 (node 5); node 5 -> 1 (node 7); node 7 -> 0 (bonus)
    rows = [2, 0, 6, 0, 0, 0, 1, 0, 0]
    v = accept_tree_greedy(one_hot_logits(rows), tree)
    assert v == TreeVerdict([1, 5, 7], [2, 6, 1, 0])
    # node 5's row wants 3, which no child drafts: recovered 3 after two accepted nodes
    rows[1 + 5] = 3
    assert accept_tree_greedy(one_hot_logits(rows), tree) == TreeVerdict([1, 5], [2, 6, 3])


def test_greedy_chain_equals_chain_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        gamma = int(torch.randint(0, 5, (), generator=g))
        logits = torch.randn(gamma + 1, 3, generator=g)  # a small vocabulary: matches are frequent
        d = torch.randint(0, 3, (gamma,), generator=g).tolist()
        chain = verify.accept_greedy(logits, [d])
        v = accept_tree_greedy(logits, DraftTree.chain(d))
        assert (v.accepted, v.tokens, v.path) == (chain.accepted[0], chain.tokens[0], list(range(v.accepted)))


def test_batch_of_trees_mixed_greedy():
    trees = [DraftTree([], []), DraftTree([1, 2], [-1, -1]), DraftTree.chain([3, 4])]
    rows = [7] + [2, 0, 5] + [3, 4, 6]
    vs = accept_trees(one_hot_logits(rows), trees, [None] * 3, [GREEDY] * 3)
    assert vs == [TreeVerdict([], [7]), TreeVerdict([1], [2, 5]), TreeVerdict([0, 1], [3, 4, 6])]


def test_greedy_request_in_a_sampled_batch_walks_the_argmax():
    """A greedy request's rows become one-hot: the sampling rule then takes the argmax path."""
    g = torch.Generator().manual_seed(1)
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, -1, 1, 1, 3])
    for _ in range(50):
        logits = torch.randn(2 * (tree.size + 1), 7, generator=g)
        logits[1, 2] = logits[3, 5] = 9.0  # often a two-node path on the greedy slot
        sampled = SamplingParams(1.0, sampler="rejection")
        vs = accept_trees(logits, [tree, tree], [None, torch.Generator().manual_seed(2)], [GREEDY, sampled])
        assert vs[0] == accept_tree_greedy(logits[: tree.size + 1], tree)


# -- sampling: hand-built and the chain case --------------------------------------------------

def test_sampling_with_certain_target_behaves_like_greedy():
    tree = DraftTree([1, 2, 3, 4, 5, 6, 7, 1], [-1, -1, -1, 0, 1, 1, 2, 5])
    logits = one_hot_logits([2, 0, 6, 0, 0, 0, 1, 0, 0]) * 20  # p one-hot up to e^-100
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        v = accept_trees(logits, [tree], [gen], [SamplingParams(1.0, sampler="rejection")])[0]
        assert v == TreeVerdict([1, 5, 7], [2, 6, 1, 0])


def _stream(seed: int) -> verify.Uniforms:
    return verify.Uniforms.from_generator(torch.Generator().manual_seed(seed))


def test_sampling_chain_equals_chain_rule_randoms_included():
    """On a chain, the tree rule draws the same randoms in the same order: identical verdicts."""
    g = torch.Generator().manual_seed(4)
    for trial in range(300):
        gamma = int(torch.randint(0, 4, (), generator=g))
        p = torch.softmax(torch.randn(gamma + 1, V, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(gamma, V, generator=g) * 2, -1)
        d = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(gamma)]
        for qq in (q, None):
            want = verify.rejection_sample(p, d, qq, _stream(trial))
            got = tree_rejection_sample(p, DraftTree.chain(d, qq), _stream(trial))
            assert (got.accepted, got.tokens[-1]) == want and got.tokens[:-1] == d[: want[0]]


def test_batch_sampling_applies_each_request_settings():
    """accept_trees: each slot's rows under its own temperature / top-k / top-p, its own stream."""
    g = torch.Generator().manual_seed(6)
    trees = [DraftTree([1, 2, 3], [-1, -1, 0]), DraftTree.chain([4, 5])]
    sps = [SamplingParams(0.7, top_k=3, sampler="rejection"), SamplingParams(1.3, top_p=0.8, sampler="rejection")]
    for seed in range(30):
        logits = torch.randn(7, V, generator=g) * 2
        seeds = [seed, 1000 + seed]
        got = accept_trees(logits, trees, [torch.Generator().manual_seed(s) for s in seeds], sps)
        want = [tree_rejection_sample(probs_from_logits(logits[:4], sps[0]), trees[0], _stream(seeds[0])),
                tree_rejection_sample(probs_from_logits(logits[4:], sps[1]), trees[1], _stream(seeds[1]))]
        assert got == want


def test_without_replacement_probs():
    q = torch.tensor([0.5, 0.25, 0.125, 0.125])
    qs = without_replacement_probs(q, [1, 0, 3])
    assert torch.allclose(qs[0], q)
    assert torch.allclose(qs[1], torch.tensor([2 / 3, 0.0, 1 / 6, 1 / 6]))
    assert torch.allclose(qs[2], torch.tensor([0.0, 0.0, 0.5, 0.5]))


# -- distribution tests ----------------------------------------------------------------------
#
# A two-level tree: K1 children of the root, K2 children under each. The target depends on the
# path: row 0 is p0, a depth-1 node with token a has row P1[a], a depth-2 node row p2. Exact output:
# the first token ~ p0, and given a first token a that was an accepted node, the second ~ P1[a].

N_SAMPLES = 20_000
SIGMAS = 5.0  # as tests/test_verify.py: |freq - p| < 5 sigma per token; a false alarm ~1e-6 per token
K1, K2 = 3, 2
MIN_SECOND = 1_500  # the second position is checked after each first token seen this often


def _within_bound(p: torch.Tensor, counts: torch.Tensor) -> tuple[bool, float]:
    n = counts.sum().item()
    sigma = torch.sqrt(p * (1 - p) / n).clamp_min(1.0 / n)
    z = ((counts / n - p).abs() / sigma).max().item()
    return z < SIGMAS, z


def _problem():
    g = torch.Generator().manual_seed(3)
    p0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    P1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # [V, V] row a: after first token a
    p2 = torch.softmax(torch.randn(V, generator=g), -1)
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)  # a draft that disagrees a lot
    Q1 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    return p0, P1, p2, q0, Q1


def _siblings(kind: str, q: torch.Tensor, k: int, gen: torch.Generator) -> tuple[list[int], list]:
    """k sibling tokens under a node whose draft distribution is q, and each one's q given the earlier."""
    if kind == "iid":
        xs = torch.multinomial(q, k, replacement=True, generator=gen).tolist()
        return xs, [q] * k
    if kind == "topk":  # distinct, deterministic: the draft's k likeliest tokens
        return torch.topk(q, k).indices.tolist(), [None] * k
    if kind == "without-replacement":
        xs = torch.multinomial(q, k, replacement=False, generator=gen).tolist()
        return xs, without_replacement_probs(q, xs)
    if kind == "mixed":  # one deterministic sibling (say an n-gram's), then i.i.d. draws
        xs = [int(q.argmin())] + torch.multinomial(q, k - 1, replacement=True, generator=gen).tolist()
        return xs, [None] + [q] * (k - 1)
    # deliberately wrong: q that is not the sibling's law given the earlier ones
    if kind == "wrong:topk-with-draft-q":  # ranked, not sampled, yet tested against q
        return torch.topk(q, k).indices.tolist(), [q] * k
    if kind == "wrong:without-replacement-plain-q":  # q not renormalised past the earlier siblings
        return torch.multinomial(q, k, replacement=False, generator=gen).tolist(), [q] * k
    raise AssertionError(kind)


def _draft_tree(kind, q0, Q1, gen) -> DraftTree:
    tokens, probs = _siblings(kind, q0, K1, gen)
    parents = [-1] * K1
    for i in range(K1):
        xs, qs = _siblings(kind, Q1[tokens[i]], K2, gen)
        tokens, parents, probs = tokens + xs, parents + [i] * K2, probs + qs
    return DraftTree(tokens, parents, probs)


def _outputs(kind: str, n: int, seed: int):
    """Run n tree steps; count the first output token, and the (first, second) pairs."""
    p0, P1, p2, q0, Q1 = _problem()
    gen = torch.Generator().manual_seed(seed)
    first, pairs = torch.zeros(V), torch.zeros(V, V)
    for _ in range(n):
        tree = _draft_tree(kind, q0, Q1, gen)
        p = torch.cat([p0[None], P1[tree.tokens[:K1]], p2.expand(K1 * K2, V)])  # [T + 1, V]
        out = tree_rejection_sample(p, tree, verify.Uniforms.from_generator(gen)).tokens
        first[out[0]] += 1
        if len(out) > 1:
            pairs[out[0], out[1]] += 1
    return (p0, P1), first, pairs


def _check(kind: str, seed: int) -> tuple[float, float]:
    (p0, P1), first, pairs = _outputs(kind, N_SAMPLES, seed)
    z_first = _within_bound(p0, first)[1]
    seen = [a for a in range(V) if pairs[a].sum() >= MIN_SECOND]
    assert seen, "too few accepted first tokens to test the second position"
    z_second = max(_within_bound(P1[a], pairs[a])[1] for a in seen)
    return z_first, z_second


@pytest.mark.parametrize("kind", ["iid", "topk", "without-replacement", "mixed"])
def test_tree_sampling_reproduces_target_distribution(kind):
    z1, z2 = _check(kind, seed=11)
    assert z1 < SIGMAS, f"first token off by {z1:.1f} sigma"
    assert z2 < SIGMAS, f"second token off by {z2:.1f} sigma"


def test_the_bound_catches_a_wrong_rule(monkeypatch):
    """Not updating the residual after a rejected sibling (later siblings and the last draw see p)."""
    monkeypatch.setattr(tree_verify, "recovered_probs", lambda r, q, x: r)
    z1, _ = _check("iid", seed=11)
    assert z1 > 2 * SIGMAS, f"the wrong rule was off by only {z1:.1f} sigma"


@pytest.mark.parametrize("kind", ["wrong:topk-with-draft-q", "wrong:without-replacement-plain-q"])
def test_the_bound_catches_a_wrong_sibling_q(kind):
    """The rule is exact only when each sibling's q is its law given the earlier siblings."""
    z1, _ = _check(kind, seed=11)
    assert z1 > 2 * SIGMAS, f"the wrong q was off by only {z1:.1f} sigma"


def test_a_draft_tree_as_its_verify_segment():
    """DraftTree's nodes are the verify segment's tokens 1.. (token 0 the root): the segment parents pass
    Segments' check with the same depths, and a verdict's path maps to the rows KVCache.keep_path takes."""
    from spin_batch.models.segments import tree_depths, tree_problem

    t = DraftTree([5, 6, 7, 1, 9], [-1, -1, 0, 2, 1])
    parents = t.segment_parents()
    assert parents == [-1, 0, 0, 1, 3, 2] and tree_problem(parents, 6) is None
    assert tree_depths(parents) == [0] + t.depths() == [0, 1, 1, 2, 3, 2]
    assert TreeVerdict([0, 2, 3], [5, 7, 1, 4]).segment_path() == [1, 3, 4]
