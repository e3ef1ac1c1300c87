"""CUDA graphs of the short forwards (models/cuda_graphs.py).

The switch (the job's execution: on wherever the Triton kernels run on CUDA, SPIN_BATCH_CUDA_GRAPHS
overriding) is checked everywhere. The replays themselves need a GPU with the Triton kernels
compiled (scripts/gpu_check.sh runs this file there): a replayed forward must equal the eager
Triton forward bit for bit, logits and cache both, and the greedy loop must give the same tokens
with graphs on and off, speculative or not.
"""

from __future__ import annotations

import os

import pytest
import torch

from spin_batch.drafters.model import ModelDrafter
from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.selection.fixed import FixedDrafter, NoSpeculation
from spin_batch.sampling import SamplingParams
from spin_batch.records import Request
from spin_batch.models import cuda_graphs
from spin_batch.models.execution import ENV_GRAPHS, Execution
from spin_batch.models.loader import ExecutionError, load_model, load_tokenizer, resolve_execution
from spin_batch.models.segments import Segments

ON_GPU = torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
gpu = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU with compiled Triton kernels")


def test_graphs_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(ENV_GRAPHS, raising=False)
    monkeypatch.delenv("SPIN_BATCH_KERNELS", raising=False)
    assert not resolve_execution("auto", cpu).cuda_graphs
    if not ON_GPU:  # Triton on CPU tensors: the interpreter, no graphs
        assert resolve_execution("triton", cpu).triton and not resolve_execution("triton", cpu).cuda_graphs
    if torch.cuda.is_available():
        assert resolve_execution("auto", torch.device("cuda")).cuda_graphs
        monkeypatch.setenv(ENV_GRAPHS, " OFF ")
        assert not resolve_execution("auto", torch.device("cuda")).cuda_graphs
    monkeypatch.setenv(ENV_GRAPHS, "sometimes")
    with pytest.raises(ExecutionError, match="on, off or auto"):
        resolve_execution("auto", cpu)
    monkeypatch.setenv(ENV_GRAPHS, "on")
    with pytest.raises(ExecutionError, match=r"needs a CUDA device and the Triton kernels \(device cpu"):
        resolve_execution("torch", cpu)
    if torch.cuda.is_available():
        with pytest.raises(ExecutionError, match="Triton kernels off"):
            resolve_execution("torch", torch.device("cuda"))


def test_cpu_model_has_no_graphs_and_rejects_forced_graphs(tiny_dir, monkeypatch):
    monkeypatch.delenv(ENV_GRAPHS, raising=False)
    assert load_model(tiny_dir).graphs is None
    # a model given graphs where there is no CUDA (built outside the loader) has none all the same
    assert load_model(tiny_dir, execution=Execution(cuda_graphs=True)).graphs is None
    monkeypatch.setenv(ENV_GRAPHS, "on")
    with pytest.raises(ExecutionError, match=ENV_GRAPHS):
        load_model(tiny_dir)


def test_segments_make_device_tensors_once_and_lazily():
    seg = Segments.build([(2, 3, 5), (0, 0, 4), (1, 1, 0)])
    assert seg._tensors is None  # nothing made until a forward asks
    assert seg.slot_list == [2, 2, 2, 1] and seg.position_list == [5, 6, 7, 0]
    assert seg.token_slots.tolist() == [2, 2, 2, 1] and seg.positions.tolist() == [5, 6, 7, 0]
    assert seg.token_slots is seg.token_slots and seg.positions.is_contiguous()
    assert seg.token_slots.dtype == torch.long
    # one host tensor for the Triton path: token slots, positions, then slots, starts, cache lengths
    assert seg.packed_index().tolist() == [2, 2, 2, 1, 5, 6, 7, 0, 2, 0, 1, 0, 3, 3, 4, 5, 4, 0]


# -- on a GPU --------------------------------------------------------------------------------


def _cuda_model(tiny_dir, monkeypatch, graphs: str):
    monkeypatch.setenv("SPIN_BATCH_KERNELS", "auto")
    monkeypatch.setenv(ENV_GRAPHS, graphs)
    return load_model(tiny_dir, device="cuda")


@gpu
def test_replay_equals_eager_bit_for_bit(tiny_dir, monkeypatch):
    eager = _cuda_model(tiny_dir, monkeypatch, "off")
    graphed = _cuda_model(tiny_dir, monkeypatch, "on")
    assert eager.graphs is None and graphed.graphs is not None
    caches = [m.allocate_cache(4, 64) for m in (eager, graphed)]
    gen = torch.Generator().manual_seed(0)
    prompt = Segments.build([(s, 9 + s, 0) for s in range(4)], "cuda")  # a 9-12 token prefill per slot
    ids = torch.randint(0, eager.spec.vocab_size, (prompt.num_tokens,), generator=gen).cuda()
    for m, c in zip((eager, graphed), caches):
        m.forward(ids, prompt, c)
    ctx = [9, 10, 11, 12]
    # decode steps, then verify runs of mixed lengths: each shape recurs with new ids and context lengths
    steps = [[1, 1, 1, 1]] * 4 + [[3, 1, 5, 2]] * 4 + [[1, 1, 1, 1]] * 2
    for lens in steps:
        seg = Segments.build([(s, n, ctx[s]) for s, n in enumerate(lens)], "cuda")
        ids = torch.randint(0, eager.spec.vocab_size, (seg.num_tokens,), generator=gen).cuda()
        want = eager.forward(ids, seg, caches[0])
        got = graphed.forward(ids, seg, caches[1])
        assert torch.equal(got, want)
        ctx = [c + n for c, n in zip(ctx, lens)]
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    stats = graphed.graphs.stats()
    # the first sighting of a shape runs eagerly (the prefill's too: 9-12 tokens a segment is short)
    assert stats == {"graphs": 2, "replays": 3 + 3 + 2, "eager": 3}


@gpu
def test_prefill_and_oversized_forwards_stay_eager(tiny_dir, monkeypatch):
    m = _cuda_model(tiny_dir, monkeypatch, "on")
    cache = m.allocate_cache(2, 128)
    seg = Segments.build([(0, cuda_graphs.MAX_SEGMENT + 1, 0)], "cuda")
    ids = torch.zeros(seg.num_tokens, dtype=torch.long, device="cuda")
    for _ in range(3):
        m.forward(ids, seg, cache)
    assert m.graphs.stats() == {"graphs": 0, "replays": 0, "eager": 0}


def _run(model, tok, slots: int, policy, drafters=()) -> dict[str, list[int]]:
    settings = LoopSettings(slots=slots, max_model_len=128, max_num_batched_tokens=64, max_tokens=20,
                            sampling=SamplingParams(), eos_token_ids=frozenset(), ignore_eos=True)
    cache = model.allocate_cache(slots, settings.max_model_len)
    loop = BatchLoop(model, tok, settings, policy, {d.name: d for d in drafters}, cache)
    prompts = ["the quick brown fox jumps over the lazy dog. the quick brown fox", "compute 12 * 7 = 84 and 9 + 10 =",
               "red green blue red green blue red", "a", "what causes the tides?"]
    done = []
    loop.run(iter([Request(source="mem", id=str(i), prompt=p, messages=None) for i, p in enumerate(prompts)]),
             lambda r: tok.encode(r.prompt), done.append)
    assert [c.status for c in done] == ["ok"] * len(prompts)
    return {c.request.id: list(c.token_ids) for c in done}


@gpu
@pytest.mark.parametrize("slots", [1, 3])
def test_greedy_loop_same_tokens_with_graphs_on_and_off(tiny_dir, monkeypatch, slots):
    tok = load_tokenizer(tiny_dir)
    results = {}
    for graphs in ("off", "on"):
        m = _cuda_model(tiny_dir, monkeypatch, graphs)
        draft = _cuda_model(tiny_dir, monkeypatch, graphs)  # the target as its own drafter: long accepted runs
        results[graphs] = {
            "ar": _run(m, tok, slots, NoSpeculation()),
            "ngram": _run(m, tok, slots, FixedDrafter("ngram", 4), [NgramDrafter("ngram", 1, 3)]),
            "self": _run(m, tok, slots, FixedDrafter("self", 4),
                         [ModelDrafter("self", draft, draft.allocate_cache(slots, 128))]),
        }
        if graphs == "on":
            assert m.graphs.stats()["replays"] > 0 and draft.graphs.stats()["replays"] > 0
    assert results["on"] == results["off"]
    # lossless on the GPU too: speculative output equals autoregressive output
    assert results["on"]["ngram"] == results["on"]["ar"] and results["on"]["self"] == results["on"]["ar"]
