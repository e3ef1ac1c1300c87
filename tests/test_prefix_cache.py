"""The prefix cache (engine/prefix_cache.py, engine/prefill_share.py): reused K/V change no greedy token.

Prompts share a long head (an instruction) and end in their own text. On the C path, in float32 and
bfloat16, greedy output with the cache equals output without it, token for token, with every drafter
kind, at 1, 4 and 16 slots; and the drafts themselves do not change (the features of a feature-reading
draft are cached with the K/V). The cache stays under its byte budget however many prefixes it sees.
"""

from __future__ import annotations

import pytest
import torch

from spin_batch.drafters.early_exit import EarlyExitDrafter
from spin_batch.drafters.model import FeatureDrafter, ModelDrafter
from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.engine.prefix_cache import BLOCK, PrefixCache
from spin_batch.models import execution
from spin_batch.models.checkpoint import load_state_dict
from spin_batch.models.distilled import TargetFeatures, load_draft
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.records import Completion, Request
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation

from conftest import Cycle

INSTRUCTION = ("label the sentence below as one of: weather, food, sport, music. answer with the label, "
               "then one short reason. the quick brown fox jumps over the lazy dog. ")
ROWS = ["it rained all day", "the soup was cold", "a goal in the last minute", "the band played late",
        "snow on the hills", "fresh bread and jam", "the match was a draw", "a slow song on the radio",
        "sunny and warm", "rice with beans", "she ran ten miles", "drums and a bass guitar",
        "wind from the north", "a plate of noodles", "the team lost again", "an old piano tune",
        "fog in the morning", "hot tea", "a long swim", "the choir sang"]
PROMPTS = [INSTRUCTION + r for r in ROWS] + ["once upon a time", INSTRUCTION[:40]]
MAX_LEN, MAX_TOKENS = 256, 12


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request, tiny_dir):
    model = load_model(tiny_dir, request.param, plan=execution.forced("c"))
    assert model.c_decoder is not None
    return model, load_tokenizer(tiny_dir)


def make_loop(target, slots: int, policy, factories=(), prefix: PrefixCache | None = None, budget: int = 64,
              features: bool = False) -> BatchLoop:
    model, tok = target
    settings = LoopSettings(slots=slots, max_model_len=MAX_LEN, max_num_batched_tokens=budget, max_tokens=MAX_TOKENS,
                            sampling=SamplingParams(), ignore_eos=True)
    cache = model.allocate_cache(slots, MAX_LEN)
    feats = TargetFeatures(slots, MAX_LEN, model.spec.hidden_size, model.spec.rms_norm_eps, model.dtype,
                           model.device) if features else None
    drafters = {d.name: d for d in (f(model, cache, slots, feats) for f in factories)}
    return BatchLoop(model, tok, settings, policy, drafters, cache, prefix_cache=prefix)


def run(loop: BatchLoop, prompts=PROMPTS) -> dict[str, Completion]:
    reqs = [Request(source=f"mem#{i}", id=str(i), prompt=p, messages=None) for i, p in enumerate(prompts)]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    assert len(done) == len(prompts) and all(c.status == "ok" for c in done)
    return {c.request.id: c for c in done}


def tokens(done: dict[str, Completion]) -> dict[str, list[int]]:
    return {k: list(c.token_ids) for k, c in done.items()}


@pytest.fixture(scope="module")
def reference(target):
    return tokens(run(make_loop(target, 1, NoSpeculation())))


def exit_1(model, cache, slots, feats):
    return EarlyExitDrafter("exit_1", model, cache, 1)


def exit_all(model, cache, slots, feats):
    return EarlyExitDrafter("exit_all", model, cache, None)


def self_model(model, cache, slots, feats):
    return ModelDrafter("self", model, model.allocate_cache(slots, cache.max_len))


def ngram(model, cache, slots, feats):
    return NgramDrafter("ngram", 1, 3)


def int8_factory(tiny_dir):
    def int8(model, cache, slots, feats):
        if model.dtype != torch.float32:  # the int8 copy is a float32 model's draft
            return EarlyExitDrafter("int8", model, cache, 1)
        return EarlyExitDrafter("int8", model, cache, None, model.int8_copy(load_state_dict(tiny_dir)))
    return int8


def distilled_factory(draft_dir, name: str):
    def distilled(model, cache, slots, feats):
        m = load_draft(draft_dir, model, model.dtype, model.device)
        c = m.allocate_cache(slots, cache.max_len)
        return FeatureDrafter(name, m, c, feats) if m.feature_head is not None else ModelDrafter(name, m, c)
    return distilled


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_autoregressive_with_the_cache_equals_without(target, reference, slots):
    prefix = PrefixCache(64 << 20)
    loop = make_loop(target, slots, NoSpeculation(), prefix=prefix)
    assert tokens(run(loop)) == reference
    summary = loop.stats.summary()
    assert summary["prompt_tokens_reused"] > 0.5 * summary["prompt_tokens_prefilled"]  # it really reused
    assert summary["prompt_tokens_reused"] + summary["prompt_tokens_prefilled"] == summary["prompt_tokens"]
    assert prefix.reused == summary["prompt_tokens_reused"]


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_every_drafter_kind_with_the_cache_equals_without(target, reference, tiny_dir, tiny_draft_dir,
                                                          tiny_distilled, tiny_distilled_plain, slots):
    def other(model, cache, slots, feats):
        m = load_model(tiny_draft_dir, "float32" if model.dtype == torch.float32 else "bfloat16",
                       plan=execution.forced("c"))
        return ModelDrafter("other", m, m.allocate_cache(slots, cache.max_len))

    factories = [exit_1, exit_all, self_model, other, ngram, int8_factory(tiny_dir),
                 distilled_factory(tiny_distilled[0].out / "d2x64", "feat"),
                 distilled_factory(tiny_distilled_plain[0].out / "d1x64", "plain")]
    names = ["exit_1", "exit_all", "self", "other", "ngram", "int8", "feat", "plain"]
    loop = make_loop(target, slots, Cycle(names), factories, prefix=PrefixCache(64 << 20), features=True)
    assert isinstance(loop.drafters["feat"], FeatureDrafter)
    assert tokens(run(loop)) == reference
    assert loop.stats.totals["reused_tokens"] > 0
    pulls = loop.stats.summary()["drafters"]
    assert {n for n in names if pulls.get(n, {}).get("draft_tokens")} == set(names)


@pytest.mark.parametrize("kind", ["feat", "exit_1"])
def test_drafts_are_the_same_with_the_cache(target, tiny_distilled, kind):
    """A feature-reading draft reads the target's features at the reused positions: the cache holds them,
    so every proposal, and so every row's draft and acceptance counts, are those of a run without it.
    (Only float32: there the draft's own arithmetic is also the same whatever the batch. At 4 slots rows
    take cached blocks into slots that held nothing or another row: stale features would show.)"""
    if target[0].dtype != torch.float32:
        pytest.skip("float32 only")
    factory = distilled_factory(tiny_distilled[0].out / "d2x64", "feat") if kind == "feat" else exit_1
    counts = []
    for prefix in (None, PrefixCache(64 << 20)):
        loop = make_loop(target, 4, FixedDrafter(kind, 3), [factory], prefix=prefix, features=True)
        done = run(loop)
        counts.append({k: (c.num_draft_tokens, c.num_accepted_draft_tokens) for k, c in done.items()})
        if prefix is not None:
            assert prefix.reused > 0
    assert counts[0] == counts[1]
    assert sum(a for _, a in counts[0].values()) > 0


def test_chunked_prefill_takes_blocks_mid_prompt(target, reference):
    """A token budget smaller than a prompt: a slot part way through its prompt takes the cached blocks
    past what it holds (at 4 slots, all four start the shared instruction in the first steps)."""
    prefix = PrefixCache(64 << 20)
    loop = make_loop(target, 4, NoSpeculation(), prefix=prefix, budget=12)
    assert tokens(run(loop)) == reference
    assert prefix.reused > 0


def test_a_tiny_budget_keeps_the_output_and_the_bound(target, reference):
    model = target[0]
    block_bytes = 2 * model.spec.num_layers * model.spec.num_kv_heads * BLOCK * model.spec.head_dim * \
        model.embed.element_size()
    prefix = PrefixCache(3 * block_bytes)
    loop = make_loop(target, 4, NoSpeculation(), prefix=prefix)
    assert tokens(run(loop)) == reference
    # the instruction's first three blocks fill it; a block continuing a chain never evicts that chain
    assert 0 < prefix.used_bytes <= 3 * block_bytes and len(prefix) == 3 and prefix.reused > 0


def test_ten_thousand_prefixes_stay_under_the_budget():
    """Accounting and LRU eviction alone, with a tiny cache: 10,000 distinct two-block prompts."""
    layers, heads, dim, slots = 2, 1, 4, 1
    cache_k = torch.randn(layers, slots, heads, 64, dim)
    from spin_batch.models.cache import KVCache

    cache = KVCache(cache_k, cache_k.clone())
    block_bytes = 2 * layers * heads * BLOCK * dim * 4
    prefix = PrefixCache(50 * block_bytes)
    shared = list(range(BLOCK))
    for i in range(10_000):
        toks = shared + [1000 + i] * BLOCK + [7]
        prefix.store(toks, 2 * BLOCK, cache, 0)
        assert prefix.used_bytes <= prefix.budget_bytes
    assert prefix.used_bytes == sum(b.nbytes for b in prefix._blocks.values()) == len(prefix) * block_bytes
    assert len(prefix) == 50 and prefix.evicted == 10_000 + 1 - 50
    # the shared first block is touched by every prompt, so it is never the one evicted
    assert len(prefix.match(shared + [1000 + 9999] * BLOCK + [7], 2 * BLOCK)) == 2
    assert len(prefix.match(shared + [1000] * BLOCK + [7], 2 * BLOCK)) == 1


def test_lookup_is_exact_and_stops_before_the_last_token():
    cache = __import__("spin_batch.models.cache", fromlist=["KVCache"]).KVCache.allocate(1, 1, 1, 64, 4, torch.float32,
                                                                                          "cpu")
    prefix = PrefixCache(1 << 20)
    toks = list(range(2 * BLOCK))
    prefix.store(toks, 2 * BLOCK, cache, 0)
    assert len(prefix) == 2
    assert prefix.peek(toks) == 1  # the last token is always computed: a full second block would include it
    assert prefix.peek(toks + [5]) == 2
    other = list(toks)
    other[3] = 99  # differs in the first block: nothing matches, the second block's tokens alike
    assert prefix.peek(other + [5]) == 0


def test_rows_with_cached_prefixes_go_first_within_the_window():
    """reuse_order: within its window, the request whose prompt starts with the most cached blocks first, ties
    in input order; every request once, its encoding (or its error) handed out once."""
    from spin_batch.engine.prefill_share import reuse_order
    from spin_batch.models.cache import KVCache

    cache = KVCache.allocate(1, 1, 1, 64, 4, torch.float32, "cpu")
    prefix = PrefixCache(1 << 20)
    hot = list(range(100, 100 + 2 * BLOCK))
    prefix.store(hot, 2 * BLOCK, cache, 0)
    prompts = {"a": [1] * 20, "b": [2] * 20, "c": hot + [9], "d": None, "e": hot[:BLOCK] + [8] * 5, "f": [3] * 20}
    calls = []

    def encode(r: Request) -> list[int]:
        calls.append(r.id)
        if prompts[r.id] is None:
            raise ValueError("no prompt")
        return prompts[r.id]

    reqs = [Request(f"m#{i}", k, "x", None) for i, k in enumerate(prompts)]
    ordered, encode_once = reuse_order(iter(reqs), encode, prefix, window=4)
    got = []
    for r in ordered:
        got.append(r.id)
        if r.id == "d":
            with pytest.raises(ValueError, match="no prompt"):
                encode_once(r)
        else:
            assert encode_once(r) == prompts[r.id]
    # window a b c d: c (2 blocks) first; refilled, a b d e: e (1 block); then a, b, d, f in input order
    assert got == ["c", "e", "a", "b", "d", "f"]
    assert sorted(calls) == sorted(prompts)  # each encoded once


def test_bench_prefix_variants_and_the_report_line():
    from spin_batch.bench import check_methods, split_prefix
    from spin_batch.config import parse_job
    from spin_batch.report import prefill_line

    assert split_prefix("autoregressive+noprefix") == ("autoregressive", False)
    assert split_prefix("spin+prefix") == ("spin", True) and split_prefix("spin") == ("spin", None)
    job = parse_job({"input": {"paths": ["x.jsonl"]}, "output": {"dir": "o"}})
    check_methods(["autoregressive", "autoregressive+noprefix", "spin+prefix"], job)
    with pytest.raises(ValueError, match="our loop's methods only"):
        check_methods(["hf_generate+noprefix"], job)
    assert prefill_line(100, 300) == "prefill: 100 prompt tokens computed, 300 reused (prefix hit rate 75.0%)"
