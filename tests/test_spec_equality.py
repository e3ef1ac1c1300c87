"""Lossless greedy: speculative output equals autoregressive output, token for token.

Each drafter kind runs with a drafter that (almost) always agrees, one that almost never does,
and mixed gamma (0 included) within one batch, at slots 1, 3 and 8. The autoregressive
reference is our own loop with no drafts, itself checked against transformers' generate.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
from spin_batch.drafters.early_exit import EarlyExitDrafter
from spin_batch.drafters.model import ModelDrafter
from spin_batch.drafters.ngram import NgramDrafter, lookup
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation
from spin_batch.selection.policy import Choice, Policy, StepChoice
from spin_batch.sampling import SamplingParams
from spin_batch.records import Completion, Request
from spin_batch.models import execution
from spin_batch.models.checkpoint import load_state_dict
from spin_batch.models.loader import load_model, load_tokenizer

PROMPTS = [
    "the quick brown fox jumps over the lazy dog. the quick brown fox",
    "list three colours: red, green and blue. list three colours:",
    "def add(a, b):\n    return a + b\ndef add(",
    "once upon a time",
    "compute 12 * 7 = 84 and 9 + 10 =",
    "what causes the tides?",
    "rewrite this sentence in a formal tone please",
    "red green blue red green blue red",
    "a",
    "the moon pulls on the oceans and the moon",
    "12 12 12 12",
]
MAX_TOKENS = 20


class RandomDrafter(Drafter):
    """Proposes random tokens: the target almost never agrees."""

    kind = "random"

    def __init__(self, vocab: int):
        super().__init__("random")
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        return Proposal([torch.randint(0, self.vocab, (r.gamma,), generator=self.gen).tolist() for r in reqs],
                        [None] * len(reqs))


class MixedGamma(Policy):
    """Different gamma per slot and per step, 0 included, cycling over the drafters."""

    def __init__(self, names: list[str], max_gamma: int = 5):
        self.names = names
        self.max_gamma = max_gamma
        self.t = 0

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        self.t += 1
        out = []
        for s, cap in zip(slots, caps):
            k = s + self.t
            g = min(k % (self.max_gamma + 1), cap)
            name = self.names[(k // (self.max_gamma + 1)) % len(self.names)]
            out.append(Choice(name, g) if g else Choice(None, 0))
        return StepChoice.of(out)


@pytest.fixture(scope="module", params=["c", "torch"])
def target(request, tiny_dir):
    """The target on each CPU path the planner may choose (cpu_plan.py): our C decoder (each row computed
    alone), and oneDNN with torch's attention (whose results may depend on the batch: greedy equality
    must hold there too)."""
    model = load_model(tiny_dir, plan=execution.forced(request.param))
    assert (model.c_decoder is not None) == (request.param == "c")
    return model, load_tokenizer(tiny_dir)


def make_loop(target_and_tok, slots: int, policy: Policy, drafter_factories=()) -> BatchLoop:
    model, tok = target_and_tok
    settings = LoopSettings(slots=slots, max_model_len=128, max_num_batched_tokens=64, max_tokens=MAX_TOKENS,
                            sampling=SamplingParams(), eos_token_ids=frozenset(), ignore_eos=True)
    cache = model.allocate_cache(slots, settings.max_model_len)
    drafters = {d.name: d for d in (f(model, cache, slots) for f in drafter_factories)}
    return BatchLoop(model, tok, settings, policy, drafters, cache)


def run(loop: BatchLoop, prompts=PROMPTS) -> dict[str, list[int]]:
    """Greedy token ids per request id."""
    tok = loop.tok
    reqs = [Request(source=f"mem#{i}", id=str(i), prompt=p, messages=None) for i, p in enumerate(prompts)]
    done: list[Completion] = []

    def encode(r: Request) -> list[int]:
        return tok.encode(r.prompt)

    loop.run(iter(reqs), encode, done.append)
    assert len(done) == len(prompts) and all(c.status == "ok" for c in done)
    return {c.request.id: list(c.token_ids) for c in done}


@pytest.fixture(scope="module")
def reference(target):
    return run(make_loop(target, 1, NoSpeculation()))


def test_reference_matches_transformers_generate(tiny_dir, target, reference):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    _, tok = target
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([tok.encode(p)])
        out = hf.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=tok.pad_token_id)
        assert out[0, ids.shape[1]:].tolist() == reference[str(i)], f"prompt {i}"


@pytest.mark.parametrize("slots", [3, 7])
def test_autoregressive_same_text_at_any_batch_size(target, reference, slots):
    assert run(make_loop(target, slots, NoSpeculation())) == reference


def early_exit_all(model, cache, slots):
    return EarlyExitDrafter("exit_all", model, cache, model.spec.num_layers)


def early_exit_1(model, cache, slots):
    return EarlyExitDrafter("exit_1", model, cache, 1)


def int8_self_factory(model_dir):
    """The target's int8 copy as an early-exit draft over the target's cache (quantize: int8)."""
    def int8_self(model, cache, slots):
        return EarlyExitDrafter("int8", model, cache, None, model.int8_copy(load_state_dict(model_dir)))

    return int8_self


def self_model(model, cache, slots):
    """The target as its own separate model drafter (own cache): always agrees."""
    return ModelDrafter("self", model, model.allocate_cache(slots, cache.max_len))


def other_model_factory(draft_dir):
    def other_model(model, cache, slots):
        m = load_model(draft_dir)
        return ModelDrafter("other", m, m.allocate_cache(slots, cache.max_len))

    return other_model


def ngram(model, cache, slots):
    return NgramDrafter("ngram", 1, 3)


def random_drafter(model, cache, slots):
    return RandomDrafter(model.spec.vocab_size)


AGREEING = {"early_exit": ("exit_all", early_exit_all), "model": ("self", self_model)}
DISAGREEING = {"early_exit": ("exit_1", early_exit_1), "ngram": ("ngram", ngram), "random": ("random", random_drafter)}


@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("kind", sorted(AGREEING))
def test_agreeing_drafter_equals_autoregressive(target, reference, kind, slots):
    name, factory = AGREEING[kind]
    loop = make_loop(target, slots, FixedDrafter(name, 4), [factory])
    assert run(loop) == reference
    assert loop.stats.summary()["drafters"][name]["acceptance_rate"] > 0.9  # it really did agree, so long drafts were accepted


@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("kind", sorted(DISAGREEING))
def test_disagreeing_drafter_equals_autoregressive(target, reference, kind, slots):
    name, factory = DISAGREEING[kind]
    loop = make_loop(target, slots, FixedDrafter(name, 4), [factory])
    assert run(loop) == reference
    assert loop.stats.summary()["drafters"][name]["draft_tokens"] > 0


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_int8_copy_of_the_target_drafts_losslessly(target, reference, tiny_dir, slots):
    """Its K/V go into the target's cache past the committed tokens; verification overwrites them."""
    loop = make_loop(target, slots, FixedDrafter("int8", 4), [int8_self_factory(tiny_dir)])
    drafter = loop.drafters["int8"]
    assert not drafter.gates and not drafter.trees and drafter.model is not target[0]
    assert run(loop) == reference
    stats = loop.stats.summary()["drafters"]["int8"]
    assert stats["draft_tokens"] > 0 and stats["acceptance_rate"] > 0.5  # a close copy: most drafts hold


def counting_forwards(drafter) -> list[int]:
    """Rows fed to each of the drafter's forwards, appended as they run."""
    fed, step = [], drafter._step
    drafter._step = lambda flat, seg, extra, rows: (fed.append(len(flat)), step(flat, seg, extra, rows))[1]
    return fed


@pytest.mark.parametrize("slots", [1, 3])
@pytest.mark.parametrize("kind", ["int8", "exit_all"])
def test_lookahead_guesses_change_the_forwards_not_the_drafts(target, reference, tiny_dir, kind, slots):
    """Guessed tokens fed after a chain's real one (drafters/model.py, lookahead): every proposal is the draft's
    own chain, now run past gamma where the last forward's guesses confirm it, and the same output, in fewer
    forwards per draft token where the text repeats; ungated (the int8 copy) and gated (all layers of the
    target, its confidence product taken row by row under a floor that cuts nothing)."""
    factory = {"int8": int8_self_factory(tiny_dir), "exit_all": early_exit_all}[kind]
    runs = {}
    for lookahead in (0, 3):
        policy = FixedDrafter(kind, 5) if kind == "int8" else GatedFixed(kind, 1e-30)
        loop = make_loop(target, slots, policy, [factory])
        drafter = loop.drafters[kind]
        drafter.lookahead = lookahead
        proposals, past, fed, propose, counting = [], [], [], drafter.propose, [True]
        step = drafter._step
        drafter._step = lambda flat, seg, extra, rows: (counting[0] and fed.append(len(flat)),
                                                        step(flat, seg, extra, rows))[1]

        def checked(reqs, propose=propose, drafter=drafter, proposals=proposals, past=past, lookahead=lookahead):
            got = propose(reqs)
            proposals.extend(got.tokens)
            for r, p in zip(reqs, got.tokens):
                assert len(p) <= r.gamma + min(lookahead, r.room)  # past gamma by at most lookahead, within room
            if lookahead and any(len(p) > r.gamma for r, p in zip(reqs, got.tokens)):
                # the draft's own chain to the same length, drafted without guesses: the same tokens
                counting[0], drafter.lookahead = False, 0
                own = propose([replace(r, gamma=max(len(p), 1), room=0) for r, p in zip(reqs, got.tokens)])
                counting[0], drafter.lookahead = True, lookahead
                assert [o[: len(p)] for o, p in zip(own.tokens, got.tokens)] == got.tokens
                past.append(len(own.tokens))
            return got

        drafter.propose = checked
        assert run(loop) == reference
        runs[lookahead] = proposals, past, fed
    (plain, plain_past, plain_fed), (guessed, guessed_past, guessed_fed) = runs[0], runs[3]
    assert guessed_past and not plain_past  # some chains ran past gamma, and only with guesses
    plain_tokens, guessed_tokens = sum(map(len, plain)), sum(map(len, guessed))
    assert plain_tokens > 0
    if slots == 1:  # (at 3 slots a forward takes guesses only where one chain is left: too few to compare)
        assert len(guessed_fed) / guessed_tokens < len(plain_fed) / plain_tokens  # confirmed guesses saved forwards
        assert sum(guessed_fed) > sum(plain_fed)  # ...by feeding more rows


def test_lookahead_guesses_what_followed_the_suffix():
    d = ModelDrafter.__new__(ModelDrafter)
    d.lookahead = 3
    r = DraftRequest(0, [7, 1, 2, 3, 4, 9, 1, 2], 6, None)
    assert d._guess(r, []) == [3, 4, 9]  # after "1 2"
    assert d._guess(r, [3]) == [4, 9, 1]  # after "1 2 3", the draft extends the suffix
    assert d._guess(r, [3, 4, 9]) == [1, 2]  # capped: the real row drafts the 4th token, the guesses 5 and 6
    assert d._guess(r, [3, 4, 9, 1]) == [2]
    assert d._guess(r, [3, 4, 9, 1, 2]) == []  # the real row drafts the last one
    roomy = replace(r, room=2)  # room past gamma: guesses may run 2 tokens further (DraftRequest.room)
    assert d._guess(roomy, [3, 4, 9]) == [1, 2, 3]
    assert d._guess(roomy, [3, 4, 9, 1, 2]) == [3, 4]
    assert d._guess(roomy, [3, 4, 9, 1, 2, 3, 4]) == []
    assert d._guess(DraftRequest(0, [5, 6, 7], 6, None), []) == []  # no earlier occurrence
    assert d._guess(DraftRequest(0, r.tokens, 6, None, sp=SamplingParams(temperature=1.0)), []) == []


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_model_drafter_other_model_equals_autoregressive(target, reference, tiny_draft_dir, slots):
    loop = make_loop(target, slots, FixedDrafter("other", 3), [other_model_factory(tiny_draft_dir)])
    assert run(loop) == reference


class GatedFixed(Policy):
    """One drafter, gamma 5, with a confidence floor (Choice.min_prob)."""

    def __init__(self, name: str, floor: float):
        self.name, self.floor = name, floor

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        return StepChoice.of([Choice(self.name, min(5, c), self.floor) if c else Choice(None, 0) for c in caps])


@pytest.mark.parametrize("slots", [1, 8])
@pytest.mark.parametrize("kind", ["self", "other", "exit_1"])
def test_confidence_gated_model_drafter_equals_autoregressive(target, reference, tiny_draft_dir, kind, slots):
    factory = {"self": self_model, "other": other_model_factory(tiny_draft_dir), "exit_1": early_exit_1}[kind]
    # a floor no chain falls under: the gate is consulted but cuts nothing; it records the draft's top probabilities
    probe = make_loop(target, slots, GatedFixed(kind, 1e-30), [factory])
    drafter, tops = probe.drafters[kind], []
    top_prob = drafter._top_prob
    drafter._top_prob = lambda logits, sp: (t := top_prob(logits, sp), tops.extend(t))[0]
    assert run(probe) == reference
    drafted_all = probe.stats.summary()["drafters"][kind]["draft_tokens"]
    assert tops
    floor = sorted(tops)[len(tops) // 2]  # the median draft position falls under it
    gated = make_loop(target, slots, GatedFixed(kind, floor), [factory])
    assert run(gated) == reference
    d = gated.stats.summary()["drafters"][kind]
    assert 0 < d["draft_tokens"] < 0.9 * drafted_all, (d, drafted_all)


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_mixed_gamma_and_drafters_in_one_batch(target, reference, tiny_draft_dir, slots):
    factories = [early_exit_all, early_exit_1, self_model, other_model_factory(tiny_draft_dir), ngram,
                 random_drafter]
    names = ["exit_all", "exit_1", "self", "other", "ngram", "random"]
    loop = make_loop(target, slots, MixedGamma(names), factories)
    assert run(loop) == reference
    pulls = loop.stats.summary()["drafters"]
    assert {n for n in names if pulls.get(n, {}).get("pulls")} == set(names)


def test_small_token_budget_chunks_prefill(target, reference):
    """A per-step budget smaller than the prompts: prefill is chunked across steps."""
    model, tok = target
    settings = LoopSettings(slots=3, max_model_len=128, max_num_batched_tokens=3, max_tokens=MAX_TOKENS,
                            sampling=SamplingParams(), ignore_eos=True)
    cache = model.allocate_cache(3, 128)
    loop = BatchLoop(model, tok, settings, FixedDrafter("exit_all", 3),
                     {"exit_all": early_exit_all(model, cache, 3)}, cache)
    assert run(loop) == reference


class DrainWatch(NoSpeculation):
    """Plain decoding that records, at on_drain, how many requests were admitted and steps run."""

    def __init__(self):
        self.admitted = 0
        self.steps = lambda: 0  # set to the loop's step counter
        self.drains: list[tuple[int, int]] = []

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        self.admitted += 1

    def on_drain(self) -> None:
        self.drains.append((self.admitted, self.steps()))


@pytest.mark.parametrize("slots", [3, len(PROMPTS)])
def test_the_policy_hears_of_the_drain_as_the_last_request_is_admitted(target, reference, slots):
    """The loop reads one request past a full batch, so the policy learns the stream is done as soon as
    its last request is in a slot (with as many slots as requests: before the first step), and the
    request read ahead is neither lost nor run twice."""
    policy = DrainWatch()
    loop = make_loop(target, slots, policy)
    policy.steps = lambda: int(loop.stats.totals["steps"])
    assert run(loop) == reference
    assert len(policy.drains) == 1
    admitted, steps = policy.drains[0]
    assert admitted == len(PROMPTS)
    if slots == len(PROMPTS):
        assert steps == 0
    else:
        assert 0 < steps < policy.steps()

def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2], gamma=3, min_ngram=1, max_ngram=3) == [3, 9, 1]
    assert lookup([5, 6, 7], gamma=2, min_ngram=1, max_ngram=3) == []
    assert lookup([4, 4, 4], gamma=4, min_ngram=1, max_ngram=2) == [4]  # may propose fewer than asked
    # the longest n-gram wins over a later shorter match
    assert lookup([1, 2, 8, 2, 7, 1, 2], gamma=1, min_ngram=1, max_ngram=2) == [8]


def test_ngram_gate_learns_its_acceptance_per_match_length():
    d = NgramDrafter("ngram", 1, 3)
    text = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # a 3-gram match: drafts 4, 5, 6
    assert d.propose([DraftRequest(0, text, 3, None)]).tokens == [[4, 5, 6]]
    d.on_commit(0, text + [4, 5, 6, 9])  # all three accepted, then a bonus token
    assert d.rate(3) == pytest.approx(6 / 7)  # prior 3:1, then 3 accepted
    assert d.propose([DraftRequest(0, text, 3, None)]).tokens == [[4, 5, 6]]
    d.on_commit(0, text + [4, 7])  # one accepted, then a correction
    assert d.rate(3) == pytest.approx(7 / 9)
    # a floor of 0.5 keeps l tokens while (7/9)^l >= 0.5: two of them
    assert d.propose([DraftRequest(0, text, 3, None)]).tokens == [[4, 5, 6]]  # ungated: all
    d.on_admit(0)  # a new request: the pending draft is dropped, the statistics stay
    assert d.propose([DraftRequest(0, text, 3, None, min_prob=0.5)]).tokens == [[4, 5]]
    # a 1-gram match still has the prior rate 0.75: two tokens at floor 0.5, none at 0.8
    one = [7, 8, 9, 7]
    assert d.propose([DraftRequest(1, one, 3, None, min_prob=0.5)]).tokens == [[8, 9]]
    assert d.propose([DraftRequest(1, one, 3, None, min_prob=0.8)]).tokens == [[]]


@pytest.mark.parametrize("slots", [1, 8])
def test_confidence_gated_ngram_equals_autoregressive(target, reference, slots):
    ungated = make_loop(target, slots, GatedFixed("ngram", 0.0), [ngram])
    assert run(ungated) == reference
    gated = make_loop(target, slots, GatedFixed("ngram", 0.6), [ngram])
    assert run(gated) == reference
    drafter = gated.drafters["ngram"]
    assert sum(a + r for a, r in drafter.outcomes.values()) > 2 * len(drafter.outcomes)  # it learned
    got, all_ = (lp.stats.summary()["drafters"]["ngram"]["draft_tokens"] for lp in (gated, ungated))
    assert got < all_


@pytest.mark.parametrize("selector", ["ucb", "thompson", "round_robin", "none"])
def test_bandit_selectors_equal_autoregressive(target, reference, tiny_draft_dir, selector):
    from spin_batch.selection.factory import make_policy

    factories = [early_exit_all, early_exit_1, other_model_factory(tiny_draft_dir), ngram]
    names = ["exit_all", "exit_1", "other", "ngram"]
    loop = make_loop(target, 3, NoSpeculation(), factories)
    loop.policy = make_policy(selector, loop.drafters, 4, seed=1)  # the model drafters get confidence floors
    assert run(loop) == reference
    pulls = loop.stats.summary()["drafters"]
    used = {n for n in names if pulls.get(n, {}).get("pulls")}
    assert used if selector != "none" else not used


@pytest.mark.parametrize("slots", [1, 8])
def test_vote_drafter_equals_autoregressive(target, reference, tiny_draft_dir, slots):
    from spin_batch.drafters.vote import VoteDrafter

    model, tok = target
    settings = LoopSettings(slots=slots, max_model_len=128, max_num_batched_tokens=64, max_tokens=MAX_TOKENS,
                            sampling=SamplingParams(), ignore_eos=True)
    cache = model.allocate_cache(slots, 128)
    members = {d.name: d for d in (early_exit_all(model, cache, slots), other_model_factory(tiny_draft_dir)(
        model, cache, slots), ngram(model, cache, slots))}
    vote = VoteDrafter("vote", members, beta=0.5, slots=slots)
    loop = BatchLoop(model, tok, settings, FixedDrafter("vote", 4), {**members, "vote": vote}, cache)
    assert run(loop) == reference
    assert vote.stats()["proposals"] > 0


@pytest.mark.parametrize("slots", [1, 8])
def test_cascade_drafter_equals_autoregressive(target, reference, tiny_draft_dir, slots):
    """n-gram first, a separate model where the lookup keeps under 2 tokens: the model catches up on the
    steps it sat out, and the output is autoregressive's."""
    from spin_batch.drafters.cascade import CascadeDrafter

    model, tok = target
    settings = LoopSettings(slots=slots, max_model_len=128, max_num_batched_tokens=64, max_tokens=MAX_TOKENS,
                            sampling=SamplingParams(), ignore_eos=True)
    cache = model.allocate_cache(slots, 128)
    members = {d.name: d for d in (ngram(model, cache, slots), other_model_factory(tiny_draft_dir)(model, cache, slots))}
    cascade = CascadeDrafter("cascade", members, min_tokens=2)
    loop = BatchLoop(model, tok, settings, FixedDrafter("cascade", 4), {**members, "cascade": cascade}, cache)
    assert run(loop) == reference
    used = cascade.stats()
    assert all(used.values()), used  # both members drafted for some steps


@pytest.fixture(scope="module")
def kernel_target(tiny_dir):
    """The same tiny target with the Triton kernels forced on (CPU: the Triton interpreter)."""
    pytest.importorskip("triton")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    old = os.environ.get("SPIN_BATCH_KERNELS")
    os.environ["SPIN_BATCH_KERNELS"] = "on"
    try:
        model = load_model(tiny_dir)
    finally:
        if old is None:
            del os.environ["SPIN_BATCH_KERNELS"]
        else:
            os.environ["SPIN_BATCH_KERNELS"] = old
    assert model.kernels is not None
    return model, load_tokenizer(tiny_dir)


KERNEL_PROMPTS = PROMPTS[:5]


def test_kernels_forced_on_equal_autoregressive(kernel_target, reference, tiny_draft_dir):
    """Greedy equality with kernels on: plain decoding, and mixed drafters and gamma at slots 3."""
    want = {k: v for k, v in reference.items() if int(k) < len(KERNEL_PROMPTS)}
    assert run(make_loop(kernel_target, 3, NoSpeculation()), KERNEL_PROMPTS) == want
    factories = [early_exit_all, early_exit_1, other_model_factory(tiny_draft_dir), ngram, random_drafter]
    names = ["exit_all", "exit_1", "other", "ngram", "random"]
    assert run(make_loop(kernel_target, 3, MixedGamma(names), factories), KERNEL_PROMPTS) == want


def test_kernels_forced_on_sampling_runs_the_fused_accept(kernel_target, tiny_draft_dir, monkeypatch):
    """Sampling with kernels on goes through verify.accept_fused (q-drafts from a model drafter and
    deterministic n-gram drafts in one launch); every request's stream makes it reproducible."""
    from dataclasses import replace

    from spin_batch.engine import verify as verify_module

    calls = []
    fused = verify_module.accept_fused
    monkeypatch.setattr(verify_module, "accept_fused", lambda *a: calls.append(a[5]) or fused(*a))
    outs = []
    for _ in range(2):
        lp = make_loop(kernel_target, 3, MixedGamma(["other", "ngram"]), [other_model_factory(tiny_draft_dir), ngram])
        lp.cfg = replace(lp.cfg, sampling=SamplingParams(temperature=1.0, top_k=20, sampler="rejection"))
        outs.append(run(lp, KERNEL_PROMPTS))
        assert lp.stats.summary()["drafters"]["other"]["draft_tokens"] > 0
    assert outs[0] == outs[1]
    assert calls and all(not sp.greedy for sps in calls for sp in sps)
    assert all(len(v) == MAX_TOKENS for v in outs[0].values())


@pytest.mark.parametrize("slots", [3, 8])
def test_pipelined_output_equals_unpipelined(target, reference, tiny_draft_dir, slots):
    """Two micro-batches (one drafts while the other verifies; sequential on CPU): same output."""
    from dataclasses import replace

    factories = [early_exit_all, early_exit_1, other_model_factory(tiny_draft_dir), ngram, random_drafter]
    names = ["exit_all", "exit_1", "other", "ngram", "random"]
    plain = make_loop(target, slots, MixedGamma(names), factories)
    assert run(plain) == reference
    loop = make_loop(target, slots, MixedGamma(names), factories)
    loop.cfg = replace(loop.cfg, pipeline=True)
    assert run(loop) == reference
    summary = loop.stats.summary()
    # two target forwards per step while two or more slots decode
    assert summary["steps"] > plain.stats.summary()["steps"]
    assert 0 < summary["target_idle_fraction"] < 1


def test_pipeline_keeps_a_step_that_drafts_nothing_whole(target, reference):
    """Nothing to overlap: one target forward per step, as without the pipeline."""
    from dataclasses import replace

    plain = make_loop(target, 4, NoSpeculation(), [ngram])
    assert run(plain) == reference
    loop = make_loop(target, 4, NoSpeculation(), [ngram])
    loop.cfg = replace(loop.cfg, pipeline=True)
    assert run(loop) == reference
    assert loop.stats.summary()["steps"] == plain.stats.summary()["steps"]


@pytest.fixture(scope="module")
def bf16_target(tiny_dir):
    model = load_model(tiny_dir, "bfloat16", plan=execution.forced("c"))
    assert model.c_decoder is not None
    return model, load_tokenizer(tiny_dir)


@pytest.mark.parametrize("slots", [3, 8])
def test_bfloat16_on_the_c_kernels_is_exact_too(bf16_target, tiny_draft_dir, slots):
    """Every row is computed alone on the C kernels, in bfloat16 as in float32: batch size, verify runs
    and mixed gamma change no token."""
    reference = run(make_loop(bf16_target, 1, NoSpeculation()))
    assert run(make_loop(bf16_target, slots, NoSpeculation())) == reference
    names = ["exit_1", "self", "random"]
    loop = make_loop(bf16_target, slots, MixedGamma(names), [early_exit_1, self_model, random_drafter])
    assert run(loop) == reference
    assert loop.stats.summary()["drafters"]["self"]["acceptance_rate"] > 0.9  # long drafts were verified and kept
