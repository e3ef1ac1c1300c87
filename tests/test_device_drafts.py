"""Feature-reading drafts, cascades and votes on the device step (engine/device_feature.py, device_compose.py): the
same completions as BatchLoop's token for token, the same drafts as the host drafters' for the same state (so the
same draft and acceptance counts per request), and no host read inside a queued step."""

from __future__ import annotations

import random

import pytest
import torch

from spin_batch.drafters.base import DraftRequest
from spin_batch.drafters.cascade import CascadeDrafter
from spin_batch.drafters.model import FeatureDrafter, ModelDrafter
from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.drafters.vote import VoteDrafter, _Pending, vote_path
from spin_batch.engine.device_compose import VoteDraft, draft_problem, vote
from spin_batch.engine.device_draft import StepDraft
from spin_batch.engine.device_feature import FeatureChain
from spin_batch.engine.device_step import DeviceDrafting, DeviceLoop
from spin_batch.engine.loop import BatchLoop
from spin_batch.models import execution
from spin_batch.models.distilled import TargetFeatures, load_draft
from spin_batch.models.loader import load_model
from spin_batch.models.segments import Segments
from spin_batch.selection.fixed import FixedDrafter
from test_device_step import MANY, _queue_200_steps, _requests, _run, _same, _settings, target  # noqa: F401

GAMMA = {1: 8, 4: 4, 16: 8}  # the draft length per slot count (both draft buckets)


def _feature(tiny_distilled, model, slots: int, max_len: int, name: str = "feat") -> FeatureDrafter:
    """A distilled draft that reads the target's features (two layers), as build_drafters makes it."""
    settings, _ = tiny_distilled
    draft = load_draft(settings.out / "d2x64", model, torch.float32, torch.device("cpu"))
    assert draft.feature_head is not None
    features = TargetFeatures(slots, max_len, model.spec.hidden_size, model.spec.rms_norm_eps, model.dtype,
                              torch.device("cpu"))
    return FeatureDrafter(name, draft, draft.allocate_cache(slots, max_len), features)


def _other(tiny_draft_dir, slots: int, max_len: int) -> ModelDrafter:
    draft = load_model(tiny_draft_dir, plan=execution.forced("c"))
    return ModelDrafter("other", draft, draft.allocate_cache(slots, max_len))


def _drafters(kind: str, model, tiny_distilled, tiny_draft_dir, slots: int, max_len: int) -> dict:
    """The drafters BatchLoop runs for `kind` (members first, the drafter under test last)."""
    if kind == "feature":
        return {"feat": _feature(tiny_distilled, model, slots, max_len)}
    ngram = NgramDrafter("ngram", 1, 3)
    if kind == "cascade":  # as the demo job's ngram-d1x384: the lookup, else the feature-reading draft
        feat = _feature(tiny_distilled, model, slots, max_len)
        return {"ngram": ngram, "feat": feat, kind: CascadeDrafter(kind, {"ngram": ngram, "feat": feat}, 2)}
    if kind == "cascade-model":
        other = _other(tiny_draft_dir, slots, max_len)
        return {"ngram": ngram, "other": other,
                kind: CascadeDrafter(kind, {"ngram": ngram, "other": other}, 3)}
    members = {"ngram": ngram, "other": _other(tiny_draft_dir, slots, max_len),
               "feat": _feature(tiny_distilled, model, slots, max_len)}
    return {**members, kind: VoteDrafter(kind, members, 0.5, slots)}


def _host(target, settings, drafters: dict, name: str, gamma: int):
    model, tok = target
    return BatchLoop(model, tok, settings, FixedDrafter(name, gamma), drafters,
                     model.allocate_cache(settings.slots, settings.max_model_len))


KINDS = ["feature", "cascade", "cascade-model", "vote"]
NAMES = {"feature": "feat"}  # the drafter's name per kind (else the kind)


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_device_drafts_equal_the_host_loops(target, tiny_distilled, tiny_draft_dir, slots, kind):
    """The completions of BatchLoop drafting with the same drafter at the same gamma, token for token; and, where
    both schedule a request's drafts alike, the same draft and acceptance counts per request: the device drafts
    the host's tokens."""
    model, tok = target
    settings, gamma = _settings(slots), GAMMA[slots]
    name = NAMES.get(kind, kind)
    want = _run(_host(target, settings, _drafters(kind, model, tiny_distilled, tiny_draft_dir, slots,
                                                  settings.max_model_len), name, gamma), tok, _requests(MANY))
    drafter = _drafters(kind, model, tiny_distilled, tiny_draft_dir, 1, 8)[name]
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=gamma), drafter)
    got = _run(loop, tok, _requests(MANY))
    _same(want, got)
    assert all(c.drafter_pulls.keys() == {name} for c in got.values())
    assert sum(c.num_accepted_draft_tokens for c in got.values()) > 0
    # A vote's weights at admission depend on when a freed slot is refilled, which is one step later on the device
    # step: at one slot both refill alike.
    if kind != "vote" or slots == 1:
        counts = {k: (c.num_spec_steps, c.num_draft_tokens, c.num_accepted_draft_tokens) for k, c in got.items()}
        assert counts == {k: (c.num_spec_steps, c.num_draft_tokens, c.num_accepted_draft_tokens)
                          for k, c in want.items()}


def test_feature_chain_drafts_what_the_host_drafts(target, tiny_distilled):
    """The same state, the same drafts: FeatureChain's greedy chains equal FeatureDrafter.propose's token for
    token, at the first proposal (the whole prompt caught up) and at the next ones (after commits of various
    lengths, the target's features written by verify forwards)."""
    model, tok = target
    slots, max_len, width = 6, 96, 8
    host = _feature(tiny_distilled, model, slots, max_len)
    chain = FeatureChain(host.model, model, slots, max_len, width)
    cache = model.allocate_cache(slots, max_len)
    history = torch.zeros(slots, max_len, dtype=torch.long)
    lengths = torch.ones(slots, dtype=torch.long)
    tokens = {s: tok.encode(p) for s, p in zip((4, 0, 2), MANY[:3])}
    for s, ids in tokens.items():  # the prompt but its last token prefilled: the features of positions < n - 1
        seg = Segments.build([(s, len(ids) - 1, 0)], model.device)
        _, hidden = model.forward_with_hidden(torch.tensor(ids[:-1]), seg, cache)
        host.features.write(seg, hidden)
        chain.admit(s, ids[:-1], 5, hidden)
    rows, gammas = torch.tensor([4, 0, 2, 5]), [8, 3, 6, 0]  # slot 5: a padding row of nothing
    rng = random.Random(0)
    for _ in range(4):
        for s, ids in tokens.items():
            history[s, : len(ids)] = torch.tensor(ids)
            lengths[s] = len(ids)
        drafts, counts = chain.draft(rows, history, lengths, torch.tensor(gammas), width)
        want = host.propose([DraftRequest(s, tokens[s], g, None) for s, g in zip((4, 0, 2), gammas)]).tokens
        assert counts.tolist() == gammas
        for r, w in enumerate(want):
            assert drafts[r, : gammas[r]].tolist() == w and drafts[r, gammas[r]:].tolist() == [0] * (8 - gammas[r])
        for s, w in zip((4, 0, 2), want):  # commit k drafts and one token of the target's; verify the new positions
            n, k = len(tokens[s]), rng.randint(0, len(w))
            tokens[s] = tokens[s] + w[:k] + [rng.randrange(model.spec.vocab_size)]
            seg = Segments.build([(s, k + 1, n - 1)], model.device)
            _, hidden = model.forward_with_hidden(torch.tensor(tokens[s][n - 1 : n + k]), seg, cache)
            host.features.write(seg, hidden)
            chain.verified(torch.tensor([s]), torch.tensor([n - 1]), hidden, k)


def test_vote_on_the_device_is_vote_path():
    """vote() equals vote_path on random member paths and weights (ties included: equal and repeated weights), and
    VoteDraft's weights learn as VoteDrafter.on_commit does, bit for bit (float64)."""
    rng = random.Random(0)
    for trial in range(300):
        M, B, G = rng.randint(2, 4), rng.randint(1, 5), rng.choice([1, 4, 8])
        paths = [[[rng.randint(0, 3) for _ in range(rng.randint(0, G))] for _ in range(B)] for _ in range(M)]
        weights = [[rng.choice([0.25, 0.5, 1 / 3, rng.random()]) for _ in range(M)] for _ in range(B)]
        drafts = torch.tensor([[p + [0] * (G - len(p)) for p in member] for member in paths])
        counts = torch.tensor([[len(p) for p in member] for member in paths])
        voted, n = vote(drafts, counts, torch.tensor(weights, dtype=torch.float64))
        for b in range(B):
            want, _ = vote_path([paths[i][b] for i in range(M)], weights[b])
            assert (voted[b, : n[b]].tolist(), n[b].item()) == (want, len(want)), (trial, b)
            assert voted[b, n[b]:].tolist() == [0] * (G - n[b].item())


def test_vote_weights_learn_as_the_host_vote():
    rng = random.Random(1)
    M, slots, G = 3, 5, 4
    host = VoteDrafter("vote", {f"m{i}": NgramDrafter(f"m{i}") for i in range(M)}, beta=0.3, slots=slots)
    dev = VoteDraft([StepDraft()] * M, 0.3, slots, torch.device("cpu"))
    history = torch.zeros(slots, 512, dtype=torch.long)
    lengths = torch.full((slots,), 3, dtype=torch.long)
    live = torch.ones(slots, dtype=torch.int32)
    for step in range(40):
        rows = torch.tensor(sorted(rng.sample(range(slots), rng.randint(1, slots))))
        gamma = torch.tensor([rng.choice([0, G, G]) for _ in rows])
        paths = [[[rng.randint(0, 2) for _ in range(rng.randint(0, int(g)))] for g in gamma] for _ in range(M)]
        drafts = torch.tensor([[p + [0] * (G - len(p)) for p in member] for member in paths])
        dev.paths = (drafts, torch.tensor([[len(p) for p in member] for member in paths]))
        before = lengths[rows].clone()
        done = []
        for b, s in enumerate(rows.tolist()):
            new = [rng.randint(0, 2) for _ in range(rng.randint(1, G + 1))]  # the accepted drafts and one token
            history[s, lengths[s] : lengths[s] + len(new)] = torch.tensor(new)
            lengths[s] += len(new)
            live[s] = int(rng.random() > 0.1)  # some finish: the host commits nothing to their drafters
            if gamma[b] > 0:  # the vote proposed for this slot
                host.pending[s] = _Pending(0, [paths[i][b] for i in range(M)], [], 0)
            if live[s] and gamma[b] > 0:
                host.on_commit(s, new)
            host.pending[s] = None
            if not live[s]:
                done.append(s)
        dev.committed(rows, before, gamma, lengths, live, history)
        assert dev.pooled.tolist() == host.pooled
        for s in range(slots):
            assert dev.weights[s].tolist() == host.weights[s], (step, s)
        for s in done:  # a new request takes the finished slot: the pooled weights
            host.on_admit(s)
            dev.weights[s] = dev.pooled
            live[s] = 1
    assert host.pooled != [1 / M] * M and len(set(host.pooled)) > 1  # the weights did move


@pytest.mark.parametrize("kind", ["feature", "cascade", "vote"])
def test_queuing_200_steps_with_each_drafter_kind_reads_nothing_back(target, tiny_distilled, tiny_draft_dir, kind):
    model, tok = target
    drafter = _drafters(kind, model, tiny_distilled, tiny_draft_dir, 1, 8)[NAMES.get(kind, kind)]
    loop = DeviceLoop(model, tok, _settings(4, max_model_len=2048, max_tokens=1900), DeviceDrafting(gamma=4), drafter)
    inside, _ = _queue_200_steps(loop, tok)
    assert sum(inside.values()) == 0, inside
    assert loop.steps == 200 and int(loop.counters[:4, 1].sum()) > 0  # the drafts were verified


def test_device_step_refuses_what_it_cannot_draft(target):
    """A model the device step cannot run a bucket's forward on, alone or as a cascade's or a vote's member: a clear
    refusal at construction."""
    model, tok = target

    class Foreign:  # a transformers-backend model, say
        vocab_ids = None

    foreign = ModelDrafter.__new__(ModelDrafter)
    foreign.name, foreign.model = "hf", Foreign()
    ngram = NgramDrafter("ngram")
    assert draft_problem(ngram) is None
    for drafter, why in ((foreign, "drafter 'hf': the device step drafts with n-gram or native model drafters"),
                         (CascadeDrafter("c", {"ngram": ngram, "hf": foreign}), "cascade 'c': drafter 'hf'"),
                         (VoteDrafter("v", {"ngram": ngram, "hf": foreign}), "vote 'v': drafter 'hf'")):
        with pytest.raises(ValueError, match=why):
            DeviceLoop(model, tok, _settings(2), DeviceDrafting(gamma=4), drafter)


def test_device_feature_cascade_on_the_triton_kernels(tiny_dir, tiny_distilled):
    """The GPU path on CPU (the Triton interpreter): a cascade of n-gram and a feature-reading draft, the draft's
    catch-up and chain from device-built packed indexes with the features as extra inputs; equal to BatchLoop on
    the same kernels, with the same draft and acceptance counts."""
    pytest.importorskip("triton", reason="triton is not importable")
    from spin_batch.models.execution import Execution
    from spin_batch.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    model = load_model(tiny_dir, plan=execution.forced("torch"),
                       execution=Execution(kernels="triton", cpu="torch", triton=True))
    assert model.kernels is not None
    settings = _settings(2, max_tokens=6)

    def drafters(slots, max_len):
        return _drafters("cascade", model, tiny_distilled, None, slots, max_len)

    want = _run(_host((model, tok), settings, drafters(2, settings.max_model_len), "cascade", 4), tok,
                _requests(MANY[:3]))
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4), drafters(1, 8)["cascade"])
    assert loop.chain.members[1].model.kernels is not None
    got = _run(loop, tok, _requests(MANY[:3]))
    _same(want, got)
    assert sum(c.num_draft_tokens for c in got.values()) > 0
    assert {k: (c.num_draft_tokens, c.num_accepted_draft_tokens) for k, c in got.items()} == \
        {k: (c.num_draft_tokens, c.num_accepted_draft_tokens) for k, c in want.items()}
