"""Token trees on the device step (engine/device_tree.py): greedy output equal to BatchLoop's token for token,
the same trees and the same accepted paths as BatchLoop's n-gram trees, no host read inside a queued tree step,
and a bounded set of bucket shapes."""

from __future__ import annotations


import pytest

from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.device_step import DeviceDrafting, DeviceLoop
from spin_batch.engine.loop import BatchLoop
from spin_batch.models import execution
from spin_batch.models.buckets import Bucket
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.selection.policy import Choice, Policy, StepChoice
from test_device_step import MANY, _batch_loop, _queue_200_steps, _random_steps, _requests, _run, _same, _settings, \
    _stop_case, _random_gammas

REPETITIVE = ["a b a c a b a c a b a d a b", "x y z x y w x y z x y w x", "1 2 3 1 2 4 1 2 3 1 2 4 1 2",
              "the cat the dog the cat the dog the"]


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir, plan=execution.forced("c")), load_tokenizer(tiny_dir)


class _Trees(Policy):
    """Every slot drafts an n-gram tree of `nodes` nodes at gamma (within its cap), no gate: BatchLoop's tree step."""

    def __init__(self, gamma: int, nodes: int):
        self.gamma, self.nodes = gamma, nodes

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        return StepChoice.of([Choice("ngram", min(c, self.gamma), 0.0, self.nodes) if c > 0 else Choice(None, 0)
                              for c in caps])

    def learn(self, step, outcomes, costs) -> None:
        pass


def _host_trees(target, settings, gamma: int, nodes: int) -> BatchLoop:
    model, tok = target
    return BatchLoop(model, tok, settings, _Trees(gamma, nodes), {"ngram": NgramDrafter("ngram", 1, 3)},
                     model.allocate_cache(settings.slots, settings.max_model_len))


@pytest.mark.parametrize("slots", [1, 4, 6, 16])
def test_device_trees_equal_autoregressive_and_the_host_trees(target, slots):
    """The output is BatchLoop's autoregressive output; and the trees and accepted paths are BatchLoop's n-gram
    trees': per request the same nodes drafted and the same drafts accepted. Trees do branch: more nodes than the
    chain of the same depth drafts, and more drafts accepted."""
    model, tok = target
    settings = _settings(slots)
    prompts = MANY + REPETITIVE
    want = _run(_batch_loop(target, settings), tok, _requests(prompts))
    host = _run(_host_trees(target, settings, 4, 8), tok, _requests(prompts))
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4, nodes=8))
    assert loop.tree is not None and loop.tree.nodes == 8
    got = _run(loop, tok, _requests(prompts))
    _same(want, got)
    _same(want, host)
    for k in got:
        assert got[k].num_draft_tokens == host[k].num_draft_tokens, k
        assert got[k].num_accepted_draft_tokens == host[k].num_accepted_draft_tokens, k
        assert got[k].num_spec_steps == host[k].num_spec_steps, k
    chain = _run(DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4)), tok, _requests(prompts))
    drafted = [sum(c.num_draft_tokens for c in run.values()) for run in (chain, got)]
    accepted = [sum(c.num_accepted_draft_tokens for c in run.values()) for run in (chain, got)]
    assert drafted[1] > drafted[0] and accepted[1] > accepted[0], (drafted, accepted)
    assert all(b.tree for b in loop.graphs.asked if b.width)


def test_device_trees_stop_like_the_loop(target):
    """EOS and stop token ids, stop strings, per-row max_tokens and the context limit, with trees."""
    model, tok = target
    settings, limits = _stop_case(target)
    want = _run(_batch_loop(target, settings), tok, _requests(MANY, limits))
    got = _run(DeviceLoop(model, tok, settings, DeviceDrafting(gamma=8, nodes=16)), tok, _requests(MANY, limits))
    _same(want, got)


def test_device_trees_refuse_model_drafters(target, tiny_draft_dir):
    from spin_batch.drafters.model import ModelDrafter

    model, tok = target
    draft = load_model(tiny_draft_dir, plan=execution.forced("c"))
    with pytest.raises(ValueError, match="n-gram drafter's only"):
        DeviceLoop(model, tok, _settings(2), DeviceDrafting(gamma=4, nodes=8),
                   ModelDrafter("draft", draft, draft.allocate_cache(1, 8)))
    with pytest.raises(ValueError, match="at most 63 nodes"):
        DeviceLoop(model, tok, _settings(2), DeviceDrafting(gamma=4, nodes=64))


def test_queuing_200_tree_steps_reads_nothing_back(target):
    model, tok = target
    loop = DeviceLoop(model, tok, _settings(4, max_model_len=2048, max_tokens=1900), DeviceDrafting(gamma=8, nodes=16))
    inside, outside = _queue_200_steps(loop, tok)
    assert sum(inside.values()) == 0, inside
    assert outside["tolist"] == 199
    assert loop.steps == 200 and int(loop.counters[:4, 1].sum()) > 0  # the trees drafted
    assert set(loop.graphs.asked) == {Bucket(4, 16, tree=True)}


def test_tree_steps_over_500_steps_ask_for_a_bounded_set_of_shapes(target):
    """1-16 live slots, random gamma per slot and step (0 included): the buckets are the slot buckets times
    {chain width 0, the tree's node bucket}."""
    model, tok = target
    loop = DeviceLoop(model, tok, _settings(16, max_model_len=160), DeviceDrafting(gamma=8, nodes=16))
    done = _random_steps(loop, tok, _random_gammas(loop))
    asked = loop.graphs.asked
    assert done > 50 and loop.steps > 400
    assert len(asked) <= 10 and len({b.rows for b in asked}) >= 3
    assert {(b.width, b.tree) for b in asked} == {(0, False), (16, True)}
    assert set(loop.stats()["asked"]) <= {f"{r}x0" for r in (1, 2, 4, 8, 16)} | {f"{r}x16t" for r in (1, 2, 4, 8, 16)}


def test_device_trees_on_the_triton_kernels(tmp_path, tiny_dir):
    """The GPU path on CPU (the Triton interpreter): the tree bucket's forward on kernel_hidden with the device's
    ancestor bits, the Triton walk and keep_path; equal to BatchLoop on the same kernels."""
    pytest.importorskip("triton", reason="triton is not importable")
    from conftest import build_tiny_model
    from spin_batch.models.execution import Execution

    path = build_tiny_model(tmp_path / "one-layer", layers=1, tokenizer_dir=tiny_dir)
    tok = load_tokenizer(path)
    model = load_model(path, plan=execution.forced("torch"),
                       execution=Execution(kernels="triton", cpu="torch", triton=True))
    settings = _settings(2, max_tokens=8)
    prompts = REPETITIVE[:3]
    want = _run(_batch_loop((model, tok), settings), tok, _requests(prompts))
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4, nodes=8))
    assert loop.tree.walk.__name__ == "tree_walk" and loop.tree.keep_path.__name__ == "keep_path"
    got = _run(loop, tok, _requests(prompts))
    _same(want, got)
    assert sum(c.num_draft_tokens for c in got.values()) > 0
