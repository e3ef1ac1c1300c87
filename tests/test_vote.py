"""The vote drafter: hand-built trees, the weighted-majority update, and lossless output."""

from __future__ import annotations

import pytest

from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
from spin_batch.drafters.vote import VoteDrafter, agrees, vote_path


def test_majority_path_wins_over_heaviest_single_member():
    paths = [[1, 2, 3], [1, 5, 6], [1, 5, 7]]
    path, members = vote_path(paths, [0.4, 0.3, 0.3])
    assert path[:2] == [1, 5]  # 0.6 support for 5 beats 0.4 for 2
    assert path == [1, 5, 6] and members == [1]  # then the tie 6 vs 7 goes to the earlier member


def test_ties_are_broken_by_member_order():
    assert vote_path([[4, 4], [9, 9]], [0.5, 0.5])[0] == [4, 4]
    assert vote_path([[9, 9], [4, 4]], [0.5, 0.5])[0] == [9, 9]


def test_empty_and_short_proposals():
    assert vote_path([[], []], [0.5, 0.5])[0] == []
    assert vote_path([[], [3, 4]], [0.9, 0.1])[0] == [3, 4]  # an empty member has no say
    assert vote_path([[3], [3, 4, 5]], [0.9, 0.1])[0] == [3, 4, 5]  # continue while anyone does


class Fixed(Drafter):
    kind = "fixed"

    def __init__(self, name, path):
        super().__init__(name)
        self.path = path

    def propose(self, reqs):
        return Proposal([list(self.path[: r.gamma]) for r in reqs], [None] * len(reqs))


def test_weights_follow_the_weighted_majority_rule():
    vote = VoteDrafter("v", {"a": Fixed("a", [1, 2]), "b": Fixed("b", [1, 3]), "c": Fixed("c", [])}, beta=0.5)
    vote.on_admit(0)
    prompt = [7, 7]
    prop = vote.propose([DraftRequest(0, prompt, 2, None)])
    assert prop.tokens == [[1, 2]] and prop.probs == [None]
    vote.on_commit(0, prompt + [1, 3])  # target accepted 1, corrected to 3: b was right, a wrong
    w = vote.weights[0]
    # a *= 0.5; b and c (no proposal) unchanged; renormalised
    assert w == pytest.approx([0.5 / 2.5, 1 / 2.5, 1 / 2.5])
    assert vote.pooled == pytest.approx(w)
    assert agrees([1, 3, 9], [1, 3]) is True and agrees([], [1]) is None
    # the next proposal now follows b
    assert vote.propose([DraftRequest(0, prompt + [1, 3], 2, None)]).tokens == [[1, 3]]


def test_new_requests_start_from_pooled_weights():
    vote = VoteDrafter("v", {"a": Fixed("a", [1]), "b": Fixed("b", [2])}, beta=0.1, slots=2)
    vote.propose([DraftRequest(0, [5], 1, None)])
    vote.on_commit(0, [5, 2])
    vote.on_admit(1)
    assert vote.weights[1] == pytest.approx(vote.pooled) and vote.weights[1][1] > 0.8
