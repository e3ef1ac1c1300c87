"""Token trees through the batch loop: greedy output equals autoregressive output token for token.

Plain, chain and tree slots mix in one batch (TreeShapes), over every drafter kind that grows trees
(model drafters, early exit, n-gram, vote, cascade) and one that proposes random trees (the target
almost never agrees), at 1, 3 and 8 slots, on both CPU paths (test_spec_equality's `target`). The
sampled side of trees is proven on the rule (test_tree_verify.py: first and second positions, wrong
rules caught); here a sampled batch with trees runs, repeats by seed, and keeps its greedy rows exact.
"""

from __future__ import annotations

import pytest
import torch

from spin_batch.drafters.base import Drafter, DraftRequest, Proposal
from spin_batch.drafters.cascade import CascadeDrafter
from spin_batch.drafters.model import FeatureDrafter
from spin_batch.drafters.vote import VoteDrafter
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.engine.tree_verify import DraftTree
from spin_batch.models.distilled import TargetFeatures, load_draft
from spin_batch.records import Request, RowParams
from spin_batch.sampling import SamplingParams
from spin_batch.selection.policy import NO_SPEC, Choice, Policy, StepChoice

from test_spec_equality import (MAX_TOKENS, PROMPTS, early_exit_1, early_exit_all, make_loop,  # noqa: F401
                                ngram, other_model_factory, reference, run, self_model, target)


class RandomTrees(Drafter):
    """Random trees of `nodes` nodes (distinct siblings, depth <= gamma): the target almost never agrees."""

    kind = "random_trees"
    trees = True

    def __init__(self, vocab: int):
        super().__init__("random_trees")
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        tokens, parents = [], []
        for r in reqs:
            if r.nodes <= 1:  # a chain
                tokens.append(torch.randint(0, self.vocab, (r.gamma,), generator=self.gen).tolist())
                parents.append(None)
                continue
            toks, pars, depth = [], [], []
            while len(toks) < r.nodes:
                p = int(torch.randint(-1, len(toks), (1,), generator=self.gen))
                while p >= 0 and depth[p] >= r.gamma:
                    p = pars[p]
                t = int(torch.randint(0, self.vocab, (1,), generator=self.gen))
                if t in {x for x, q in zip(toks, pars) if q == p}:
                    continue
                toks.append(t)
                pars.append(p)
                depth.append(1 if p < 0 else depth[p] + 1)
            tokens.append(toks)
            parents.append(pars)
        return Proposal(tokens, [None] * len(reqs), parents)


class TreeShapes(Policy):
    """Per slot and step: plain decoding, a chain, or a tree (2..9 nodes), cycling over the drafters."""

    def __init__(self, names: list[str]):
        self.names, self.t = names, 0

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        self.t += 1
        out = []
        for s, cap in zip(slots, caps):
            k = s + self.t
            shape, name = k % 3, self.names[(k // 3) % len(self.names)]
            if shape == 0 or cap == 0:
                out.append(NO_SPEC)
            else:
                out.append(Choice(name, min(1 + k % 4, cap), 0.0, 2 + k % 8 if shape == 2 else 0))
        return StepChoice.of(out)


def watch_plans(loop: BatchLoop) -> dict[str, int]:
    """Count what the loop's verify batches held: branching trees, and batches mixing trees with chains."""
    seen = {"trees": 0, "branching": 0, "mixed": 0}
    plan = loop.plan

    def counting(decode, drafts, prefill=True, trees=None):
        p = plan(decode, drafts, prefill, trees)
        shapes = [t for t in p.trees if t is not None]
        seen["trees"] += len(shapes)
        seen["branching"] += sum(any(len(k) > 1 for k in DraftTree(d, t).children())
                                 for d, t in zip(p.drafts, p.trees) if t is not None)
        seen["mixed"] += bool(shapes) and any(t is None and d for d, t in zip(p.drafts, p.trees))
        return p

    loop.plan = counting
    return seen


def random_trees(model, cache, slots):
    return RandomTrees(model.spec.vocab_size)


FACTORIES = [early_exit_all, early_exit_1, self_model, ngram, random_trees]
NAMES = ["exit_all", "exit_1", "self", "ngram", "random_trees"]


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_trees_chains_and_plain_slots_in_one_batch_equal_autoregressive(target, reference, tiny_draft_dir, slots):
    loop = make_loop(target, slots, TreeShapes(NAMES + ["other"]), FACTORIES + [other_model_factory(tiny_draft_dir)])
    seen = watch_plans(loop)
    assert run(loop) == reference
    assert seen["branching"] > 0, seen
    if slots > 1:
        assert seen["mixed"] > 0, seen


@pytest.mark.parametrize("slots", [3, 8])
def test_trees_in_pipelined_micro_batches_equal_autoregressive(target, reference, slots):
    """Two micro-batches per step (spin.pipeline: on): the second drafts its trees while the first
    verifies and compacts its own, slot by slot."""
    from dataclasses import replace

    loop = make_loop(target, slots, TreeShapes(NAMES), FACTORIES)
    loop.cfg = replace(loop.cfg, pipeline=True)
    seen = watch_plans(loop)
    assert run(loop) == reference
    assert seen["branching"] > 0, seen


def test_an_agreeing_tree_drafter_is_accepted_whole(target, reference):
    """The target as its own draft: the first path of every tree is the target's, so each step accepts
    gamma tokens (the cache compaction keeps exactly the accepted path)."""
    loop = make_loop(target, 3, TreeShapes(["self"]), [self_model])
    assert run(loop) == reference
    d = loop.stats.summary()["drafters"]["self"]
    assert d["accepted_draft_tokens"] > 0.3 * d["draft_tokens"], d


def _composites(model, cache, slots, draft_dir):
    members = {d.name: d for d in (early_exit_1(model, cache, slots), ngram(model, cache, slots),
                                   other_model_factory(draft_dir)(model, cache, slots))}
    vote = VoteDrafter("vote", dict(members), beta=0.5, slots=slots)
    cascade = CascadeDrafter("cascade", {"ngram": members["ngram"], "other": members["other"]}, min_tokens=2)
    return {**members, "vote": vote, "cascade": cascade}


@pytest.mark.parametrize("slots", [1, 8])
def test_vote_and_cascade_trees_equal_autoregressive(target, reference, tiny_draft_dir, slots):
    model, tok = target
    loop = make_loop(target, slots, TreeShapes(["vote", "cascade"]))
    loop.drafters = _composites(model, loop.cache, slots, tiny_draft_dir)
    seen = watch_plans(loop)
    assert run(loop) == reference
    assert seen["trees"] > 0, seen


@pytest.mark.parametrize("slots", [1, 3])
def test_feature_reading_draft_trees_equal_autoregressive(target, reference, tiny_distilled, slots):
    """A feature-reading draft grows trees from predicted features (each node fed its parent's prediction)."""
    model, tok = target
    settings, _ = tiny_distilled
    draft = load_draft(settings.out / "d2x64", model, torch.float32, torch.device("cpu"))
    loop = make_loop(target, slots, TreeShapes(["feat"]))
    features = TargetFeatures(slots, loop.cache.max_len, model.spec.hidden_size, model.spec.rms_norm_eps,
                              model.dtype, torch.device("cpu"))
    loop.drafters = {"feat": FeatureDrafter("feat", draft, draft.allocate_cache(slots, loop.cache.max_len), features)}
    loop._features = [features]
    seen = watch_plans(loop)
    assert run(loop) == reference
    assert seen["branching"] > 0, seen
    assert loop.stats.summary()["drafters"]["feat"]["accepted_draft_tokens"] > 0


def test_trees_are_off_where_the_target_cannot_verify_them(target, reference):
    """A target without tree segments (the transformers backend) gets chains from the same choices."""
    loop = make_loop(target, 3, TreeShapes(["self"]), [self_model])
    loop.tree_segments = False
    seen = watch_plans(loop)
    assert run(loop) == reference
    assert seen["trees"] == 0


def _sampled(target, seed: int, greedy_ids=("2",)):
    """A sampled batch with trees; the rows in greedy_ids ask for greedy decoding themselves."""
    model, tok = target
    settings = LoopSettings(slots=3, max_model_len=128, max_num_batched_tokens=64, max_tokens=MAX_TOKENS,
                            sampling=SamplingParams(0.9, top_k=20), seed=seed, ignore_eos=True)
    cache = model.allocate_cache(3, 128)
    drafters = {d.name: d for d in (self_model(model, cache, 3), random_trees(model, cache, 3))}
    loop = BatchLoop(model, tok, settings, TreeShapes(["self", "random_trees"]), drafters, cache)
    seen = watch_plans(loop)
    reqs = [Request(source=f"mem#{i}", id=str(i), prompt=p, messages=None,
                    params=RowParams(temperature=0.0) if str(i) in greedy_ids else RowParams())
            for i, p in enumerate(PROMPTS)]
    done = []
    loop.run(iter(reqs), lambda r: tok.encode(r.prompt), done.append)
    assert seen["branching"] > 0
    return {c.request.id: list(c.token_ids) for c in done}


def test_sampling_with_trees_repeats_by_seed_and_keeps_greedy_rows_exact(target, reference):
    a, b, c = _sampled(target, 1), _sampled(target, 1), _sampled(target, 2)
    assert a == b
    assert a != c
    assert a["2"] == reference["2"] == c["2"]
    assert all(len(v) == MAX_TOKENS for v in a.values())


def test_target_features_keep_the_accepted_path_as_the_cache_does():
    """After a tree verify the accepted nodes' features move to the rows after the root, as their K/V do,
    so the next catch-up reads the path's features and not a sibling's."""
    f = TargetFeatures(2, 16, 3, 1e-6, torch.float32, torch.device("cpu"))
    f.g[1] = torch.arange(16.0)[:, None].expand(16, 3)  # row r holds r
    f.keep_path(1, cache_len=4, path=[2, 5, 6])  # segment tokens 2, 5, 6 below the root at row 4
    assert f.g[1, :, 0].tolist() == [0, 1, 2, 3, 4, 6, 9, 10, 8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(f.g[0], torch.zeros(16, 3))
