"""Each row's own settings (records.RowParams) in the batch loop: max_tokens, stop, temperature, seed.

Rows with different settings share one batch and one verify forward; greedy rows among sampled ones
still equal autoregressive decoding token for token, with drafts on.
"""

from __future__ import annotations

import pytest

from spin_batch.drafters.early_exit import EarlyExitDrafter
from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.records import Completion, Request, RowParams
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import NoSpeculation

from conftest import Cycle

PROMPTS = ["the cat sat on the mat", "one two three four", "a b a b a b a", "hello world, hello",
           "red green blue", "x y z"]
JOB_MAX = 12


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir), load_tokenizer(tiny_dir)


def make_loop(target, slots: int, sampling: SamplingParams = SamplingParams(), spec: bool = False) -> BatchLoop:
    model, tok = target
    settings = LoopSettings(slots=slots, max_model_len=96, max_num_batched_tokens=64, max_tokens=JOB_MAX,
                            sampling=sampling, ignore_eos=True)
    cache = model.allocate_cache(slots, settings.max_model_len)
    drafters = {}
    if spec:
        drafters = {"exit": EarlyExitDrafter("exit", model, cache, 1), "ngram": NgramDrafter("ngram", 1, 3)}
    policy = Cycle(list(drafters)) if spec else NoSpeculation()
    return BatchLoop(model, tok, settings, policy, drafters, cache)


def run(loop: BatchLoop, params: list[RowParams], prompts=PROMPTS) -> dict[str, Completion]:
    reqs = [Request(f"mem#{i}", str(i), p, None, params=rp) for i, (p, rp) in enumerate(zip(prompts, params))]
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: loop.tok.encode(r.prompt), done.append)
    assert sorted(c.request.id for c in done) == sorted(r.id for r in reqs)
    assert all(c.status == "ok" for c in done), [c.error for c in done]
    return {c.request.id: c for c in done}


@pytest.fixture(scope="module")
def reference(target):
    """Greedy autoregressive ids per prompt at the job's max_tokens, one slot."""
    got = run(make_loop(target, 1), [RowParams()] * len(PROMPTS))
    return {i: list(c.token_ids) for i, c in got.items()}


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "drafts"])
def test_each_row_stops_at_its_own_max_tokens(target, reference, spec):
    caps = [3, None, 1, 7, None, 5]
    got = run(make_loop(target, 3, spec=spec), [RowParams(max_tokens=m) for m in caps])
    for i, m in enumerate(caps):
        c = got[str(i)]
        want = reference[str(i)][: m or JOB_MAX]
        assert list(c.token_ids) == want and c.finish_reason == "length", (i, m)


def test_each_row_stops_at_its_own_stop_string(target, reference):
    _, tok = target
    free = tok.decode(reference["1"], skip_special_tokens=True)
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip() and stop in free
    params = [RowParams()] * len(PROMPTS)
    params[1] = RowParams(stop=(stop,))
    got = run(make_loop(target, 3, spec=True), params)
    assert got["1"].text == free[: free.find(stop)] and got["1"].finish_reason == "stop"
    for i in (0, 2, 3):  # the others run to the job's max_tokens, untouched by row 1's stop
        assert list(got[str(i)].token_ids) == reference[str(i)] and got[str(i)].finish_reason == "length"


@pytest.mark.parametrize("slots", [1, 3, 6])
def test_greedy_rows_beside_sampled_rows_equal_autoregressive(target, reference, slots):
    """The job samples (T=1); every other row asks for temperature 0. With drafts from a model
    (q per sampled row) and the n-gram table, the greedy rows give the autoregressive tokens."""
    params = [RowParams(temperature=0.0) if i % 2 == 0 else RowParams(top_k=20) for i in range(len(PROMPTS))]
    loop = make_loop(target, slots, SamplingParams(temperature=1.0), spec=True)
    got = run(loop, params)
    for i in range(0, len(PROMPTS), 2):
        assert list(got[str(i)].token_ids) == reference[str(i)], i
    assert loop.stats.summary()["drafters"]["exit"]["draft_tokens"] > 0


def test_a_row_seed_gives_the_same_text_whatever_the_id_and_the_batch(target):
    """OpenAI's `seed`: the same seed and prompt sample the same tokens (ids differ, other rows differ)."""
    prompts = ["the cat sat", "the cat sat", "the cat sat", "one two"]
    params = [RowParams(seed=7), RowParams(seed=7), RowParams(seed=8), RowParams(seed=7)]
    sampling = SamplingParams(temperature=1.0)
    a = run(make_loop(target, 4, sampling), params, prompts)
    b = run(make_loop(target, 1, sampling), params, prompts)
    ids = {k: list(c.token_ids) for k, c in a.items()}
    assert ids["0"] == ids["1"] and ids["0"] != ids["2"]
    assert ids == {k: list(c.token_ids) for k, c in b.items()}
    # without a row seed the stream comes from the job seed and the id: ids differ, so do the tokens
    c = run(make_loop(target, 2, sampling), [RowParams(), RowParams()], prompts[:2])
    assert list(c["0"].token_ids) != list(c["1"].token_ids)
