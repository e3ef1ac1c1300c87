"""Several drafters on the device step (engine/device_mix.py): each slot with its own drafter and gamma, given or
chosen by the SPIN bandit; greedy output equal to BatchLoop's autoregressive output, no host read inside a
queued step, and bounded graph inventories."""

from __future__ import annotations

import random

import pytest

from spin_batch.drafters.ngram import NgramDrafter
from spin_batch.engine.device_mix import ReplayTimes
from spin_batch.engine.device_step import DeviceDrafting, DeviceLoop
from spin_batch.selection.bandit import BanditPolicy
from test_device_step import MANY, _batch_loop, _model_drafter, _queue_200_steps, _random_steps, _requests, _run, _same, \
    _settings
from test_device_step import target  # noqa: F401  (the module's fixture)


def _mix(target, tiny_dir, tiny_draft_dir, kinds=("ngram", "other", "exit1", "int8")) -> dict:
    out = {}
    for kind in kinds:
        out[kind] = NgramDrafter("ngram", 1, 3) if kind == "ngram" else \
            _model_drafter(kind, target, tiny_dir, tiny_draft_dir)
    return out


class RandomChoices:
    """A stand-in policy: each slot a random drafter of the mix (or none) and a random gamma, every step."""

    def __init__(self, names, seed):
        self.names, self.rng = list(names) + [None], random.Random(seed)

    def __call__(self, loop):
        live = [s for s in loop.slots if s is not None and not s.done]
        most = self.rng.choice([0, 3, 8])
        names = [self.rng.choice(self.names) for _ in live]
        return names, [self.rng.randint(0, most) for _ in live]


def _run_mixed(loop, tok, reqs, choose) -> dict:
    """DeviceLoop.run's schedule, with each step's drafters and gammas from `choose`."""
    done = []
    stream = iter(reqs)
    exhausted = False
    while True:
        while not exhausted and None in loop.slots:
            r = next(stream, None)
            if r is None:
                exhausted = True
                break
            loop.admit(r, tok.encode(r.prompt))
            done.extend(loop.finished)
            loop.finished = []
        live = [s for s in loop.slots if s is not None and not s.done]
        queued = False
        if live:
            names, gammas = choose(loop)
            queued = loop.queue(gammas, names) is not None
        if loop.queued and (len(loop.queued) > 1 or not queued):
            done.extend(loop.collect())
        if not queued and not loop.queued and exhausted:
            break
    assert len(done) == len(reqs) and all(c.status == "ok" for c in done)
    return {c.request.id: c for c in done}


@pytest.mark.parametrize("slots", [1, 4, 6, 16])
def test_random_drafters_per_slot_equal_autoregressive(target, tiny_dir, tiny_draft_dir, slots):
    """Every step, each slot a random drafter among n-gram, an own-cache draft, an early exit and the int8 copy (or
    none) at a random gamma: the same tokens as plain decoding, every drafter verified and some accepted."""
    model, tok = target
    settings = _settings(slots)
    want = _run(_batch_loop(target, settings), tok, _requests(MANY))
    mix = _mix(target, tiny_dir, tiny_draft_dir)
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=8), mix=mix)
    got = _run_mixed(loop, tok, _requests(MANY), RandomChoices(mix, slots))
    _same(want, got)
    pulls = {}
    for c in got.values():
        for k, v in c.drafter_pulls.items():
            pulls[k] = pulls.get(k, 0) + v
    assert set(pulls) == {"ngram", "other", "exit1", "int8", "none"}
    assert sum(c.num_accepted_draft_tokens for c in got.values()) > 0


def test_an_own_cache_draft_stays_right_when_its_slot_drafts_with_another(target, tiny_dir, tiny_draft_dir):
    """A draft with a cache of its own (the target's weights), taking turns with the n-gram lookup, which commits
    several tokens a step: the draft's cache still holds every committed token (a fresh prefill's K/V), and every
    token it drafts is accepted."""
    import torch

    from spin_batch.models.segments import Segments

    model, tok = target
    settings = _settings(4, max_model_len=2048, max_tokens=1900)
    mix = {"ngram": NgramDrafter("ngram", 1, 3), "self": _model_drafter("self", target, tiny_dir, tiny_draft_dir)}
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=8), mix=mix)
    assert loop.mix.chains[0].chain.catch_up == 9  # width + 1: a slot may commit up to 9 tokens by another drafter
    tally = {"ngram": [0, 0, 0], "self": [0, 0, 0]}  # per drafter: drafted, accepted, steps that kept 3 or more
    learn = loop.mix.learn

    def reading(step, rows):
        for i, _, rec in rows:
            if step.names[i] is not None:
                t = tally[step.names[i]]
                t[0], t[1], t[2] = t[0] + rec[4], t[1] + rec[0], t[2] + (rec[1] >= 3)
        learn(step, rows)

    loop.mix.learn = reading
    for r in _requests(["1 2 3 1 2 3 1 2", "the the the the the", MANY[0], MANY[1]], [1900] * 4):
        loop.admit(r, tok.encode(r.prompt))
    for t in range(60):
        loop.queue([8] * 4, ["self" if t % 3 == 2 else "ngram"] * 4)
        if len(loop.queued) > 1:
            assert not loop.collect()
    loop.collect()
    assert tally["ngram"][2] > 10 and tally["self"][0] > 100, tally  # the n-gram lookup committed runs of tokens
    assert tally["self"][1] == tally["self"][0], tally
    chain = loop.mix.chains[0].chain
    for s in range(4):  # the invariant, but for the last width + 1 positions, which the next catch-up feeds
        n = int(loop.lengths[s])
        fresh = chain.model.allocate_cache(1, n)
        chain.model.hidden(loop.history[s, : n - 1].clone(), Segments.build([(0, n - 1, 0)], model.device), fresh)
        assert torch.allclose(chain.cache.k[:, s, :, : n - 9], fresh.k[:, 0, :, : n - 9], atol=1e-4), s


@pytest.mark.parametrize("slots", [1, 4, 16])
def test_the_bandit_on_the_device_step_equals_autoregressive(target, tiny_dir, tiny_draft_dir, slots):
    """The SPIN bandit chooses each slot's drafter and gamma from the records, one step behind, and prices them by
    the measured replay times: whatever it picks, greedy output equals plain decoding."""
    model, tok = target
    settings = _settings(slots)
    want = _run(_batch_loop(target, settings), tok, _requests(MANY))
    mix = _mix(target, tiny_dir, tiny_draft_dir, ("ngram", "other", "int8"))
    policy = BanditPolicy(list(mix), 8)
    loop = DeviceLoop(model, tok, settings, DeviceDrafting(gamma=8), mix=mix, policy=policy)
    got = _run(loop, tok, _requests(MANY))
    _same(want, got)
    st = policy.state
    assert sum(st.pulls.values()) > 0 and all(st.cost.measured(d) for d in mix)  # it tried and priced each
    assert st.cost.verify_coeffs() != (0.0, 0.0)  # the step times reached the cost model
    table = loop.stats()["replay_ms"]
    assert any(k.startswith("verify ") for k in table) and any(k.startswith("other ") for k in table)
    assert sum(c.num_draft_tokens for c in got.values()) > 0


def test_a_mix_over_500_random_steps_keeps_its_inventories_small(target, tiny_dir, tiny_draft_dir):
    """1-16 live slots, random drafter and gamma per slot and step, drafts accepted at random: the step's graphs
    are asked for at most 15 buckets, each model chain's at most 10 sub-buckets."""
    model, tok = target
    mix = _mix(target, tiny_dir, tiny_draft_dir, ("ngram", "other", "exit1"))
    loop = DeviceLoop(model, tok, _settings(16, max_model_len=160), DeviceDrafting(gamma=8), mix=mix)
    choose = RandomChoices(mix, 2)
    done = _random_steps(loop, tok, lambda live, rng: loop.queue(*reversed(choose(loop))))
    assert done > 50 and loop.steps > 400
    stats = loop.stats()
    assert len(stats["asked"]) <= 15 and len({k.split("x")[0] for k in stats["asked"]}) >= 3
    for name in ("other", "exit1"):
        asked = stats["chains"][name]["asked"]
        assert 3 <= len(asked) <= 10, (name, asked)
        assert all(not k.endswith("x0") for k in asked)  # a chain runs only where a row drafts with it


@pytest.mark.parametrize("policy", [False, True])
def test_queuing_200_mixed_steps_reads_nothing_back(target, tiny_dir, tiny_draft_dir, policy):
    model, tok = target
    mix = _mix(target, tiny_dir, tiny_draft_dir, ("ngram", "other", "exit1"))
    loop = DeviceLoop(model, tok, _settings(4, max_model_len=2048, max_tokens=1900), DeviceDrafting(gamma=4),
                      mix=mix, policy=BanditPolicy(list(mix), 4) if policy else None)
    if not policy:  # each slot its own drafter, every step
        loop.queue = (lambda queue: lambda: queue([4, 4, 3, 2], ["ngram", "other", "exit1", None]))(loop.queue)
    inside, _ = _queue_200_steps(loop, tok)
    assert sum(inside.values()) == 0, inside
    assert loop.steps == 200 and int(loop.counters[:4, 1].sum()) > 0  # drafts were verified
    if policy:
        assert sum(loop.mix.policy.state.pulls.values()) > 0


def test_mix_inputs_are_checked(target, tiny_dir, tiny_draft_dir):
    from spin_batch.drafters.model import FeatureDrafter

    model, tok = target
    loop = DeviceLoop(model, tok, _settings(2), DeviceDrafting(gamma=4), mix={"ngram": NgramDrafter("ngram")})
    r = _requests(MANY[:1])[0]
    loop.admit(r, tok.encode(r.prompt))
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        loop.queue([4], ["nope"])
    with pytest.raises(ValueError, match="needs each slot's drafter"):
        loop.queue()
    eagle = FeatureDrafter.__new__(FeatureDrafter)
    eagle.name = "eagle"
    with pytest.raises(ValueError, match="reads the target's features"):
        DeviceLoop(model, tok, _settings(2), DeviceDrafting(gamma=4), mix={"eagle": eagle})


def test_replay_times_on_the_host_clock():
    import torch

    times = ReplayTimes(torch.device("cpu"))
    mark = times.end(times.begin())
    assert times.read(("verify", 4, 8), mark) >= 0.0
    times.read(("verify", 4, 8), 0.5)
    assert times.summary()["verify 4x8"][0] == 2
