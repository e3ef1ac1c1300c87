"""Reproducible sampling (the Gumbel sampler, the default): a seeded sampled row's text is plain
autoregressive sampling's with the same seed, whatever the slots, the drafters, the selector, trees, a
resume after kill -9, or the timing of two runs side by side."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from spin_batch.drafters.base import DraftRequest
from spin_batch.drafters.model import ModelDrafter
from spin_batch.models import execution
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.sampling import SamplingParams
from spin_batch.selection.factory import make_policy
from spin_batch.selection.fixed import NoSpeculation

from conftest import Cycle, write_jsonl
from conftest import make_job
from test_cli_e2e import (_isolate_process_state, assert_each_id_once, part_files, prompt_rows,  # noqa: F401
                          run_ok, start_run, wait_for_parts)
from test_spec_equality import early_exit_1, make_loop, ngram, other_model_factory, random_drafter, run, self_model
from test_tree_loop import TreeShapes, random_trees, watch_plans

SAMPLED = SamplingParams(0.8, top_p=0.95)


@pytest.fixture(scope="module")
def target(tiny_dir):
    """The target on the C path, where every row is computed alone (docs/numerics.md)."""
    return load_model(tiny_dir, plan=execution.forced("c")), load_tokenizer(tiny_dir)


def sampled_loop(target, slots, policy, factories=(), sampling=SAMPLED, seed=7):
    loop = make_loop(target, slots, policy, factories)
    loop.cfg = replace(loop.cfg, sampling=sampling, seed=seed)
    return loop


@pytest.fixture(scope="module")
def plain(target):
    """Autoregressive sampling, one slot, no drafters."""
    return run(sampled_loop(target, 1, NoSpeculation()))


def _drafters(tiny_draft_dir):
    return [early_exit_1, other_model_factory(tiny_draft_dir), ngram, random_drafter, self_model]


NAMES = ["exit_1", "other", "ngram", "random", "self"]


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("selector", ["spin", "none", "cycle", "fixed:other", "fixed:exit_1", "fixed:ngram"])
def test_sampled_text_is_autoregressive_sampling_whatever_drafts(target, plain, tiny_draft_dir, slots, selector):
    name = selector.split(":")[-1]
    loop = sampled_loop(target, slots, Cycle(NAMES if selector == "cycle" else [name]), _drafters(tiny_draft_dir))
    if selector in ("spin", "none"):  # the SPIN bandit (ucb) prices drafts by measured times: each run its own
        loop.policy = make_policy("ucb" if selector == "spin" else "none", loop.drafters, 4, seed=1)
    assert run(loop) == plain
    drafted = loop.stats.summary()["drafters"]
    if selector == "spin" and slots < 16:
        assert any(drafted.get(n, {}).get("pulls") for n in NAMES), drafted
    if selector not in ("spin", "none"):
        assert sum(drafted.get(n, {}).get("draft_tokens", 0) for n in NAMES) > 0, drafted
    if selector in ("cycle", "fixed:other"):  # drafts the target took part of
        assert sum(drafted.get(n, {}).get("accepted_draft_tokens", 0) for n in NAMES) > 0, drafted


def test_sampled_text_with_token_trees_is_autoregressive_sampling(target, plain):
    loop = sampled_loop(target, 4, TreeShapes(["exit_1", "self", "random_trees", "ngram"]),
                        [early_exit_1, self_model, random_trees, ngram])
    seen = watch_plans(loop)
    assert run(loop) == plain
    assert seen["branching"] > 0, seen


def test_another_seed_or_setting_gives_other_text_and_greedy_is_untouched(target, plain):
    assert run(sampled_loop(target, 4, NoSpeculation(), seed=8)) != plain
    assert run(sampled_loop(target, 4, NoSpeculation(), sampling=SamplingParams(0.8))) != plain
    greedy = run(sampled_loop(target, 1, NoSpeculation(), sampling=SamplingParams()))
    assert run(sampled_loop(target, 4, Cycle(["exit_1", "ngram", "self"]), [early_exit_1, ngram, self_model],
                            sampling=SamplingParams())) == greedy


def test_a_draft_models_gumbel_picks_use_the_targets_noise(target):
    """The self drafter (the target as a separate model) drafts exactly the target's tokens: all accepted."""
    model, _ = target
    loop = sampled_loop(target, 2, Cycle(["self"]), [self_model])
    run(loop)
    summary = loop.stats.summary()["drafters"]["self"]
    assert summary["accepted_draft_tokens"] == summary["draft_tokens"] > 0
    drafter = ModelDrafter("d", model, model.allocate_cache(1, 64))
    gen = torch.Generator().manual_seed(3)
    req = DraftRequest(0, [5, 6, 7], 3, gen, sp=SamplingParams(0.8))
    a = drafter.propose([req])
    drafter.on_admit(0)
    b = drafter.propose([req])
    assert a.tokens == b.tokens and a.probs == [None]  # a function of (seed, position): no q, no stream used


# -- through the command line: kill -9 and resume, beside an uninterrupted run ----------------------

ROWS = 60
SECTIONS = dict(
    output={"rows_per_part": 1},
    batch={"slots": 4, "max_model_len": 128, "max_num_batched_tokens": 64},
    sampling={"temperature": 0.8, "top_p": 0.95, "seed": 7, "max_tokens": 24, "ignore_eos": True},
)


def test_a_killed_and_resumed_run_beside_another_gives_autoregressive_sampled_text(tmp_path, tiny_dir, tiny_draft_dir):
    rows = prompt_rows(ROWS)
    ids = [r["id"] for r in rows]
    src = write_jsonl(tmp_path / "in" / "prompts.jsonl", rows)
    drafters = [{"name": "ngram", "kind": "ngram"}, {"name": "exit", "kind": "early_exit", "layers": 1},
                {"name": "draft", "kind": "model", "model": str(tiny_draft_dir)}]
    spin = dict(SECTIONS, drafters=drafters, spin={"selector": "ucb", "num_speculative_tokens": 4})
    killed, killed_out = make_job(tmp_path, tiny_dir, [src], name="killed", **spin)
    beside, beside_out = make_job(tmp_path, tiny_dir, [src], name="beside", **spin)
    (tmp_path / "b").mkdir()
    proc, _, stderr = start_run(killed, tmp_path)
    other, _, _ = start_run(beside, tmp_path / "b")
    try:
        wait_for_parts(proc, killed_out, 2, stderr, timeout=240)
        proc.kill()
        proc.wait(timeout=30)
        assert other.wait(timeout=600) == 0
    finally:
        for p in (proc, other):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert 1 <= len(part_files(killed_out)) < ROWS, "kill -9 did not interrupt the run"
    run_ok(killed)
    plain_job, plain_out = make_job(tmp_path, tiny_dir, [src], name="plain",
                                    **dict(SECTIONS, batch={"slots": 1, "max_model_len": 128,
                                                            "max_num_batched_tokens": 64}))
    run_ok(plain_job)
    want = {i: r["text"] for i, r in assert_each_id_once(plain_out, ids).items()}
    assert {i: r["text"] for i, r in assert_each_id_once(killed_out, ids).items()} == want
    got = assert_each_id_once(beside_out, ids)
    assert {i: r["text"] for i, r in got.items()} == want
    assert sum(r["num_draft_tokens"] for r in got.values()) > 0
