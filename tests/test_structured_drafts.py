"""Model drafters under a grammar (drafters/model.py mask_by_grammar, engine/structured.py DraftGrammar): every
model drafter kind, chains and trees, proposes only tokens the slot's grammar allows along its draft path, so
nothing is cut before verify; greedy constrained speculation still equals greedy constrained plain decoding;
acceptance goes up against the unmasked drafts; tokens the grammar forces mid-draft cost no draft forward; and
sampled masked drafts (q the masked distribution, forced tokens one-hot) keep the masked target distribution."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llguidance")

from spin_batch.drafters import model as model_module  # noqa: E402
from spin_batch.drafters.base import DraftRequest  # noqa: E402
from spin_batch.drafters.cascade import CascadeDrafter  # noqa: E402
from spin_batch.drafters.model import FeatureDrafter, ModelDrafter, mask_by_grammar  # noqa: E402
from spin_batch.engine import loop as loop_module  # noqa: E402
from spin_batch.engine import structured  # noqa: E402
from spin_batch.grammars import structured_from  # noqa: E402
from spin_batch.models.distilled import TargetFeatures, load_draft  # noqa: E402
from spin_batch.records import Request, RowParams  # noqa: E402
from spin_batch.sampling import SamplingParams  # noqa: E402
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation  # noqa: E402

from test_spec_equality import early_exit_1, int8_self_factory, ngram, other_model_factory  # noqa: E402
from test_structured import (CONSTRAINTS, N_DIST, N_EQUAL, SCHEMA, SIGMAS, make, masked_marginals,  # noqa: E402,F401
                             reference, requests, target, z_score)
from test_tree_loop import TreeShapes, watch_plans  # noqa: E402
from conftest import run_all as run, token_ids as ids  # noqa: E402


def _distilled(settings, name: str, features: bool):
    def factory(model, cache, slots):
        draft = load_draft(settings.out / name, model, torch.float32, torch.device("cpu"))
        own = draft.allocate_cache(slots, cache.max_len)
        if not features:
            return ModelDrafter("distilled", draft, own)
        buf = TargetFeatures(slots, cache.max_len, model.spec.hidden_size, model.spec.rms_norm_eps, model.dtype,
                             torch.device("cpu"))
        return FeatureDrafter("feat", draft, own, buf)

    return factory


def _cascade(draft_dir) -> list:
    """The factories of a cascade's members (the loop admits and commits them) and of the cascade over them."""
    members: dict = {}

    def member(make_one):
        def factory(model, cache, slots):
            d = make_one(model, cache, slots)
            members[d.name] = d
            return d

        return factory

    return [member(ngram), member(other_model_factory(draft_dir)),
            lambda model, cache, slots: CascadeDrafter("cascade", dict(members), min_tokens=2)]


def factories(kind: str, request) -> list:
    """The loop's drafters for one model drafter kind (a cascade with its members)."""
    if kind == "exit_1":
        return [early_exit_1]
    if kind == "int8":
        return [int8_self_factory(request.getfixturevalue("tiny_dir"))]
    if kind == "other":
        return [other_model_factory(request.getfixturevalue("tiny_draft_dir"))]
    if kind == "distilled":  # a 40-id head: the grammar's bitmask mapped into its vocabulary
        return [_distilled(request.getfixturevalue("tiny_distilled_plain")[0], "d1x64", False)]
    if kind == "feat":
        return [_distilled(request.getfixturevalue("tiny_distilled")[0], "d2x64", True)]
    return _cascade(request.getfixturevalue("tiny_draft_dir"))


def watch_drafts(loop) -> dict[str, int]:
    """Count the tokens the loop's model drafters (cascade members included) propose under a grammar, and those
    the grammar refuses: each node's token against the state after its path (anything after a stop token or the
    grammar's end is refused)."""
    seen = {"proposed": 0, "refused": 0}

    def checked(propose):
        def watching(reqs):
            got = propose(reqs)
            for j, r in enumerate(reqs):
                tokens, paths = got.tokens[j], []
                if r.grammar is None or not tokens:
                    continue
                for t, a in zip(tokens, got.tree(j) or range(-1, len(tokens) - 1)):
                    paths.append((paths[a] if a >= 0 else []) + [t])
                refused = r.grammar.refused([p[:-1] for p in paths])  # [n, V]
                seen["proposed"] += len(tokens)
                seen["refused"] += sum(bool(refused[k, p[-1]]) for k, p in enumerate(paths))
            return got

        return watching

    for d in loop.drafters.values():
        if isinstance(d, ModelDrafter):
            d.propose = checked(d.propose)
    return seen


KINDS = ["exit_1", "int8", "other", "distilled", "feat", "cascade"]


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
def test_model_drafts_propose_only_what_the_grammar_allows(target, reference, monkeypatch, request, kind, shape):
    """Every model drafter kind, chains and trees: no proposed token is one the grammar refuses (unmasked, these
    drafts propose many: a random or early-exit argmax is seldom a token the grammar allows), and the text is
    greedy constrained plain decoding's."""
    made = factories(kind, request)
    policy = FixedDrafter(kind, 4) if shape == "chain" else TreeShapes([kind])
    loop = make(target, 3, policy, made)
    seen, plans = watch_drafts(loop), watch_plans(loop)
    assert ids(run(loop, requests(N_EQUAL))) == reference
    assert seen["proposed"] > 0 and seen["refused"] == 0, seen
    if shape == "tree" and loop.drafters[kind].trees:  # (the int8 copy drafts chains only)
        assert plans["trees"] > 0, plans


@pytest.mark.parametrize("kind", ["exit_1", "other"])
def test_unmasked_drafts_would_be_refused_and_accepted_less(target, reference, monkeypatch, request, kind):
    """The test above can fail: with the drafter's mask off (the drafts before it), the same drafter proposes
    tokens the grammar refuses, and fewer of its draft tokens are accepted; the text is the same either way."""
    accepted = {}
    for masked in (True, False):
        with monkeypatch.context() as m:
            if not masked:
                m.setattr(model_module, "mask_by_grammar", lambda logits, *a: (logits, set()))
            loop = make(target, 3, FixedDrafter(kind, 4), factories(kind, request))
            seen = watch_drafts(loop)
            assert ids(run(loop, requests(N_EQUAL))) == reference
            accepted[masked] = loop.stats.summary()["drafters"][kind]["accepted_draft_tokens"]
            assert (seen["refused"] == 0) == masked, seen
    assert accepted[True] > accepted[False], accepted


def test_forced_tokens_mid_draft_cost_no_forward(target, monkeypatch, tiny_draft_dir):
    """After each token the draft picks, the tokens the grammar forces (JSON keys, quotes, colons) join the chain
    with no draft forward of their own: fewer forwards than proposed tokens (one a token without), same text."""
    reqs = requests(6, constraints=[structured_from({"json": SCHEMA})])
    runs = {}
    for jump in (True, False):
        monkeypatch.setattr(structured, "JUMP_FORWARD", jump)
        loop = make(target, 1, FixedDrafter("other", 4), [other_model_factory(tiny_draft_dir)])
        drafter = loop.drafters["other"]
        forwards, proposed, step, propose = [0], [0], drafter._step, drafter.propose
        drafter._step = lambda *a: (forwards.__setitem__(0, forwards[0] + 1), step(*a))[1]
        drafter.propose = lambda rs: (p := propose(rs),
                                      proposed.__setitem__(0, proposed[0] + sum(map(len, p.tokens))))[0]
        runs[jump] = ids(run(loop, reqs)), forwards[0], proposed[0]
    (on, on_fwd, on_tok), (off, off_fwd, off_tok) = runs[True], runs[False]
    assert on == off
    assert off_fwd >= off_tok > 0  # each drafted token its own forward (the catch-up's included)
    assert on_fwd < on_tok, runs


def test_the_mask_is_mapped_into_a_vocabulary_subset():
    """A draft head over target ids [7, 3, 9, 1]: a row's refused target ids become its head rows; a row whose
    grammar allows none of the head's ids is reported (and left alone); an unconstrained row is untouched."""

    class Refuses:
        def __init__(self, allowed: list[set[int]]):
            self.allowed = allowed

        def refused(self, paths):
            out = torch.ones(len(paths), 12, dtype=torch.bool)
            for r, path in enumerate(paths):
                out[r, sorted(self.allowed[len(path)])] = False
            return out

    g = Refuses([{3, 1, 11}, {5}])
    reqs = [DraftRequest(0, [1], 2, None, grammar=g), DraftRequest(0, [1], 2, None, grammar=g),
            DraftRequest(1, [1], 2, None)]
    logits = torch.arange(12.0).view(3, 4)
    got, dead = mask_by_grammar(logits, reqs, [[], [4], []], torch.tensor([7, 3, 9, 1]))
    inf = -torch.inf
    assert torch.equal(got[0], torch.tensor([inf, 1.0, inf, 3.0]))
    assert torch.equal(got[1], logits[1]) and dead == {1}
    assert torch.equal(got[2], logits[2])
    assert mask_by_grammar(logits, [reqs[2]] * 3, [[], [], []], None)[0] is logits  # none constrained: no work


@pytest.mark.parametrize("kind", ["exit_1"])
def test_sampled_masked_drafts_follow_the_masked_distribution(target, monkeypatch, request, kind):
    """Rejection sampling with an early-exit draft whose q is its masked distribution, on a regex that forces text
    after the first letters (the forced tokens join the draft with a one-hot q): the first two tokens'
    frequencies match the masked target's marginals."""
    model, tok = target
    s = structured_from({"regex": "[a-f]{1,2}-xyz-[a-f]{1,3}"})
    prompt = tok.encode("list three colours")
    forced = [0]
    original = structured.DraftGrammar.forced

    def counting(self, path, cap):
        got = original(self, path, cap)
        forced[0] += len(got)
        return got

    monkeypatch.setattr(structured.DraftGrammar, "forced", counting)
    loop = make(target, 16, FixedDrafter(kind, 2), factories(kind, request),
                sampling=SamplingParams(1.0, sampler="rejection"), max_tokens=3)
    reqs = [Request(f"m#{i}", str(i), "list three colours", None, params=RowParams(structured=s))
            for i in range(N_DIST)]
    got = run(loop, reqs)
    first, second = (torch.zeros(model.spec.vocab_size, dtype=torch.float64) for _ in range(2))
    for c in got.values():
        first[c.token_ids[0]] += 1
        second[c.token_ids[1]] += 1
    p1, p2 = masked_marginals(target, prompt, s)
    assert z_score(p1, first) < SIGMAS and z_score(p2, second) < SIGMAS
    assert loop.stats.summary()["drafters"][kind]["draft_tokens"] > 0 and forced[0] > 0


def test_plain_decoding_builds_no_draft_grammar(target, reference, monkeypatch):
    """No drafter asked: no draft grammar is made (the drafters' masks cost nothing there)."""
    made = []
    monkeypatch.setattr(loop_module, "DraftGrammar", lambda state: made.append(state))
    assert ids(run(make(target, 2, NoSpeculation()), requests(N_EQUAL))) == reference
    assert not made
