"""Structured output under speculation (engine/structured.py): greedy constrained speculation equals greedy
constrained plain decoding token for token, for every drafter kind, with trees, penalties and min_tokens;
every output is valid (greedy and sampled, 1, 4 and 16 slots); sampled constrained speculation follows the
masked target distribution; bad constraints are refused, never a traceback."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

pytest.importorskip("llguidance")

from spin_batch.engine import loop as loop_module  # noqa: E402
from spin_batch.engine.controls import LogitControls  # noqa: E402
from spin_batch.engine.loop import BatchLoop, LoopSettings  # noqa: E402
from spin_batch.grammars import Structured, StructuredError, grammar_text, structured_from  # noqa: E402
from spin_batch.models.loader import load_model, load_tokenizer  # noqa: E402
from conftest import run_all, token_ids  # noqa: E402
from spin_batch.records import Completion, Request, RowParams  # noqa: E402
from spin_batch.sampling import SamplingParams  # noqa: E402
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation  # noqa: E402

from test_spec_equality import (PROMPTS, MixedGamma, early_exit_1, early_exit_all, ngram, other_model_factory,  # noqa: E402
                                random_drafter, self_model)
from test_tree_loop import FACTORIES as TREE_FACTORIES  # noqa: E402
from test_tree_loop import NAMES as TREE_NAMES  # noqa: E402
from test_tree_loop import TreeShapes, watch_plans  # noqa: E402

MAX_TOKENS = 128
LABELS = ["positive", "negative", "neutral", "mixed feelings"]
SCHEMA = {"type": "object",
          "properties": {"label": {"enum": ["bug", "feature", "question"]},
                         "score": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 6}},
          "required": ["label", "score", "tag"], "additionalProperties": False}
REGEX = "[a-c]{2,5}-[0-9]{1,3}"
LARK = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[0-9]/'
CONSTRAINTS = [structured_from({"choice": LABELS}), structured_from({"json": SCHEMA}), structured_from({"regex": REGEX}),
               structured_from({"json_object": True}), structured_from({"grammar": LARK})]
#: json_object (any object) bounds no length: a random model may run to max_tokens in it (finish "length"),
#: so the validity checks take the bounded kinds
BOUNDED = [c for c in CONSTRAINTS if c.kind != "json_object"]


def valid(s: Structured, text: str) -> bool:
    """Whether text satisfies the constraint, checked without the grammar engine."""
    if s.kind == "choice":
        return text in s.choices
    if s.kind == "regex":
        return re.fullmatch(s.spec, text) is not None
    if s.kind == "grammar":
        return re.fullmatch(r"\(\d(,\d){0,2}\)", text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    if s.kind == "json_object":
        return True
    try:
        import jsonschema
    except ImportError:
        return (set(value) == {"label", "score", "tag"} and value["label"] in ("bug", "feature", "question")
                and isinstance(value["score"], int) and 0 <= value["score"] <= 99 and isinstance(value["tag"], str)
                and len(value["tag"]) <= 6)
    try:
        jsonschema.validate(value, s.schema)
    except jsonschema.ValidationError:
        return False
    return True


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir), load_tokenizer(tiny_dir)


def make(target, slots: int, policy, factories=(), **kw) -> BatchLoop:
    model, tok = target
    base = dict(slots=slots, max_model_len=256, max_num_batched_tokens=128, max_tokens=MAX_TOKENS,
                sampling=SamplingParams(), eos_token_ids=frozenset({tok.eos_token_id}))
    cfg = LoopSettings(**{**base, **kw})
    cache = model.allocate_cache(slots, cfg.max_model_len)
    drafters = {d.name: d for d in (f(model, cache, slots) for f in factories)}
    return BatchLoop(model, tok, cfg, policy, drafters, cache)


#: per-row settings beside each constraint: a penalty, min_tokens, logit_bias, none
CONTROLS = [RowParams(repetition_penalty=1.5), RowParams(min_tokens=6), RowParams(frequency_penalty=0.7, presence_penalty=0.3),
            RowParams(), RowParams(logit_bias=((40, 3.0),), min_tokens=3)]


def requests(n: int, params=None, prompts=PROMPTS, constraints=CONSTRAINTS) -> list[Request]:
    out = []
    for i in range(n):
        own = CONTROLS[i % len(CONTROLS)] if params is None else params
        own = RowParams(**{**own.__dict__, "structured": constraints[i % len(constraints)]})
        out.append(Request(f"mem#{i}", str(i), f"{prompts[i % len(prompts)]} {i}", None, params=own))
    return out


run, ids = run_all, token_ids  # conftest's


N_EQUAL = 20


@pytest.fixture(scope="module")
def reference(target):
    got = run(make(target, 1, NoSpeculation()), requests(N_EQUAL))
    for c in got.values():
        if c.request.params.structured.kind != "json_object":
            assert valid(c.request.params.structured, c.text), (c.request.params.structured, c.text)
    assert any(c.finish_reason == "stop" and c.request.params.structured.kind == "json_object" for c in got.values())
    return ids(got)


KINDS = {"exit_all": early_exit_all, "self": self_model, "exit_1": early_exit_1, "ngram": ngram,
         "random": random_drafter}


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("kind", sorted(KINDS) + ["other"])
def test_constrained_speculation_equals_constrained_plain_decoding(target, reference, tiny_draft_dir, kind, slots):
    factory = other_model_factory(tiny_draft_dir) if kind == "other" else KINDS[kind]
    loop = make(target, slots, FixedDrafter(kind, 4), [factory])
    assert ids(run(loop, requests(N_EQUAL))) == reference
    assert loop.stats.summary()["drafters"][kind]["draft_tokens"] > 0


def test_mixed_drafters_and_trees_equal_plain_decoding(target, reference):
    names = ["exit_all", "exit_1", "self", "ngram", "random"]
    assert ids(run(make(target, 3, MixedGamma(names), [KINDS[n] for n in names]), requests(N_EQUAL))) == reference
    loop = make(target, 3, TreeShapes(TREE_NAMES), TREE_FACTORIES)
    seen = watch_plans(loop)
    assert ids(run(loop, requests(N_EQUAL))) == reference
    assert seen["branching"] > 0, seen


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_mask_that_ignored_the_draft_prefix_would_differ(target, reference, monkeypatch, shape):
    """The equalities above can fail: rows masked by the committed state alone give other text."""
    name = "chain_prefixes" if shape == "chain" else "tree_prefixes"
    monkeypatch.setattr(loop_module, name, lambda d, *t: [[] for _ in range(len(d) + 1)])
    policy = FixedDrafter("self", 4) if shape == "chain" else TreeShapes(["self"])
    try:
        got = ids(run(make(target, 3, policy, [self_model]), requests(N_EQUAL)))
    except RuntimeError as e:  # or a token the grammar refuses is committed, and the loop says so
        assert "was committed against the grammar" in str(e)
    else:
        assert got != reference


def test_drafts_are_cut_where_the_grammar_refuses(target, reference, monkeypatch):
    """A random drafter's chains are cut before verify (so fewer tokens are verified), and the text holds."""
    verified: list[int] = []
    original = BatchLoop.plan

    def watching(self, decode, drafts, prefill=True, trees=None):
        verified.extend(len(d) for d in drafts)
        return original(self, decode, drafts, prefill, trees)

    monkeypatch.setattr(BatchLoop, "plan", watching)
    loop = make(target, 2, FixedDrafter("random", 4), [random_drafter])
    assert ids(run(loop, requests(N_EQUAL))) == reference
    # random tokens are seldom what the grammar allows: most chains are cut (uncut, each would verify 4)
    assert verified and sum(n < 4 for n in verified) > 0.8 * len(verified)


# ---------------------------------------------------------------------------- every output valid


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_is_valid(target, slots, temperature):
    """200 rows per setting, every constraint kind, a random model: each output parses and validates."""
    sampler = "rejection" if slots == 4 else "gumbel"
    loop = make(target, slots, MixedGamma(["exit_all", "ngram", "random"]), [early_exit_all, ngram, random_drafter],
                sampling=SamplingParams(temperature, sampler=sampler))
    got = run(loop, requests(200, constraints=BOUNDED))
    bad = [(c.request.params.structured.kind, c.text, c.finish_reason) for c in got.values()
           if not valid(c.request.params.structured, c.text) or c.finish_reason != "stop"]
    assert not bad, bad[:5]
    assert len({c.text for c in got.values()}) > 20  # not one text over and over


def test_the_checker_refuses_invalid_text():
    choice, schema = CONSTRAINTS[0], CONSTRAINTS[1]
    assert valid(choice, "neutral") and not valid(choice, "neutral ")
    assert valid(schema, '{"label":"bug","score":3,"tag":"x"}')
    assert not valid(schema, '{"label":"bug","score":300,"tag":"x"}') and not valid(schema, '{"label":"bug"')


def test_the_grammar_stops_the_row_even_with_ignore_eos(target):
    loop = make(target, 2, NoSpeculation(), ignore_eos=True)
    got = run(loop, [Request("m#0", "0", "the moon", None, params=RowParams(structured=CONSTRAINTS[0]))])
    assert got["0"].text in LABELS and got["0"].finish_reason == "stop"


def test_min_tokens_does_not_hold_a_row_past_its_grammars_end(target):
    got = run(make(target, 1, NoSpeculation(), min_tokens=50),
              [Request("m#0", "0", "the moon", None, params=RowParams(structured=CONSTRAINTS[0]))])
    assert got["0"].text in LABELS


# ---------------------------------------------------------------------------- the masked distribution


def masked_marginals(target, prompt: list[int], s: Structured) -> tuple[torch.Tensor, torch.Tensor]:
    """[V] p(first token) and p(second token) under the grammar, at temperature 1, from the model and the
    engine directly (not through the loop)."""
    import llguidance
    import llguidance.hf

    model, tok = target
    vocab = model.spec.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=vocab), grammar_text(s))

    def allowed() -> torch.Tensor:
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        return torch.tensor([bool((int(words[i // 32]) >> (i % 32)) & 1) for i in range(vocab)])

    def probs(seq: list[int]) -> torch.Tensor:
        loop = make(target, 1, NoSpeculation())
        logits = loop.target.forward(torch.tensor(seq), _segments(loop, len(seq)), loop.cache, [len(seq) - 1])[0]
        return logits.double().masked_fill(~allowed(), -torch.inf).softmax(-1)

    p1 = probs(prompt)
    p2 = torch.zeros(vocab, dtype=torch.float64)
    for t in torch.nonzero(p1 > 0).flatten().tolist():
        assert matcher.consume_token(t)
        p2 += p1[t] * probs(prompt + [t])
        matcher.rollback(1)
    return p1, p2


def _segments(loop, n: int):
    from spin_batch.models.segments import Segments

    return Segments.build([(0, n, 0)], loop.target.device)


N_DIST = 1200
SIGMAS = 5.0  # per-token bound |freq - p| < 5 sqrt(p (1 - p) / n), as tests/test_verify.py


def z_score(p: torch.Tensor, counts: torch.Tensor) -> float:
    n = counts.sum()
    sigma = torch.sqrt(p * (1 - p) / n).clamp_min(1.0 / n)
    return ((counts / n - p).abs() / sigma).max().item()


@pytest.mark.parametrize("kind", ["other", "random"])
def test_sampled_constrained_speculation_follows_the_masked_distribution(target, tiny_draft_dir, kind):
    """Rejection sampling at temperature 1, a model draft with its q (kept, the verifier rejects what the
    grammar refuses) or random drafts (cut before verify): the first two tokens' frequencies match the
    masked target's marginals, and not the unmasked target's."""
    model, tok = target
    s = structured_from({"regex": "[a-f]{2,6}"})
    prompt = tok.encode("list three colours")
    factory = other_model_factory(tiny_draft_dir) if kind == "other" else random_drafter
    # max_tokens 3: the first token comes with the prefill, the second from a step that drafts one token
    loop = make(target, 16, FixedDrafter(kind, 2), [factory], sampling=SamplingParams(1.0, sampler="rejection"),
                max_tokens=3)
    reqs = [Request(f"m#{i}", str(i), "list three colours", None, params=RowParams(structured=s))
            for i in range(N_DIST)]
    got = run(loop, reqs)
    first, second = torch.zeros(model.spec.vocab_size, dtype=torch.float64), torch.zeros(model.spec.vocab_size,
                                                                                         dtype=torch.float64)
    for c in got.values():
        first[c.token_ids[0]] += 1
        second[c.token_ids[1]] += 1
    p1, p2 = masked_marginals(target, prompt, s)
    assert z_score(p1, first) < SIGMAS and z_score(p2, second) < SIGMAS
    free = make(target, 1, NoSpeculation())
    logits = free.target.forward(torch.tensor(prompt), _segments(free, len(prompt)), free.cache, [len(prompt) - 1])[0]
    assert z_score(logits.double().softmax(-1), first) > 3 * SIGMAS
    assert loop.stats.summary()["drafters"][kind]["draft_tokens"] > 0


# ---------------------------------------------------------------------------- refusals


def test_a_bad_constraint_is_refused_at_admission_not_a_traceback(target):
    loop = make(target, 2, NoSpeculation())
    bad = [Structured("regex", "(ab"), Structured("json", '{"type":"foo"}'), Structured("grammar", "start: foo")]
    reqs = [Request(f"m#{i}", str(i), "the moon", None, params=RowParams(structured=s)) for i, s in enumerate(bad)]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    errors = {c.request.id: c.error for c in done}
    assert "regex constraint does not compile" in errors["0"] and "unclosed group" in errors["0"]
    assert "json constraint does not compile" in errors["1"] and "foo" in errors["1"]
    assert "grammar constraint does not compile" in errors["2"]


@pytest.mark.parametrize("value,message", [
    ({"choice": []}, "non-empty list of strings"),
    ({"choice": ["a"], "regex": "a"}, "exactly one of"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "a JSON schema (an object)"),
    ({"whitespace_pattern": " "}, "whitespace_pattern is not supported"),
    ({"choice": ["a"], "disable_any_whitespace": False}, "disable_any_whitespace is not supported"),
    ("a", "must be an object"),
])
def test_malformed_structured_outputs_are_named(value, message):
    with pytest.raises(StructuredError, match=re.escape(message)):
        structured_from(value)


def test_neutral_structured_outputs_keys_are_accepted():
    got = structured_from({"choice": ["a"], "disable_fallback": True, "disable_any_whitespace": True})
    assert got == Structured("choice", '["a"]')


def test_the_job_constraint_applies_to_rows_without_their_own(target):
    loop = make(target, 2, NoSpeculation(), structured=CONSTRAINTS[0], controls=LogitControls())
    got = run(loop, [Request("m#0", "0", "the moon", None), Request("m#1", "1", "the sun", None,
                                                                    params=RowParams(structured=CONSTRAINTS[2]))])
    assert got["0"].text in LABELS and re.fullmatch(REGEX, got["1"].text)
    assert Counter(c.finish_reason for c in got.values()) == Counter({"stop": 2})


def test_jump_forward_proposes_the_forced_tokens_and_keeps_the_text(target, reference, monkeypatch):
    """With no drafter at all, a constrained slot proposes the tokens its grammar forces (JSON keys, quotes,
    colons): fewer forwards than tokens, every one accepted, and the text plain decoding gives. Off, one forward
    a token."""
    from spin_batch.engine import structured

    on = make(target, 1, NoSpeculation())
    assert ids(run(on, requests(N_EQUAL))) == reference
    on_steps, on_tokens = on.stats.totals["steps"], on.stats.totals["generated_tokens"]
    monkeypatch.setattr(structured, "JUMP_FORWARD", False)
    off = make(target, 1, NoSpeculation())
    assert ids(run(off, requests(N_EQUAL))) == reference
    assert on_tokens == off.stats.totals["generated_tokens"]
    assert on_steps < off.stats.totals["steps"], (on_steps, off.stats.totals["steps"])
