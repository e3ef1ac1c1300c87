"""Token logprobs under speculation equal plain decoding's; prompt logprobs equal a transformers forward.

Every drafter kind (n-gram, early exit, model drafters, vote, cascade, random trees) drafts chains or
token trees (EveryKind) at 1, 4 and 16 slots, greedy and sampled, on both CPU paths of
test_spec_equality's `target` (the torch path, slower, at 4 slots). The reference is plain decoding
teacher-forced on the same tokens: the prompt prefilled, then one token a forward, so a sampled run
(whose text speculation changes) is checked as strictly as a greedy one. On the C path the floats are the same; on the torch path within
1e-4 (its rows depend on the batch), with the same top ids but for near-ties.
"""

from __future__ import annotations

import pytest
import torch

from spin_batch.engine.logprobs import LogprobAsk, log_probs, new_token_rows
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.models import execution
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.models.segments import Segments
from spin_batch.records import Completion, Request, RowParams
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import NoSpeculation
from spin_batch.selection.policy import NO_SPEC, Choice, Policy, StepChoice

from test_spec_equality import (MAX_TOKENS, PROMPTS, MixedGamma, early_exit_all, self_model,  # noqa: F401
                                target)
from test_tree_loop import _composites, random_trees, watch_plans

SAMPLED = SamplingParams(0.8, top_k=40, top_p=0.9)
K = 5


class EveryKind(Policy):
    """Per slot and step a drafter (cycling fast, so that each one drafts at 1 slot and at 16), a gamma of
    0..4, and with trees a shape: plain, a chain, or a tree of 2..9 nodes."""

    def __init__(self, names: list[str], trees: bool):
        self.names, self.trees, self.t = names, trees, 0

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        self.t += 1
        out = []
        for s, cap in zip(slots, caps):
            k = s + self.t
            gamma, name = min(k % 5, cap), self.names[k % len(self.names)]
            nodes = 2 + k % 8 if self.trees and (s + 2 * self.t) % 3 == 2 else 0
            out.append(Choice(name, gamma, 0.0, nodes) if gamma else NO_SPEC)
        return StepChoice.of(out)


def drafters(model, cache, slots, draft_dir) -> dict:
    """One of every kind: early exit (1 layer; all layers), n-gram, a model (another; the target itself),
    vote and cascade over them, and random trees."""
    out = _composites(model, cache, slots, draft_dir)
    for d in (early_exit_all(model, cache, slots), self_model(model, cache, slots), random_trees(model, cache, slots)):
        out[d.name] = d
    return out


def run(target, slots, policy, sampling=SamplingParams(), draft_dir=None, ask=LogprobAsk(K), prompts=PROMPTS,
        budget=64, params=None) -> dict[str, Completion]:
    model, tok = target
    settings = LoopSettings(slots=slots, max_model_len=128, max_num_batched_tokens=budget, max_tokens=MAX_TOKENS,
                            sampling=sampling, seed=5, ignore_eos=True, logprobs=ask)
    cache = model.allocate_cache(slots, settings.max_model_len)
    loop = BatchLoop(model, tok, settings, policy, {}, cache)
    if draft_dir is not None:
        loop.drafters = drafters(model, cache, slots, draft_dir)
    run.seen = watch_plans(loop)
    reqs = [Request(f"mem#{i}", str(i), p, None, params=(params or {}).get(i, RowParams()))
            for i, p in enumerate(prompts)]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: tok.encode(r.prompt), done.append)
    assert len(done) == len(prompts) and all(c.status == "ok" for c in done)
    run.loop = loop
    return {c.request.id: c for c in done}


def forced_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Plain decoding's logits teacher-forced on `generated`: [len(generated), V], row i the distribution
    generated[i] was taken from (the prompt in one forward, then one token a forward)."""
    cache = model.allocate_cache(1, 128)
    rows = [model.forward(torch.tensor(prompt), Segments.build([(0, len(prompt), 0)]), cache, [len(prompt) - 1])]
    for i, t in enumerate(generated[:-1]):
        rows.append(model.forward(torch.tensor([t]), Segments.build([(0, 1, len(prompt) + i)]), cache, [0]))
    return torch.cat(rows)


def assert_close(got, want: torch.Tensor, top_ids: torch.Tensor, exact: bool, what: str) -> None:
    """got: TokenLogprobs; want [n, V] reference log-probs; top_ids [n, K] the reference's top tokens."""
    lp = torch.tensor([e.logprob for e in got])
    chosen = want.gather(1, torch.tensor([[e.token_id] for e in got]))[:, 0]
    tops = torch.tensor([e.top_logprobs for e in got])
    ref_tops = want.gather(1, top_ids)
    if exact:
        assert torch.equal(lp, chosen), what
        assert torch.equal(tops, ref_tops), what
        assert [list(e.top_ids) for e in got] == top_ids.tolist(), what
        return
    torch.testing.assert_close(lp, chosen, atol=1e-4, rtol=0, msg=what)
    torch.testing.assert_close(tops, ref_tops, atol=1e-4, rtol=0, msg=what)
    for e, ids, ref in zip(got, top_ids.tolist(), ref_tops.tolist()):  # the same ids, but for near-ties
        for a, b, v, w in zip(e.top_ids, ids, e.top_logprobs, ref):
            assert a == b or abs(v - w) < 1e-4, what


def check_against_plain(target, done: dict[str, Completion], sampling: SamplingParams, processed: bool) -> None:
    model, tok = target
    exact = model.c_decoder is not None
    for rid, c in done.items():
        assert c.logprobs is not None and len(c.logprobs) == c.completion_tokens == MAX_TOKENS
        assert [e.token_id for e in c.logprobs] == list(c.token_ids)
        assert all(len(e.top_ids) == K and e.rank >= 1 for e in c.logprobs)
        logits = forced_logits(model, tok.encode(PROMPTS[int(rid)]), list(c.token_ids))
        want = log_probs(logits, [sampling] * len(logits) if processed else None)
        top_ids = torch.topk(want, K, dim=-1).indices
        assert_close(c.logprobs, want, top_ids, exact, f"row {rid}")


def test_the_reference_is_plain_decodings_own_logprobs(target):
    """Teacher forcing gives the numbers the plain loop records (so the checks below compare with plain decoding)."""
    done = run(target, 1, NoSpeculation())
    check_against_plain(target, done, SamplingParams(), False)


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("shape", ["chains", "trees"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_logprobs_under_speculation_equal_plain_decoding(target, tiny_draft_dir, slots, shape, sampled):
    """Every drafter kind, chains or trees; sampled rows in the processed distribution (what they were drawn from)."""
    if target[0].c_decoder is None and slots != 4:
        pytest.skip("the torch path runs at 4 slots (the C path at 1, 4 and 16)")
    names = ["exit_1", "exit_all", "ngram", "other", "self", "vote", "cascade"]
    policy = EveryKind(names if shape == "chains" else names + ["random_trees"], shape == "trees")
    sampling = SAMPLED if sampled else SamplingParams()
    done = run(target, slots, policy, sampling, tiny_draft_dir, LogprobAsk(K, None, processed=sampled))
    drafted = run.loop.stats.summary()["drafters"]
    assert all(drafted[n]["draft_tokens"] > 0 for n in names), drafted
    assert sum(drafted[n]["accepted_draft_tokens"] for n in names) > 0
    assert (run.seen["branching"] > 0) == (shape == "trees"), run.seen
    check_against_plain(target, done, sampling, sampled)


@pytest.fixture(scope="module")
def c_target(tiny_dir):
    """The C path only, for the checks that do not depend on the path."""
    model = load_model(tiny_dir, plan=execution.forced("c"))
    return model, load_tokenizer(tiny_dir)


def test_sampled_rows_default_to_the_raw_distribution(c_target, tiny_draft_dir):
    """logprobs_mode raw_logprobs (the default): a sampled token's numbers are the raw logits' log_softmax."""
    names, target = ["ngram", "self", "other"], c_target
    done = run(target, 4, MixedGamma(names, 4), SAMPLED, tiny_draft_dir)
    check_against_plain(target, done, SAMPLED, False)
    processed = run(target, 4, MixedGamma(names, 4), SAMPLED, tiny_draft_dir, LogprobAsk(K, None, True))
    assert done["0"].token_ids == processed["0"].token_ids  # the same seed: logprobs change no text
    assert done["0"].logprobs[0].logprob != processed["0"].logprobs[0].logprob


def test_only_rows_that_ask_get_logprobs(c_target):
    """A row's own logprobs override the job's (None: off); 0 gives the token's number without top tokens."""
    done = run(c_target, 3, NoSpeculation(), ask=LogprobAsk(None),
               params={0: RowParams(logprobs=0), 1: RowParams(logprobs=3)})
    assert all(len(e.top_ids) == 0 for e in done["0"].logprobs) and len(done["0"].logprobs) == MAX_TOKENS
    assert all(len(e.top_ids) == 3 for e in done["1"].logprobs)
    assert all(done[str(i)].logprobs is None for i in range(2, len(PROMPTS)))
    assert all(c.prompt_logprobs is None for c in done.values())


def test_new_token_rows_follow_the_accepted_path():
    """Chains: rows 0..k of each segment; a tree: the root's row, then the accepted nodes' rows; then one
    row per finishing prefill."""
    rows = new_token_rows([[5, 6, 7], [], [1, 2, 3, 4]], [None, None, [2, 4], None, None], [2, 0, 2, 0, 0], 2)
    assert rows == [[0, 1, 2], [4], [5, 7, 9], [10], [11]]  # a tree batch's verdict covers the prefills too
    assert new_token_rows([[5, 6, 7]], None, [1, 0], 1) == [[0, 1], [4]]


# -- prompt logprobs --------------------------------------------------------------------------------


LONG = " ".join(PROMPTS[:4])  # longer than the prefill budget below: prefilled (and scored) in chunks


@pytest.mark.parametrize("slots", [1, 3])
def test_prompt_logprobs_equal_a_transformers_forward(target, tiny_dir, slots):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    model, tok = target
    prompts = [LONG, *PROMPTS[:5]]
    assert len(tok.encode(LONG)) > 2 * 16
    done = run(target, slots, NoSpeculation(), ask=LogprobAsk(None, K), prompts=prompts, budget=16)
    for i, p in enumerate(prompts):
        ids = tok.encode(p)
        got = done[str(i)].prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)  # [n - 1, V]
        assert [e.token_id for e in got[1:]] == ids[1:]
        torch.testing.assert_close(torch.tensor([e.logprob for e in got[1:]]),
                                   want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], atol=1e-4, rtol=0)
        top = torch.topk(want, K, dim=-1)
        torch.testing.assert_close(torch.tensor([e.top_logprobs for e in got[1:]]), top.values, atol=1e-4, rtol=0)
        assert [list(e.top_ids) for e in got[1:]] == top.indices.tolist()
        chosen = want.gather(1, torch.tensor(ids[1:])[:, None])
        assert [e.rank for e in got[1:]] == ((want > chosen).sum(-1) + 1).tolist()


def test_prompt_logprobs_do_not_change_the_text(c_target, tiny_draft_dir):
    names, target = ["ngram", "self"], c_target
    plain = run(target, 4, MixedGamma(names, 4), draft_dir=tiny_draft_dir, ask=LogprobAsk(None))
    scored = run(target, 4, MixedGamma(names, 4), draft_dir=tiny_draft_dir, ask=LogprobAsk(2, 2), budget=16)
    assert {k: c.token_ids for k, c in plain.items()} == {k: c.token_ids for k, c in scored.items()}


def test_max_tokens_0_scores_the_prompt_without_decoding(c_target):
    target = c_target
    model, tok = target
    done = run(target, 3, NoSpeculation(), ask=LogprobAsk(None), params={1: RowParams(max_tokens=0)})
    scored = done["1"]
    assert scored.completion_tokens == 0 and scored.token_ids == () and scored.text == ""
    assert scored.finish_reason == "length"
    assert len(scored.prompt_logprobs) == len(tok.encode(PROMPTS[1])) and scored.prompt_logprobs[0] is None
    assert done["0"].completion_tokens == MAX_TOKENS and done["0"].prompt_logprobs is None
