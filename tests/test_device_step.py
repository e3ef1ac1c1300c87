"""The device step (engine/device_step.py): greedy output equal to BatchLoop's autoregressive output token for
token, no host read inside a queued step, and a handful of bucket shapes for every step."""

from __future__ import annotations

import random

import pytest

from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.device_step import HOST_READS, DeviceDrafting, DeviceLoop, host_reads
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.models import execution
from spin_batch.models.buckets import bucket_of
from spin_batch.models.loader import load_model, load_tokenizer
from spin_batch.models.segments import Segments
from spin_batch.records import Completion, Request
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import NoSpeculation
from test_spec_equality import PROMPTS

MANY = PROMPTS + [p[::-1] for p in PROMPTS] + ["the the the the the", "1 2 3 1 2 3 1 2"]  # 24 prompts


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(tiny_dir, plan=execution.forced("c")), load_tokenizer(tiny_dir)


def _settings(slots: int, **kw) -> LoopSettings:
    base = dict(slots=slots, max_model_len=128, max_num_batched_tokens=64, max_tokens=20, sampling=SamplingParams(),
                eos_token_ids=frozenset(), ignore_eos=True)
    return LoopSettings(**{**base, **kw})


def _requests(prompts, max_tokens=None) -> list[Request]:
    from spin_batch.records import RowParams

    return [Request(source=f"mem#{i}", id=str(i), prompt=p, messages=None,
                    params=RowParams(max_tokens=None if max_tokens is None else max_tokens[i]))
            for i, p in enumerate(prompts)]


def _run(loop, tok, reqs) -> dict[str, Completion]:
    done: list[Completion] = []
    loop.run(iter(reqs), lambda r: tok.encode(r.prompt), done.append)
    assert len(done) == len(reqs) and all(c.status == "ok" for c in done), [c.error for c in done if c.error]
    return {c.request.id: c for c in done}


def _batch_loop(target, settings):
    model, tok = target
    return BatchLoop(model, tok, settings, NoSpeculation(), {}, model.allocate_cache(settings.slots,
                                                                                    settings.max_model_len))


def _same(want: dict[str, Completion], got: dict[str, Completion]) -> None:
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].token_ids == want[k].token_ids, k
        assert (got[k].text, got[k].finish_reason) == (want[k].text, want[k].finish_reason), k


@pytest.mark.parametrize("slots", [1, 4, 5, 16])  # 5: a bucket of 8 rows over 6 slots (the scratch slot pads)
@pytest.mark.parametrize("gamma", [0, 4, 8])
def test_device_step_equals_autoregressive(target, slots, gamma):
    model, tok = target
    settings = _settings(slots)
    want = _run(_batch_loop(target, settings), tok, _requests(MANY))
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=gamma))
    got = _run(loop, tok, _requests(MANY))
    _same(want, got)
    if gamma:  # the n-gram drafts were verified, and some accepted
        assert sum(c.num_draft_tokens for c in got.values()) > 0
        assert sum(c.num_accepted_draft_tokens for c in got.values()) > 0


def _stop_case(target) -> tuple[LoopSettings, list[int | None]]:
    """Settings that end completions early and per-row max_tokens (None: the job's 20): the tokens the target
    emits most made EOS, a stop id and a stop string, and a short context."""
    model, tok = target
    free = _run(_batch_loop(target, _settings(4)), tok, _requests(MANY))
    counts: dict[int, int] = {}
    for c in free.values():
        for t in c.token_ids:
            counts[t] = counts.get(t, 0) + 1
    common = sorted(counts, key=lambda t: -counts[t])
    settings = _settings(4, eos_token_ids=frozenset({common[0]}), ignore_eos=False,
                         stop_token_ids=frozenset({common[3]}), stop=(tok.decode([common[5]]).strip() or "e",),
                         max_model_len=72)
    rng = random.Random(0)
    return settings, [None if i % 3 == 0 else rng.randint(1, 10) for i in range(len(MANY))]


def _random_steps(loop, tok, queue, steps: int = 500) -> int:
    """Drives loop `steps` steps over 1-16 busy slots (redrawn every 25 steps: requests of random lengths finish
    and others take their places); queue(live, rng) queues each step. The requests finished."""
    rng = random.Random(1)
    done = 0
    stream = iter(_requests(MANY * 40, [rng.randint(1, 40) for _ in range(len(MANY) * 40)]))
    occupancy = 1
    for t in range(steps):
        if t % 25 == 0:
            occupancy = rng.randint(1, 16)  # how many slots the stream keeps busy for a while
        while sum(s is not None for s in loop.slots) < occupancy:
            r = next(stream)
            loop.admit(r, tok.encode(r.prompt))
        live = [s for s in loop.slots if s is not None and not s.done]
        if live:
            queue(live, rng)
        if loop.queued and (len(loop.queued) > 1 or not live):
            done += len(loop.collect())
    return done


def _random_gammas(loop):
    """_random_steps' queue: a random gamma per live slot and step, up to 0, 3 or 8."""
    def queue(live, rng):
        most = rng.choice([0, 3, 8])
        loop.queue([rng.randint(0, most) for _ in live])
    return queue


def test_device_step_stops_like_the_loop(target):
    """EOS and stop token ids (cut on the device), stop strings (on the host), per-row max_tokens and the context
    limit: the same tokens, texts and finish reasons."""
    model, tok = target
    settings, limits = _stop_case(target)
    want = _run(_batch_loop(target, settings), tok, _requests(MANY, limits))
    assert {c.finish_reason for c in want.values()} == {"stop", "length"}
    for gamma in (0, 8):
        got = _run(DeviceLoop(model, tok, settings, DeviceDrafting(gamma=gamma)), tok, _requests(MANY, limits))
        _same(want, got)


def test_device_step_gated_ngram_equals_autoregressive(target):
    model, tok = target
    settings = _settings(4)
    drafter = NgramDrafter("ngram", 1, 3)
    drafter.outcomes[1] = [1.0, 3.0]  # a_1 = 0.25: the gate keeps no token after a 1-gram match at 0.3
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4, min_prob=0.3), drafter)
    assert loop.keep.tolist()[1] == 0 and loop.keep.tolist()[3] > 0
    _same(_run(_batch_loop(target, settings), tok, _requests(MANY)), _run(loop, tok, _requests(MANY)))


# -- no host read inside the step ---------------------------------------------------------------

AUDITED, audit = HOST_READS, host_reads  # the sync audit (engine/device_step.py)


def _long_requests(n: int) -> list[Request]:
    return _requests(MANY[:n], [1900] * n)  # more than 200 steps of 9 tokens


@pytest.mark.parametrize("gamma", [0, 8])
def test_queuing_200_steps_reads_nothing_back(target, gamma):
    model, tok = target
    loop = DeviceLoop(model, tok, _settings(4, max_model_len=2048, max_tokens=1900), DeviceDrafting(gamma=gamma))
    inside, outside = _queue_200_steps(loop, tok)
    assert sum(inside.values()) == 0, inside
    assert outside["tolist"] == 199  # the host reads one record per step, one step behind
    assert loop.steps == 200 and loop.host_reads == 199


def _queue_200_steps(loop, tok) -> tuple[dict, dict]:
    """Admit four long requests, queue 200 steps and collect behind them; the audited calls (inside the queued
    steps, and in the collects outside them)."""
    for r in _long_requests(4):
        loop.admit(r, tok.encode(r.prompt))
    inside = {name: 0 for name in AUDITED}
    outside = {name: 0 for name in AUDITED}
    for _ in range(200):
        with audit() as calls:
            assert loop.queue() is not None
        for k, v in calls.items():
            inside[k] += v
        with audit() as calls:
            if len(loop.queued) > 1:
                assert not loop.collect()  # nobody finishes
        for k, v in calls.items():
            outside[k] += v
    return inside, outside


def test_the_audit_sees_the_loops_host_reads(target):
    """The same audit around BatchLoop.step counts its reads (Segments, the logits rows, the verdict): it is no
    audit that cannot fail."""
    model, tok = target
    loop = _batch_loop(target, _settings(4, max_model_len=2048, max_tokens=1900))
    for r in _long_requests(4):
        loop.admit(r, tok.encode(r.prompt))
    loop.step()  # prefill
    with audit() as calls:
        for _ in range(5):
            loop.step()
    assert sum(calls.values()) >= 5


# -- buckets ------------------------------------------------------------------------------------


def test_500_random_steps_ask_for_at_most_15_shapes():
    rng = random.Random(0)
    shapes = {bucket_of(rng.randint(1, 16), [rng.randint(0, 8) for _ in range(16)][: rng.randint(1, 16)])
              for _ in range(500)}
    assert len(shapes) <= 15
    assert bucket_of(3, [0, 2, 1]).rows == 4 and bucket_of(3, [0, 2, 1]).width == 4
    assert bucket_of(16, 8).tokens == 16 * 9
    with pytest.raises(ValueError):
        bucket_of(1, 17)


def test_a_device_loop_over_500_steps_asks_for_at_most_15_shapes(target):
    """1-16 live slots as requests of random lengths finish and others take their places, random gamma per slot
    and step (0 included), drafts accepted at random: the step bodies the graphs are asked for are buckets."""
    model, tok = target
    loop = DeviceLoop(model, tok, _settings(16, max_model_len=160), DeviceDrafting(gamma=8))
    done = _random_steps(loop, tok, _random_gammas(loop))
    assert done > 50 and loop.steps > 400
    asked = loop.graphs.asked
    assert len(asked) <= 15 and len({b.rows for b in asked}) >= 3  # the step's shape did vary
    assert {b.width for b in asked} == {0, 4, 8}


def test_device_step_on_the_triton_kernels(tmp_path, tiny_dir):
    """The GPU path on CPU (the Triton interpreter): the bucket's forward from a device-built packed index
    (kernel_hidden), the Triton n-gram and accept/commit kernels; equal to BatchLoop on the same kernels."""
    pytest.importorskip("triton", reason="triton is not importable")
    from conftest import build_tiny_model
    from spin_batch.models.execution import Execution

    path = build_tiny_model(tmp_path / "one-layer", layers=1, tokenizer_dir=tiny_dir)
    tok = load_tokenizer(path)
    model = load_model(path, plan=execution.forced("torch"),
                       execution=Execution(kernels="triton", cpu="torch", triton=True))
    assert model.kernels is not None
    settings = _settings(2, max_tokens=6)
    want = _run(_batch_loop((model, tok), settings), tok, _requests(MANY[:3]))
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4))
    assert loop.commit_op.__name__ == "accept_commit" and loop.ngram_op.__name__ == "ngram_draft"
    _same(want, _run(loop, tok, _requests(MANY[:3])))


# -- model drafters' chains ---------------------------------------------------------------------


def _model_drafter(kind: str, target, tiny_dir, tiny_draft_dir):
    """self: the target's weights as a separate draft (its own cache; it agrees with the target on nearly every
    token, so the rollback arithmetic shows in the acceptance); other: a different random model; exit1: the
    target's first layer over the target's cache; int8: the target's int8 copy over the target's cache."""
    from spin_batch.drafters.early_exit import EarlyExitDrafter
    from spin_batch.drafters.model import ModelDrafter
    from spin_batch.models.loader import load_state_dict

    model, _ = target
    if kind == "self":
        return ModelDrafter("self", load_model(tiny_dir, plan=execution.forced("c")), model.allocate_cache(1, 8))
    if kind == "other":
        draft = load_model(tiny_draft_dir, plan=execution.forced("c"))
        return ModelDrafter("other", draft, draft.allocate_cache(1, 8))
    if kind == "exit1":
        return EarlyExitDrafter("exit1", model, model.allocate_cache(1, 8), 1)
    return EarlyExitDrafter("int8", model, model.allocate_cache(1, 8), None, model.int8_copy(load_state_dict(tiny_dir)))


@pytest.mark.parametrize("slots", [1, 4, 16])
@pytest.mark.parametrize("kind", ["self", "other", "exit1", "int8"])
def test_device_step_model_chains_equal_autoregressive(target, tiny_dir, tiny_draft_dir, slots, kind):
    model, tok = target
    settings = _settings(slots)
    want = _run(_batch_loop(target, settings), tok, _requests(MANY))
    drafter = _model_drafter(kind, target, tiny_dir, tiny_draft_dir)
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4 if slots == 4 else 8), drafter)
    assert loop.chain is not None and loop.chain.own_cache == (kind in ("self", "other"))
    got = _run(loop, tok, _requests(MANY))
    _same(want, got)
    drafted = sum(c.num_draft_tokens for c in got.values())
    accepted = sum(c.num_accepted_draft_tokens for c in got.values())
    assert drafted > 0 and all(c.drafter_pulls.keys() == {kind} for c in got.values())
    if kind == "self":  # the target's weights: a draft whose cache is right after every rollback agrees always
        assert accepted == drafted, (accepted, drafted)


def test_device_chain_drafts_what_the_host_chain_drafts(target, tiny_dir, tiny_draft_dir):
    """The same state, the same draft: DraftChain's greedy chains equal ModelDrafter.propose's, token for token,
    for a draft with its own cache (the invariant: right below n - 2, then a two-row catch-up) and on the target's."""
    import torch

    from spin_batch.drafters.base import DraftRequest
    from spin_batch.engine.device_draft import DraftChain

    model, tok = target
    prompts = [tok.encode(p) for p in MANY[:5]]
    for kind in ("other", "exit1"):
        host = _model_drafter(kind, target, tiny_dir, tiny_draft_dir)
        host.cache = host.model.allocate_cache(6, 64) if kind == "other" else model.allocate_cache(6, 64)
        host.lens = [0] * 6
        device_cache = host.model.allocate_cache(6, 64) if kind == "other" else host.cache
        chain = DraftChain(host.model, device_cache, host.num_layers, own_cache=kind == "other")
        history = torch.zeros(6, 64, dtype=torch.long)
        lengths = torch.ones(6, dtype=torch.long)
        for s, ids in enumerate(prompts):
            history[s, : len(ids)] = torch.tensor(ids)
            lengths[s] = len(ids)
            if kind == "other":
                chain.admit(s, ids[:-1], 64)  # the prompt but its last token: right below n - 1 >= n - 2
            else:  # the target's cache holds every committed token but the last
                model.forward(torch.tensor(ids[:-1]), Segments.build([(s, len(ids) - 1, 0)], model.device), host.cache)
        rows = torch.tensor([4, 0, 2, 5])  # slot 5: a padding row of nothing
        gamma = torch.tensor([6, 3, 0, 0])
        drafts, counts = chain.draft(rows, history, lengths, gamma, 8)
        assert counts.tolist() == [6, 3, 0, 0]
        want = host.propose([DraftRequest(s, prompts[s], g, None) for s, g in ((4, 6), (0, 3))]).tokens
        assert drafts[0, :6].tolist() == want[0] and drafts[1, :3].tolist() == want[1], kind
        assert drafts[0, 6:].tolist() == [0, 0] and drafts[2].tolist() == [0] * 8


@pytest.mark.parametrize("kind", ["other", "exit1"])
def test_queuing_200_model_chain_steps_reads_nothing_back(target, tiny_dir, tiny_draft_dir, kind):
    model, tok = target
    loop = DeviceLoop(model, tok, _settings(4, max_model_len=2048, max_tokens=1900), DeviceDrafting(gamma=4),
                      _model_drafter(kind, target, tiny_dir, tiny_draft_dir))
    inside, _ = _queue_200_steps(loop, tok)
    assert sum(inside.values()) == 0, inside
    assert loop.steps == 200 and int(loop.counters[:4, 1].sum()) > 0  # the chains drafted


def test_device_model_chain_on_the_triton_kernels(tmp_path, tiny_dir):
    """A draft with its own cache (the target's weights, loaded again) on the Triton path under the interpreter:
    the chain's forwards from device-built packed indexes; equal to BatchLoop, every draft accepted."""
    pytest.importorskip("triton", reason="triton is not importable")
    from conftest import build_tiny_model
    from spin_batch.drafters.model import ModelDrafter
    from spin_batch.models.execution import Execution

    path = build_tiny_model(tmp_path / "one-layer", layers=1, tokenizer_dir=tiny_dir)
    tok = load_tokenizer(path)

    def load():
        return load_model(path, plan=execution.forced("torch"),
                          execution=Execution(kernels="triton", cpu="torch", triton=True))

    model, draft = load(), load()
    settings = _settings(2, max_tokens=6)
    want = _run(_batch_loop((model, tok), settings), tok, _requests(MANY[:3]))
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=4),
                      ModelDrafter("self", draft, draft.allocate_cache(1, 8)))
    got = _run(loop, tok, _requests(MANY[:3]))
    _same(want, got)
    drafted = sum(c.num_draft_tokens for c in got.values())
    assert drafted > 0 and sum(c.num_accepted_draft_tokens for c in got.values()) == drafted
