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


class Spy(Table):
    """Records (member, gamma, min_prob) of each request it is asked."""

    def __init__(self, name, paths, seen, gates=True):
        super().__init__(name, paths)
        self.seen, self.gates = seen, gates

    def propose(self, rs):
        self.seen.extend((self.name, r.gamma, r.min_prob, r.nodes) for r in rs)
        return super().propose(rs)


def test_requests_reach_the_members_unchanged_but_the_floor_only_those_that_gate():
    """The policy's confidence floor reaches the members that gate themselves; a member that does not
    (the target's int8 copy) drafts at the length asked, as it does alone."""
    seen = []
    asked = [DraftRequest(0, [7, 7], 3, None, 0.25, nodes=8)]
    a, b = Spy("a", {}, seen), Spy("b", {}, seen)
    a.trees = b.trees = True
    CascadeDrafter("c", {"a": a, "b": b}).propose(asked)
    assert seen == [("a", 3, 0.25, 8), ("b", 3, 0.25, 8)]
    seen.clear()
    lookup, copy = Spy("lookup", {}, seen), Spy("copy", {}, seen, gates=False)
    lookup.trees = True
    cascade = CascadeDrafter("c", {"lookup": lookup, "copy": copy})
    assert cascade.gates and cascade.trees  # so the policy sets a floor and a tree budget, for the lookup
    cascade.propose(asked)
    assert seen == [("lookup", 3, 0.25, 8), ("copy", 3, 0.0, 0)]


def test_gates_when_any_member_does_and_bad_settings_are_refused():
    class Ungated(Table):
        gates = False

    assert CascadeDrafter("c", {"a": Table("a", {}), "b": Ungated("b", {})}).gates
    assert not CascadeDrafter("c", {"a": Ungated("a", {}), "b": Ungated("b", {})}).gates
    with pytest.raises(ValueError, match="at least 2 members"):
        CascadeDrafter("c", {"a": Table("a", {})})
    with pytest.raises(ValueError, match="min_tokens"):
        CascadeDrafter("c", {"a": Table("a", {}), "b": Table("b", {})}, min_tokens=0)
