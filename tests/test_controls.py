"""The logits controls (engine/controls.py) and the stop rules they go with, in the batch loop.

Each control against a plain reference of its definition (vLLM's / OpenAI's); every verified row counting
the draft prefix before it, so greedy speculation with penalties, logit_bias and min_tokens equals plain
decoding with them, token for token, for every drafter kind, chains and trees; and the rows the
verifier reads (its p, when sampling) are the controlled ones, checked against a naive recomputation.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from spin_batch.engine import loop as loop_module
from spin_batch.engine.controls import LogitControls, apply_controls, chain_prefixes, tree_prefixes
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.engine.stopping import Stopping, StopRule
from spin_batch.models.loader import load_model, load_tokenizer
from conftest import run_all, token_ids  # noqa: E402
from spin_batch.records import Completion, Request, RowParams
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation

from test_spec_equality import (PROMPTS, MixedGamma, early_exit_1, early_exit_all, ngram, other_model_factory,
                                random_drafter, self_model)
from test_tree_loop import FACTORIES as TREE_FACTORIES
from test_tree_loop import NAMES as TREE_NAMES
from test_tree_loop import TreeShapes, watch_plans

MAX_TOKENS = 16

# ---------------------------------------------------------------------------- the definitions, row by row


def naive(row: torch.Tensor, c: LogitControls, temperature: float, prompt: list[int], before: list[int],
          min_tokens: int = 0, stop_ids=()) -> torch.Tensor:
    """One row by the definitions, token by token: vLLM's order (min_tokens, logit_bias, repetition,
    frequency, presence), and min_p on the probabilities after temperature."""
    x = row.clone().float()
    if len(before) < min_tokens:
        for t in stop_ids:
            x[t] = -math.inf
    for t, b in c.logit_bias:
        x[t] += b
    counts = Counter(before)
    for t in set(prompt) | set(before):
        if c.repetition_penalty != 1.0:
            x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
    for t, k in counts.items():
        x[t] -= c.frequency_penalty * k + c.presence_penalty
    if c.min_p and temperature:
        p = torch.softmax(x / temperature, -1)
        x[p < c.min_p * p.max()] = -math.inf
    return x


CONTROLS = [
    LogitControls(repetition_penalty=1.7),
    LogitControls(repetition_penalty=0.6),  # < 1 favours repeats: negative logits shrink, positive grow
    LogitControls(presence_penalty=1.5, frequency_penalty=-0.5),
    LogitControls(logit_bias=((3, 5.0), (7, -100.0))),
    LogitControls(min_p=0.3),
    LogitControls(min_p=0.3, repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.4, logit_bias=((1, 2.0),)),
]


@pytest.mark.parametrize("c", CONTROLS)
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_each_row_is_the_definition_with_the_draft_prefix_before_it(c, temperature):
    g = torch.Generator().manual_seed(1)
    vocab = 12
    prompt, generated, drafts = [1, 2, 2], [3, 5, 3], [5, 9, 3, 3]
    logits = torch.randn(len(drafts) + 1, vocab, generator=g) * 3
    got = logits.clone()
    apply_controls(got, c, temperature, prompt, generated, chain_prefixes(drafts), min_tokens=6, stop_ids={0, 9})
    for r in range(len(drafts) + 1):
        want = naive(logits[r], c, temperature, prompt, generated + drafts[:r], 6, {0, 9})
        assert torch.allclose(got[r], want, atol=1e-5), (r, got[r], want)


def test_min_tokens_masks_the_stop_ids_only_at_rows_short_of_it():
    logits = torch.zeros(4, 6)
    apply_controls(logits, LogitControls(), 0.0, [1], [4], chain_prefixes([2, 2, 2]), min_tokens=3, stop_ids={0, 5})
    # row r follows 1 + r tokens: rows 0 and 1 (1 and 2 tokens) are short of 3
    assert torch.isinf(logits[:2, [0, 5]]).all() and not torch.isinf(logits[2:]).any()
    assert not torch.isinf(logits[:, 1:5]).any()


def test_a_tree_rows_prefix_is_its_path():
    tokens, parents = [4, 6, 7, 8], [-1, -1, 0, 2]  # root -> 4 -> 7 -> 8, root -> 6
    assert tree_prefixes(tokens, parents) == [[], [4], [6], [4, 7], [4, 7, 8]]
    logits = torch.ones(5, 10)
    apply_controls(logits, LogitControls(frequency_penalty=1.0), 0.0, [], [4], tree_prefixes(tokens, parents))
    assert logits[:, 4].tolist() == [0.0, -1.0, 0.0, -1.0, -1.0]  # 4 generated once, twice on node 4's path
    assert logits[:, 7].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_neutral_controls_change_nothing():
    assert not LogitControls().active(1.0) and not LogitControls(min_p=0.5).active(0.0)
    assert LogitControls(min_p=0.5).active(1.0) and LogitControls(logit_bias=((1, 0.5),)).active(0.0)


# ---------------------------------------------------------------------------- stop rules


def fake_decode(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i) for i in ids)


def test_a_stop_token_id_ends_the_completion_and_leaves_the_text():
    stopping = Stopping(fake_decode)
    rule = StopRule(max_tokens=10, max_model_len=100, stop_ids=frozenset({3}))
    tokens = [0]
    got = stopping.extend(tokens, 1, [1, 2, 3, 4], rule)
    assert (got.added, got.finish_reason) == (3, "stop") and tokens == [0, 1, 2, 3]
    assert stopping.text(tokens[1:], rule) == "bc"


def test_no_stop_string_ends_the_completion_before_min_tokens():
    stopping = Stopping(fake_decode)
    # text "b c b c d b c": the stop string "bc" first ends at token 2, then at 4 and 7
    rule = StopRule(max_tokens=20, max_model_len=100, stop=("bc",), min_tokens=3)
    tokens = [0]
    got = stopping.extend(tokens, 1, [1, 2, 1, 2, 3, 1, 2], rule)
    assert got.finish_reason == "stop" and got.text == "bc" and got.added == 4  # cut at the occurrence ending at token 4
    early = StopRule(max_tokens=20, max_model_len=100, stop=("bc",))
    assert Stopping(fake_decode).extend([0], 1, [1, 2, 1, 2], early).text == ""  # without min_tokens: at token 2
    # an occurrence ending in the min_tokens-th token counts (vLLM checks from min_tokens generated on)
    at = StopRule(max_tokens=20, max_model_len=100, stop=("bc",), min_tokens=2)
    assert Stopping(fake_decode).extend([0], 1, [1, 2, 1, 2], at).text == ""


# ---------------------------------------------------------------------------- in the loop


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir), load_tokenizer(tiny_dir)


#: per-row controls, cycling over the prompts; row 6's are the job's (LoopSettings below)
ROW_PARAMS = [
    RowParams(repetition_penalty=1.8),
    RowParams(presence_penalty=1.2, frequency_penalty=0.8),
    RowParams(logit_bias=((40, 4.0), (41, 3.0)), repetition_penalty=1.3),
    RowParams(min_tokens=10),
    RowParams(repetition_penalty=0.7, presence_penalty=-0.5),
    RowParams(repetition_penalty=1.0, frequency_penalty=0.0, min_tokens=0),  # none at all
    RowParams(),
]


def settings(slots: int, eos: frozenset[int], **kw) -> LoopSettings:
    base = dict(slots=slots, max_model_len=128, max_num_batched_tokens=64, max_tokens=MAX_TOKENS,
                sampling=SamplingParams(), eos_token_ids=eos, min_tokens=4, stop_token_ids=frozenset(),
                controls=LogitControls(repetition_penalty=1.4, frequency_penalty=0.3))
    return LoopSettings(**{**base, **kw})


def make(target, slots: int, policy, factories=(), eos=frozenset(), **kw) -> BatchLoop:
    model, tok = target
    cfg = settings(slots, eos, **kw)
    cache = model.allocate_cache(slots, cfg.max_model_len)
    drafters = {d.name: d for d in (f(model, cache, slots) for f in factories)}
    return BatchLoop(model, tok, cfg, policy, drafters, cache)


def run(loop: BatchLoop, params=ROW_PARAMS) -> dict[str, Completion]:
    return run_all(loop, [Request(f"mem#{i}", str(i), p, None, params=params[i % len(params)])
                          for i, p in enumerate(PROMPTS)])


ids = token_ids  # conftest's


@pytest.fixture(scope="module")
def frequent(target):
    """A token the uncontrolled reference generates often: as EOS, it ends rows early but for min_tokens."""
    got = run(make(target, 1, NoSpeculation(), min_tokens=0, controls=LogitControls()), [RowParams()])
    counts = Counter(t for c in got.values() for t in c.token_ids)
    return counts.most_common(1)[0][0], ids(got)


@pytest.fixture(scope="module")
def reference(target, frequent):
    eos, free = frequent
    got = ids(run(make(target, 1, NoSpeculation(), eos=frozenset({eos}))))
    changed = [k for k in got if got[k][0] != free[k][0][: len(got[k][0])]]
    assert len(changed) >= len(got) // 2, "the controls must change most rows, or the equality proves little"
    return got


def test_min_tokens_keeps_the_stop_ids_away_until_reached(target, frequent, reference):
    eos, _ = frequent
    stopped = [k for k, (t, why) in reference.items() if why == "stop"]
    assert stopped, "some rows end at the frequent token"
    for k, (t, why) in reference.items():
        own = ROW_PARAMS[int(k) % len(ROW_PARAMS)].min_tokens
        floor = 4 if own is None else own  # the job's min_tokens is 4
        assert eos not in t[: floor], (k, t)
        if why == "stop":
            assert t[-1] == eos and len(t) >= floor + 1 or floor == 0


def test_a_large_logit_bias_decides_the_greedy_token(target):
    loop = make(target, 2, NoSpeculation(), min_tokens=0, controls=LogitControls(logit_bias=((77, 100.0),)))
    for c in run(loop, [RowParams()]).values():
        assert set(c.token_ids) == {77}


KINDS = {"exit_all": early_exit_all, "self": self_model, "exit_1": early_exit_1, "ngram": ngram,
         "random": random_drafter}


@pytest.mark.parametrize("slots", [1, 8])
@pytest.mark.parametrize("kind", sorted(KINDS) + ["other"])
def test_speculation_with_controls_equals_plain_decoding(target, frequent, reference, tiny_draft_dir, kind, slots):
    factory = other_model_factory(tiny_draft_dir) if kind == "other" else KINDS[kind]
    loop = make(target, slots, FixedDrafter(kind, 4), [factory], eos=frozenset({frequent[0]}))
    assert ids(run(loop)) == reference
    assert loop.stats.summary()["drafters"][kind]["draft_tokens"] > 0


@pytest.mark.parametrize("slots", [3])
def test_mixed_gamma_and_drafters_with_controls(target, frequent, reference, tiny_draft_dir, slots):
    names = ["exit_all", "exit_1", "self", "ngram", "random"]
    loop = make(target, slots, MixedGamma(names), [KINDS[n] for n in names], eos=frozenset({frequent[0]}))
    assert ids(run(loop)) == reference


@pytest.mark.parametrize("slots", [1, 3])
def test_trees_with_controls_equal_plain_decoding(target, frequent, reference, slots):
    """Each tree node's row counts its path from the root (its ancestors) as generated."""
    loop = make(target, slots, TreeShapes(TREE_NAMES), TREE_FACTORIES, eos=frozenset({frequent[0]}))
    seen = watch_plans(loop)
    assert ids(run(loop)) == reference
    assert seen["branching"] > 0, seen


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_verify_that_ignored_the_draft_prefix_would_differ(target, frequent, reference, monkeypatch, shape):
    """The equalities above can fail: rows that counted only the committed tokens give other text."""
    if shape == "chain":
        monkeypatch.setattr(loop_module, "chain_prefixes", lambda d: [[] for _ in range(len(d) + 1)])
        loop = make(target, 3, FixedDrafter("self", 4), [self_model], eos=frozenset({frequent[0]}))
    else:
        monkeypatch.setattr(loop_module, "tree_prefixes", lambda d, t: [[] for _ in range(len(d) + 1)])
        loop = make(target, 3, TreeShapes(["self"]), [self_model], eos=frozenset({frequent[0]}))
    assert ids(run(loop)) != reference


def test_the_verifier_reads_the_controlled_rows_when_sampling(target, monkeypatch):
    """Sampled rows with trees and chains: every row handed to the verifier (its p) is the naive
    definition over prompt + generated + the row's draft prefix (a tree: the node's path)."""
    checked = Counter()
    original = BatchLoop._controlled

    def watching(served, drafts, trees, logits):
        out = original(served, drafts, trees, logits)
        row = 0
        for s, d, t in zip(served, drafts, trees):
            prefixes = chain_prefixes(d) if t is None else tree_prefixes(d, t)
            for p in prefixes:
                want = naive(logits[row], s.controls, s.sp.temperature, s.tokens[: s.prompt_len], s.generated + p,
                             s.rule.min_tokens, s.rule.eos | s.rule.stop_ids)
                assert torch.allclose(out[row], want, atol=1e-4)
                checked["tree" if t is not None else "chain" if d else "plain"] += 1
                row += 1
        return out

    monkeypatch.setattr(BatchLoop, "_controlled", staticmethod(watching))
    params = [RowParams(min_p=0.05, repetition_penalty=1.5), RowParams(presence_penalty=1.0, temperature=0.0),
              RowParams(logit_bias=((5, 2.0),), frequency_penalty=0.5)]
    loop = make(target, 3, TreeShapes(["self", "ngram"]), [self_model, ngram], sampling=SamplingParams(0.9, top_k=40),
                eos=frozenset({0}))
    run(loop, params)
    assert checked["tree"] > 0 and checked["chain"] > 0, checked


def test_a_row_that_asks_too_much_is_refused_as_vllm_does(target):
    loop = make(target, 2, NoSpeculation())
    reqs = [Request("m#0", "0", "the quick brown fox", None, params=RowParams(max_tokens=127)),
            Request("m#1", "1", "the quick brown fox", None, params=RowParams(min_tokens=MAX_TOKENS + 1)),
            Request("m#2", "2", "the quick brown fox", None, params=RowParams(logit_bias=((10**6, 1.0),))),
            Request("m#3", "3", "the quick brown fox", None, params=RowParams(max_tokens=20, min_tokens=20))]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    got = {c.request.id: c for c in done}
    assert "'max_tokens' or 'max_completion_tokens' is too large: 127" in got["0"].error
    assert "maximum context length is 128 tokens" in got["0"].error
    assert got["1"].error == f"min_tokens must be less than or equal to max_tokens={MAX_TOKENS}, got {MAX_TOKENS + 1}"
    assert "in logit_bias contain out-of-vocab token ids" in got["2"].error
    assert got["3"].status == "ok" and len(got["3"].token_ids) == 20  # min_tokens == max_tokens is fine
