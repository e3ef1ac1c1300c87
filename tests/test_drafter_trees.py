"""Token-tree proposals from the n-gram, vote and cascade drafters: valid shapes, the chain as the first
path, branches from several matches, the per-node gate, and chains unchanged when no tree is asked."""

from __future__ import annotations

import random

import pytest

from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
from spin_batch.drafters.cascade import CascadeDrafter
from spin_batch.drafters.ngram import NgramDrafter, lookup_match, lookup_matches
from spin_batch.drafters.trie import first_path, tree_depth
from spin_batch.drafters.vote import VoteDrafter, member_path, union_tree, vote_path
from spin_batch.engine.tree_verify import DraftTree


def check_tree(prop: Proposal, i: int, r: DraftRequest) -> DraftTree:
    """Request i's proposal as a DraftTree, after checking every rule a tree must keep."""
    tokens, shape = prop.tokens[i], prop.tree(i)
    tree = DraftTree(tokens, shape) if shape is not None else DraftTree.chain(tokens)  # checks parents
    assert tree.size <= r.nodes if r.nodes > 1 else shape is None  # no budget: a chain
    assert max(tree.depths(), default=0) <= r.gamma
    for kids in tree.children():
        siblings = [tree.tokens[c] for c in kids]
        assert len(siblings) == len(set(siblings)), f"duplicate siblings {siblings}"
    if shape is not None:
        assert prop.probs[i] is None  # deterministic siblings
    return tree


def ngram_reference(d: NgramDrafter, r: DraftRequest) -> list[int]:
    """The chain drafter as it was before trees: the latest longest match, gated by a_n^l."""
    n, draft = lookup_match(r.tokens, r.gamma, d.min_ngram, d.max_ngram)
    if draft and r.min_prob > 0:
        a, keep, conf = d.rate(n), 0, 1.0
        while keep < len(draft) and conf * a >= r.min_prob:
            conf *= a
            keep += 1
        draft = draft[:keep]
    return draft


# two earlier continuations of "1 2": "3 4 0" (after "1 2" at 0) and "3 5 0" (after "0 1 2" at 4)
SHARED = [1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2]


def test_ngram_tree_merges_continuations_into_a_trie_with_the_chain_first():
    d = NgramDrafter("ngram", 1, 3)
    r = DraftRequest(0, SHARED, 3, None, nodes=8)
    prop = d.propose([r])
    tree = check_tree(prop, 0, r)
    chain = d.propose([DraftRequest(1, SHARED, 3, None)]).tokens[0]
    assert chain == [3, 5, 0]  # the 3-gram "0 1 2" matched
    assert tree.tokens == [3, 5, 0, 4, 0] and tree.parents == [-1, 0, 1, 0, 3]  # "3" is shared
    assert first_path(tree.tokens, tree.parents) == chain


def test_ngram_tree_branches_at_the_root_for_different_continuations():
    text = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2]
    d = NgramDrafter("ngram", 1, 3)
    r = DraftRequest(0, text, 3, None, nodes=16)
    tree = check_tree(d.propose([r]), 0, r)
    assert tree.tokens == [4, 8, 1, 3, 9, 1] and tree.parents == [-1, 0, 1, -1, 3, 4]
    assert tree.children()[0] == [0, 3]  # two branches at the root


def test_ngram_tree_stops_at_the_node_budget_and_a_path_comes_back_as_a_chain():
    d = NgramDrafter("ngram", 1, 3)
    r = DraftRequest(0, SHARED, 3, None, nodes=4)
    prop = d.propose([r])
    assert prop.tokens == [[3, 5, 0, 4]] and prop.parents == [[-1, 0, 1, 0]]
    small = d.propose([DraftRequest(0, SHARED, 3, None, nodes=2)])
    assert small.tokens == [[3, 5]] and small.parents is None  # the budget cut the chain: a chain
    one = d.propose([DraftRequest(0, [5, 6, 5], 3, None, nodes=8)])
    assert one.tokens == [[6, 5]] and one.parents is None  # one match only: a chain


def test_ngram_gate_trims_every_node_by_its_match_length_and_depth():
    d = NgramDrafter("ngram", 1, 3)  # prior rate 0.75 for every n: two tokens clear a floor of 0.5
    r = DraftRequest(0, SHARED, 3, None, min_prob=0.5, nodes=8)
    tree = check_tree(d.propose([r]), 0, r)
    assert tree.tokens == [3, 5, 4] and tree.parents == [-1, 0, 0]  # the depth-3 nodes are gone
    # a lower rate after the 3-gram leaves its branch one token, the 2-gram's keeps three
    d.outcomes[3] = [3.0, 2.0]  # 0.6: 0.6 >= 0.5 > 0.36
    d.outcomes[2] = [9.0, 1.0]  # 0.9: 0.9, 0.81, 0.729 all >= 0.5
    prop = d.propose([r])
    assert prop.tokens == [[3, 4, 0]] and prop.parents is None  # the 2-gram branch extends "3"
    assert d.propose([DraftRequest(0, SHARED, 3, None, min_prob=0.95, nodes=8)]).tokens == [[]]


def test_ngram_learns_from_the_branch_that_matched():
    d = NgramDrafter("ngram", 1, 3)
    r = DraftRequest(0, SHARED, 3, None, nodes=8)
    d.propose([r])  # branches: (3, [3, 5, 0]) and (2, [3, 4, 0])
    d.on_commit(0, SHARED + [3, 4, 0, 7])  # the 2-gram's branch was accepted whole
    assert d.outcomes[2] == [6.0, 1.0] and d.outcomes[3] == [3.0, 1.0]
    d.propose([r])
    d.on_commit(0, SHARED + [3, 9])  # both branches kept one token: the first (the chain's) learns
    assert d.outcomes[3] == [4.0, 2.0] and d.outcomes[2] == [6.0, 1.0]
    d.propose([r])
    d.on_admit(0)  # a new request: nothing pending
    d.on_commit(0, SHARED + [3, 5])
    assert d.outcomes[3] == [4.0, 2.0]


def random_texts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(rng.choice([2, 4, 8])) for _ in range(rng.randrange(1, 60))] for _ in range(count)]


@pytest.mark.parametrize("nodes", [0, 1])
def test_ngram_without_a_tree_budget_proposes_the_chain_it_always_did(nodes):
    d = NgramDrafter("ngram", 1, 3)
    d.outcomes[1] = [5.0, 3.0]
    for k, text in enumerate(random_texts(200)):
        r = DraftRequest(k % 3, text, 1 + k % 5, None, min_prob=[0.0, 0.3, 0.6][k % 3], nodes=nodes)
        prop = d.propose([r])
        assert prop.tokens == [ngram_reference(d, r)] and prop.parents is None and prop.probs == [None]


def test_ngram_trees_on_random_text_are_valid_and_start_with_the_chain():
    d = NgramDrafter("ngram", 1, 3)
    branched = 0
    for k, text in enumerate(random_texts(300, seed=1)):
        gamma, nodes, floor = 1 + k % 5, 2 + k % 9, [0.0, 0.3][k % 2]
        r = DraftRequest(0, text, gamma, None, min_prob=floor, nodes=nodes)
        prop = d.propose([r])
        tree = check_tree(prop, 0, r)
        chain = ngram_reference(d, r)[:nodes]
        assert first_path(tree.tokens, tree.parents)[: len(chain)] == chain
        assert tree.tokens[: len(chain)] == chain  # nodes 0.. are the chain
        branched += prop.parents is not None
        d.on_commit(0, text + text[:3])
    assert branched > 50  # the random texts do give trees


def test_lookup_matches_starts_with_lookup_match_and_is_bounded():
    for text in random_texts(200, seed=2):
        got = list(lookup_matches(text, 4, 1, 3))
        assert (got[0] if got else (0, [])) == lookup_match(text, 4, 1, 3)
        starts = [(n, tuple(c)) for n, c in got]
        assert all(c for _, c in starts) and len(got) <= 32
    long = [0, 1] * 500  # every position matches: the scan stops at the limit
    assert len(list(lookup_matches(long, 4, 1, 3, limit=5))) == 5
    assert len(list(lookup_matches(long, 4, 1, 3, probes=3))) == 4  # the first match, then 3 probes


def test_union_tree_puts_the_voted_path_first_and_drops_the_lightest_nodes():
    paths, w = [[1, 2, 3], [1, 5, 6], [1, 5, 7]], [0.4, 0.3, 0.3]
    voted, _ = vote_path(paths, w)
    tokens, parents = union_tree(paths, w, 16)
    DraftTree(tokens, parents)
    assert tokens == [1, 5, 6, 7, 2, 3] and parents == [-1, 0, 1, 1, 0, 4]
    assert tokens[: len(voted)] == voted == [1, 5, 6]
    # four nodes: the voted path, then the heaviest other node (2 and 3 weigh 0.4, 7 only 0.3)
    assert union_tree(paths, w, 4) == ([1, 5, 6, 2], [-1, 0, 1, 0])
    assert union_tree(paths, w, 2) == ([1, 5], [-1, 0])  # the budget cuts the voted path itself
    assert union_tree([[], []], [0.5, 0.5], 4) == ([], [])


def test_union_tree_matches_vote_path_on_random_votes():
    rng = random.Random(3)
    for _ in range(300):
        paths = [[rng.randrange(3) for _ in range(rng.randrange(5))] for _ in range(rng.randrange(2, 5))]
        w = [rng.choice([0.1, 0.2, 0.3]) for _ in paths]
        nodes = rng.randrange(1, 12)
        tokens, parents = union_tree(paths, w, nodes)
        tree = DraftTree(tokens, parents)
        assert tree.size <= nodes
        assert all(len({tokens[c] for c in kids}) == len(kids) for kids in tree.children())
        voted = vote_path(paths, w)[0][:nodes]
        assert tokens[: len(voted)] == voted and parents[: len(voted)] == list(range(-1, len(voted) - 1))
        union = {tuple(p[:k]) for p in paths for k in range(1, len(p) + 1)}
        if nodes >= len(union):
            assert tree.size == len(union)  # every distinct prefix is one node


class Fixed(Drafter):
    """Proposes a fixed chain, or a fixed tree when asked for one and given `parents`."""

    def __init__(self, name, path, parents=None, trees=False):
        super().__init__(name)
        self.path, self.parents, self.trees = path, parents, trees
        self.asked: list[int] = []

    def propose(self, reqs):
        self.asked.extend(r.nodes for r in reqs)
        tree = [self.parents is not None and r.nodes > 1 for r in reqs]
        tokens = [list(self.path) if t else self.path[: r.gamma] for t, r in zip(tree, reqs)]
        shapes = [list(self.parents) if t else None for t in tree]
        return Proposal(tokens, [None] * len(reqs), shapes if any(tree) else None)


def test_vote_proposes_the_union_tree_and_asks_members_for_chains():
    members = {"a": Fixed("a", [1, 2, 3]), "b": Fixed("b", [1, 5, 6]), "c": Fixed("c", [1, 5, 7])}
    vote = VoteDrafter("v", members)
    assert vote.trees
    vote.weights[0] = [0.4, 0.3, 0.3]
    r = DraftRequest(0, [9], 3, None, nodes=16)
    prop = vote.propose([r])
    check_tree(prop, 0, r)
    assert prop.tokens == [[1, 5, 6, 7, 2, 3]] and prop.parents == [[-1, 0, 1, 1, 0, 4]]
    assert all(m.asked == [0] for m in members.values())  # each member votes for one path
    assert vote.propose([DraftRequest(0, [9], 3, None)]).tokens == [[1, 5, 6]]  # no budget: the vote
    assert vote.propose([DraftRequest(0, [9], 3, None, nodes=1)]).parents is None


def test_vote_weights_learn_from_member_paths_under_trees():
    vote = VoteDrafter("v", {"a": Fixed("a", [1, 2]), "b": Fixed("b", [1, 3])}, beta=0.5)
    vote.propose([DraftRequest(0, [7], 2, None, nodes=4)])
    vote.on_commit(0, [7, 1, 3, 4])  # the tree's second branch was accepted: a was wrong
    assert vote.weights[0] == pytest.approx([1 / 3, 2 / 3])


def test_a_member_tree_votes_with_its_first_path():
    tree_member = Fixed("t", [4, 5, 6, 7], parents=[-1, 0, -1, 1], trees=True)  # first path: 4 5 7
    assert first_path(tree_member.path, tree_member.parents) == [4, 5, 7]
    prop = Proposal([[4, 5, 6, 7]], [None], [[-1, 0, -1, 1]])
    assert member_path(prop, 0) == [4, 5, 7]
    assert member_path(Proposal([[4, 5]], [None]), 0) == [4, 5]


def test_cascade_carries_a_member_tree_with_its_parents():
    lookup = Fixed("lookup", [3, 5, 0, 4, 0], parents=[-1, 0, 1, 0, 3], trees=True)
    model = Fixed("model", [8, 8])
    cascade = CascadeDrafter("c", {"lookup": lookup, "model": model}, min_tokens=2)
    assert cascade.trees and not CascadeDrafter("d", {"a": Fixed("a", []), "b": Fixed("b", [])}).trees
    reqs = [DraftRequest(0, [1], 3, None, nodes=8), DraftRequest(1, [1], 3, None)]
    prop = cascade.propose(reqs)
    assert prop.tokens == [[3, 5, 0, 4, 0], [3, 5, 0]]
    assert prop.parents == [[-1, 0, 1, 0, 3], None]
    for i, r in enumerate(reqs):
        check_tree(prop, i, r)
    assert lookup.asked == [8, 0] and model.asked == []  # the budget reaches the member as it is


def test_cascade_measures_a_tree_by_its_depth():
    wide = Fixed("lookup", [3, 4, 5], parents=[-1, -1, -1], trees=True)  # three nodes, depth 1
    assert tree_depth(wide.parents) == 1 and tree_depth([]) == 0 and tree_depth([-1, 0, 0, 2]) == 3
    model = Fixed("model", [8, 8])
    cascade = CascadeDrafter("c", {"lookup": wide, "model": model}, min_tokens=2)
    prop = cascade.propose([DraftRequest(0, [1], 3, None, nodes=8)])
    assert prop.tokens == [[8, 8]] and prop.parents is None  # shallow: the model drafts
    assert cascade.stats() == {"drafted_by.lookup": 0, "drafted_by.model": 1}


def test_cascade_of_a_real_ngram_tree():
    cascade = CascadeDrafter("c", {"ngram": NgramDrafter("ngram", 1, 3), "model": Fixed("model", [8])})
    r = DraftRequest(0, SHARED, 3, None, nodes=8)
    prop = cascade.propose([r])
    assert prop.parents == [[-1, 0, 1, 0, 3]]
    check_tree(prop, 0, r)
