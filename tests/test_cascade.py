"""The cascade drafter: which member drafts for which slot, and what the others are asked."""

from __future__ import annotations

import pytest

from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
from spin_batch.drafters.cascade import CascadeDrafter


class Table(Drafter):
    """Proposes a fixed path per slot; records the slots it was asked for."""

    gates = True

    def __init__(self, name, paths):
        super().__init__(name)
        self.paths = paths
        self.asked: list[list[int]] = []

    def propose(self, reqs):
        self.asked.append([r.slot for r in reqs])
        return Proposal([list(self.paths.get(r.slot, []))[: r.gamma] for r in reqs], [None] * len(reqs))


def reqs(slots, gamma=4, min_prob=0.0):
    return [DraftRequest(s, [7, 7], gamma, None, min_prob) for s in slots]


def test_first_member_with_enough_tokens_drafts_and_later_members_see_only_the_rest():
    lookup = Table("lookup", {0: [1, 2, 3], 1: [4], 2: []})
    model = Table("model", {0: [9, 9], 1: [5, 6], 2: [8]})
    cascade = CascadeDrafter("c", {"lookup": lookup, "model": model}, min_tokens=2)
    prop = cascade.propose(reqs([0, 1, 2]))
    assert prop.tokens == [[1, 2, 3], [5, 6], [8]]
    assert lookup.asked == [[0, 1, 2]] and model.asked == [[1, 2]]  # slot 0 never reaches the model
    assert cascade.stats() == {"drafted_by.lookup": 1, "drafted_by.model": 2}


def test_the_last_member_is_taken_as_it_is_and_nothing_runs_once_every_slot_is_served():
    lookup = Table("lookup", {0: [1, 2]})
    model = Table("model", {})
    cascade = CascadeDrafter("c", {"lookup": lookup, "model": model}, min_tokens=2)
    assert cascade.propose(reqs([0])).tokens == [[1, 2]]
    assert model.asked == []
    assert cascade.propose(reqs([1])).tokens == [[]]  # the model proposed nothing either


def test_min_tokens_is_capped_by_gamma():
    """Asked for one token, a one-token lookup is enough."""
    lookup = Table("lookup", {0: [1, 2]})
    model = Table("model", {0: [9]})
    cascade = CascadeDrafter("c", {"lookup": lookup, "model": model}, min_tokens=2)
    assert cascade.propose(reqs([0], gamma=1)).tokens == [[1]]
    assert model.asked == []


def test_requests_reach_the_members_unchanged():
    """The policy's confidence floor reaches the members, which gate themselves."""
    seen = []

    class Spy(Table):
        def propose(self, rs):
            seen.extend((r.gamma, r.min_prob) for r in rs)
            return super().propose(rs)

    cascade = CascadeDrafter("c", {"a": Spy("a", {}), "b": Spy("b", {})})
    cascade.propose(reqs([0], gamma=3, min_prob=0.25))
    assert seen == [(3, 0.25), (3, 0.25)]


def test_gates_only_when_every_member_does_and_bad_settings_are_refused():
    class Ungated(Table):
        gates = False

    assert not CascadeDrafter("c", {"a": Table("a", {}), "b": Ungated("b", {})}).gates
    with pytest.raises(ValueError, match="at least 2 members"):
        CascadeDrafter("c", {"a": Table("a", {})})
    with pytest.raises(ValueError, match="min_tokens"):
        CascadeDrafter("c", {"a": Table("a", {}), "b": Table("b", {})}, min_tokens=0)
