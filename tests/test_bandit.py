"""The SPIN bandit on a synthetic world with known acceptance rates and costs."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from spin_batch.bench_policies import assigned_policy
from spin_batch.selection.arms import (CALIBRATION_PRIOR, PRIOR_STRENGTH, Beta, Calibration, PastGamma,
                                       RequestArms)
from spin_batch.selection.bandit import PROBE_PULLS, BanditPolicy
from spin_batch.selection.costs import CostModel, Pricing, RatioEma
from spin_batch.selection.factory import make_policy
from spin_batch.selection.joint import JointChoice, expected_gain
from spin_batch.selection.policy import Choice, Outcome, StepChoice, StepCosts

NO_STEP = StepChoice(())  # the record of a step learnt from without a choose() of its own


class World:
    """Slots whose drafters accept each token with a fixed probability; costs are linear."""

    def __init__(self, rates: dict[str, float], draft_cost: dict[str, float], c0: float, c1: float, seed: int = 0,
                 confident: float | None = None, spec_overhead: float = 0.0, tree: tuple[float, int] = (0.0, 0)):
        self.rates, self.draft_cost, self.c0, self.c1 = rates, draft_cost, c0, c1
        # a token tree (a choice with nodes): (acceptance it adds to the drafter's rate, extra rows it verifies)
        self.tree_gain, self.tree_rows = tree
        # seconds a step spends outside the modelled stages whenever a slot drafts (in "select")
        self.spec_overhead = spec_overhead
        self.rng = random.Random(seed)
        # None: every draft token is accepted with its drafter's rate. A share p: a draft position is
        # sure (its draft probability and acceptance 0.99) with chance p, else unsure (0.1), and a
        # gated choice (min_prob > 0) stops its chain where the running product falls below min_prob.
        self.confident = confident
        self.gained = self.seconds = 0.0

    def _chain(self, c) -> tuple[int, int]:
        """(proposed, accepted) for one slot's choice."""
        if self.confident is None:
            k = 0
            rate = self.rates[c.drafter] + (self.tree_gain if c.nodes else 0.0)
            while k < c.gamma and self.rng.random() < rate:
                k += 1
            return c.gamma, k
        proposed, accepted, conf, alive = 0, 0, 1.0, True
        for _ in range(c.gamma):
            u = 0.99 if self.rng.random() < self.confident else 0.1
            conf *= u
            if conf < c.min_prob:
                break
            proposed += 1
            alive = alive and self.rng.random() < u
            accepted += alive
        return proposed, accepted

    def step(self, policy: BanditPolicy, slots: list[int]) -> list:
        """One step; a drafter's time is f per forward (its deepest chain) plus s per position, where
        draft_cost[d] is s alone or the pair (f, s)."""
        step = policy.choose(slots, [8] * len(slots))
        choices = step.choices
        outcomes, tokens, draft_tokens, forwards = [], 0, {}, {}
        for s, c in zip(slots, choices):
            proposed = k = 0
            if c.drafter:
                proposed, k = self._chain(c)
                draft_tokens[c.drafter] = draft_tokens.get(c.drafter, 0) + c.gamma
                forwards[c.drafter] = max(forwards.get(c.drafter, 0), c.gamma)
            tokens += proposed + 1 + (self.tree_rows if c.nodes else 0)
            outcomes.append(Outcome(s, c, proposed, k))
            self.gained += k + 1
        draft_s = {}
        for d, n in draft_tokens.items():
            f, s = self.draft_cost[d] if isinstance(self.draft_cost[d], tuple) else (0.0, self.draft_cost[d])
            draft_s[d] = f * forwards[d] + s * n
        verify = self.c0 + self.c1 * tokens
        other = self.spec_overhead if draft_tokens else 0.0
        self.seconds += verify + sum(draft_s.values()) + other
        stages = {"select": other, "draft": sum(draft_s.values()), "verify": verify}
        policy.learn(step, outcomes, StepCosts(stages, tokens, draft_s, draft_tokens, forwards))
        return choices


def run_requests(policy, world, n_requests, steps_per_request, slots=1):
    picks = []
    for r in range(n_requests):
        for s in range(slots):
            policy.on_admit(s)
        for _ in range(steps_per_request):
            picks.extend(world.step(policy, list(range(slots))))
    return picks


def test_expected_gain():
    assert expected_gain(0, 0.9) == 1.0
    assert expected_gain(3, 0.0) == 1.0
    assert expected_gain(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


@pytest.mark.parametrize("mode", ["ucb", "thompson"])
def test_converges_to_the_best_drafter(mode):
    world = World({"good": 0.85, "poor": 0.2}, {"good": 0.002, "poor": 0.0005}, c0=0.04, c1=0.001)
    policy = BanditPolicy(["poor", "good"], max_gamma=6, mode=mode, seed=1)
    picks = run_requests(policy, world, n_requests=20, steps_per_request=15)
    late = picks[len(picks) // 2:]
    share_good = sum(c.drafter == "good" for c in late) / len(late)
    assert share_good > 0.9, share_good
    assert sum(c.gamma for c in late) / len(late) >= 4  # high acceptance: long drafts pay


def _late_share(c0: float, c1: float, speculating: bool, seeds=range(5)) -> float:
    """Share of the second half of picks (8 slots, a = 0.5) that do (or do not) speculate, over seeds: the cost
    model's choices alone (the back-off gate's refresh steps aside, see test_backoff_*)."""
    shares = []
    for seed in seeds:
        world = World({"d": 0.5}, {"d": 0.001}, c0=c0, c1=c1, seed=seed)
        policy = BanditPolicy(["d"], max_gamma=4, seed=seed, backoff=False)
        picks = run_requests(policy, world, n_requests=10, steps_per_request=20, slots=8)
        late = picks[len(picks) // 2:]
        shares.append(sum((c.gamma > 0) == speculating for c in late) / len(late))
    return sum(shares) / len(shares)


def test_backs_off_to_gamma_zero_when_verification_is_expensive():
    # each verified token costs as much as the whole step overhead: speculation cannot pay. The
    # rest is gamma exploration, one slot in 5% of steps, which keeps the cost model identifiable.
    assert _late_share(c0=0.01, c1=0.02, speculating=False) > 0.97


def test_speculates_when_verification_is_cheap():
    # drafting pays here by about 0.2 tokens a slot; a slot whose posterior mean has dipped, so that the
    # model calls it within DRAFT_MARGIN of plain decoding, decodes plainly (0.93 of picks without the margin)
    assert _late_share(c0=0.04, c1=0.0005, speculating=True) > 0.75


def test_a_draft_must_beat_plain_decoding_by_the_margin():
    from spin_batch.selection.joint import DRAFT_MARGIN, best_gamma, chain_spend, expected_gain

    spend = [chain_spend(g, None) for g in range(2)]
    gain = expected_gain(1, 0.5)  # 1.5 tokens for one draft, priced at what leaves 1 + DRAFT_MARGIN / 2
    price = gain - 1.0 - DRAFT_MARGIN / 2
    assert best_gamma(0.5, price, 0.0, spend) == (1.0, 0)
    assert best_gamma(0.5, price - DRAFT_MARGIN, 0.0, spend)[1] == 1


def _backoff_world(backoff: bool, overhead: float, seed: int) -> tuple[float, float]:
    """(share of the second half of steps that speculated, goodput) at 8 slots, a = 0.6, where verification is
    cheap enough that the cost model sees speculation pay, and each speculating step also spends `overhead`
    seconds the model does not price."""
    world = World({"d": 0.6}, {"d": 0.0005}, c0=0.04, c1=0.002, seed=seed, spec_overhead=overhead)
    policy = BanditPolicy(["d"], max_gamma=4, seed=seed, backoff=backoff)
    spec_steps = []
    for _ in range(10):
        for s in range(8):
            policy.on_admit(s)
        for _ in range(40):
            spec_steps.append(any(c.gamma for c in world.step(policy, list(range(8)))))
    late = spec_steps[len(spec_steps) // 2:]
    return sum(late) / len(late), world.gained / world.seconds


def test_backoff_turns_speculation_off_where_its_steps_measure_slower():
    # unpriced overhead of 0.06 s a speculating step: plain steps (8 tokens in 0.056 s) beat speculating
    # ones (~17 tokens in ~0.08 + 0.06 s), though the model, blind to the overhead, prices speculation ahead
    for seed in range(3):
        blind, blind_goodput = _backoff_world(False, 0.06, seed)
        gated, gated_goodput = _backoff_world(True, 0.06, seed)
        assert blind > 0.9, blind  # the cost model alone keeps speculating
        # the gate runs plain steps, bar its refresh bursts (3 steps in 19) and the warm-up, which the slots'
        # joining (CostModel.joining: 2, 4, 8 slots on a drafter) stretches by a step or two
        assert gated < 0.25, gated
        assert gated_goodput > 1.15 * blind_goodput, (gated_goodput, blind_goodput)


def _gate_steps(gate, n: int, goodput, switch_cost: float = 10.0, slots: int = 4) -> list[bool]:
    """Run n steps through a StepGate; goodput(step, mode) gives tokens per second, and a step that
    switches mode takes switch_cost times as long (the drafters' catch-up)."""
    modes = []
    for _ in range(n):
        mode = gate.decide(slots)
        step = len(modes)
        modes.append(mode)
        seconds = 1.0 if gate.steady else switch_cost
        gate.observe(slots, mode, goodput(step, mode) * 1.0, seconds)
    return modes


def test_step_gate_pairs_a_burst_with_the_steps_before_it():
    from spin_batch.selection.gate import GATE_BURST, GATE_WARMUP, StepGate

    gate = StepGate()
    modes = _gate_steps(gate, GATE_WARMUP + 1 + GATE_BURST, lambda step, mode: 20 if mode else 10)
    # warm-up (the first step has nothing before it, so is not scored), then a plain burst whose
    # first step pays the switch and is not scored either
    assert modes == [True] * (GATE_WARMUP + 1) + [False] * GATE_BURST
    assert gate.warm[3] == GATE_WARMUP and 3 not in gate.log_ratio
    assert gate.decide(4)  # the burst closes: one pair, speculation 2x ahead
    assert gate.log_ratio[3].n == 1 and gate.log_ratio[3].mean == pytest.approx(math.log(2.0))
    assert gate.band(6) == gate.band(4) != gate.band(8)


@pytest.mark.parametrize("larger_ahead", [True, False])
def test_a_band_whose_steps_fall_between_a_larger_bands_takes_its_lead(larger_ahead):
    """Between admissions a 4-slot job runs a few steps at 2-3 decoding slots, each between steps at 4: a
    plain step there never continues a run of its mode, so a burst is never scored nor paired. With no pair
    of its own, such a band spaces its bursts by the lead of the nearest larger band where speculation
    measured ahead (it pays more at fewer slots); where that band measured plain decoding ahead, it bursts."""
    from spin_batch.selection.gate import GATE_WARMUP, StepGate

    def goodput(mode):
        return (20 if mode else 10) if larger_ahead else (10 if mode else 20)

    gate = StepGate()
    _gate_steps(gate, 200, lambda step, mode: goodput(mode))
    assert gate.log_ratio[3].n >= 2 and 2 not in gate.log_ratio
    plain_at_2 = 0
    for _ in range(GATE_WARMUP + 40):
        mode = gate.decide(2)
        plain_at_2 += not mode
        gate.observe(2, mode, goodput(mode), 1.0)
        mode = gate.decide(4)
        gate.observe(4, mode, goodput(mode), 1.0)
    if larger_ahead:
        assert 2 not in gate.log_ratio and plain_at_2 == 0  # never paired, and no burst yet
    else:
        assert plain_at_2 > 0  # nothing to take a lead from: the band measures plain decoding itself


@pytest.mark.parametrize("spec_ahead", [1.15, 1 / 1.15])
def test_step_gate_follows_the_faster_mode_through_drift(spec_ahead):
    """The machine's speed swings by +-30% over 100 steps, twice the gap between the modes: speculating
    steps measure spec_ahead times the goodput of plain ones at the same moment. The gate must still pick
    the faster mode most of the time; with plain ahead, 3 steps in 19 are the bursts that re-check it."""
    from spin_batch.selection.gate import StepGate

    def goodput(step: int, mode: bool) -> float:
        speed = 1.0 + 0.3 * math.sin(2 * math.pi * step / 100)
        return speed * (100.0 * spec_ahead if mode else 100.0)

    modes = _gate_steps(StepGate(), 800, goodput)
    late = modes[200:]
    right = sum(m == (spec_ahead > 1) for m in late) / len(late)
    assert right > 0.8, right


def test_decayed_mean_and_its_error():
    from spin_batch.selection.gate import DecayedMean

    m = DecayedMean(0.8)
    m.add(1.0)
    assert m.mean == 1.0 and m.stderr == math.inf
    for _ in range(50):
        m.add(1.0)
    assert m.mean == pytest.approx(1.0) and m.stderr == pytest.approx(0.0, abs=1e-6)
    m.add(-1.0)  # the newest sample weighs most
    assert m.mean < 0.7 and m.stderr > 0.1


def test_backoff_is_for_the_bandits_only():
    # fixed, assigned and round_robin run what they are told; backoff: false (spin-nobackoff) turns it off
    assert BanditPolicy(["d"], max_gamma=4, mode="ucb").state.gate is not None
    assert BanditPolicy(["d"], max_gamma=4, mode="thompson").state.gate is not None
    assert BanditPolicy(["d"], max_gamma=4, mode="ucb", backoff=False).state.gate is None
    told = [make_policy("fixed:d", ["d"], 4), make_policy("round_robin", ["d"], 4), assigned_policy(["d"], 4, {})]
    for policy in told:
        assert not isinstance(policy, BanditPolicy)
        assert all(step.gate is None for step in (policy.choose([0], [4]), policy.choose([0, 1], [4, 4]))), policy
    assert make_policy("ucb", ["d"], 4, backoff=False).state.gate is None


def test_backoff_keeps_speculation_that_pays():
    for seed in range(3):
        gated, gated_goodput = _backoff_world(True, 0.0, seed)
        blind, blind_goodput = _backoff_world(False, 0.0, seed)
        assert gated > 0.85, gated
        assert gated_goodput > 0.95 * blind_goodput, (gated_goodput, blind_goodput)


def _tree_share(c1: float, seed: int, slots: int = 4) -> float:
    """Share of the second half of drafting choices that grow trees, where a tree adds 0.15 to the
    acceptance rate (0.5) and verifies 6 more rows at c1 seconds each."""
    world = World({"d": 0.5}, {"d": 0.0005}, c0=0.03, c1=c1, seed=seed, tree=(0.15, 6))
    policy = BanditPolicy(["d"], max_gamma=4, seed=seed, gated=frozenset({"d"}), trees={"d": 8})
    picks = [c for c in run_requests(policy, world, n_requests=20, steps_per_request=30, slots=slots) if c.drafter]
    late = picks[len(picks) // 2:]
    return sum(c.nodes > 0 for c in late) / len(late)


@pytest.mark.parametrize("seed", range(3))
def test_trees_run_where_their_steps_measure_ahead_and_not_elsewhere(seed):
    """The tree gate: trees where their rows are cheap (a tree adds 6 rows at 0.1 ms, +0.6 ms on a ~35 ms
    step, for about +0.15 accepted tokens a slot), chains where they are dear (6 rows at 1 ms), bar the
    refresh bursts. It judges by measured goodput, the tree's rows included (CostModel.decode_seconds)."""
    assert _tree_share(c1=0.0001, seed=seed) > 0.6
    assert _tree_share(c1=0.001, seed=seed) < 0.2


@pytest.mark.parametrize("seed", range(3))
def test_at_one_slot_trees_come_first_and_go_where_they_measure_behind(seed):
    """At one decoding slot trees are the gate's favoured mode (TREES_FIRST_SLOTS): they run unless chains
    measure ahead, as where a tree's 6 rows cost 60 ms on a ~40 ms step."""
    assert _tree_share(c1=0.0001, seed=seed, slots=1) > 0.8
    assert _tree_share(c1=0.01, seed=seed, slots=1) < 0.3


def test_warm_start_reduces_exploration():
    world = World({"good": 0.9, "poor": 0.05}, {"good": 0.001, "poor": 0.001}, c0=0.04, c1=0.001, seed=3)
    policy = BanditPolicy(["poor", "good"], max_gamma=4, seed=0)
    run_requests(policy, world, n_requests=30, steps_per_request=10)

    def poor_pulls(prior: dict[str, Beta]) -> int:
        policy.state.requests[0] = RequestArms({d: Beta(b.alpha, b.beta) for d, b in prior.items()})
        return sum(world.step(policy, [0])[0].drafter == "poor" for _ in range(10))

    cold = {d: Beta(0.3 * PRIOR_STRENGTH, 0.7 * PRIOR_STRENGTH) for d in ("poor", "good")}
    warm_total = cold_total = 0
    for _ in range(10):
        policy.on_admit(0)
        warm_total += poor_pulls(policy.state.requests[0].arms)
        cold_total += poor_pulls(cold)
    assert warm_total < cold_total


def test_cost_model_fits_linear_verify_cost():
    cm = CostModel(decay=0.99)
    for n in [1, 5, 9, 3, 17, 2, 8] * 10:
        cm.observe_verify(n, 0.03 + 0.004 * n)
    c0, c1 = cm.verify_coeffs()
    assert c0 == pytest.approx(0.03, rel=1e-3) and c1 == pytest.approx(0.004, rel=1e-3)


def test_verify_cost_is_fitted_on_decode_steps():
    """A prefill chunk is cheaper per token than the tail of a decode step; with its leverage it
    would halve c1 and make speculation look cheap at large batch."""
    cm = CostModel(decay=0.99)
    cm.observe_verify(300, 0.03 + 0.001 * 300, prefill_tokens=284)
    assert cm.verify_coeffs()[1] > 0  # no decode step yet: the prefill step counts
    for n in [16, 20, 18, 24, 17, 30, 16, 22] * 5:
        cm.observe_verify(n, 0.03 + 0.002 * n)
        cm.observe_verify(n + 400, 0.03 + 0.002 * n + 0.001 * 400, prefill_tokens=400)
    c0, c1 = cm.verify_coeffs()
    assert c0 == pytest.approx(0.03, rel=1e-3) and c1 == pytest.approx(0.002, rel=1e-3)


def test_make_policy_selectors():
    assert type(make_policy("ucb", ["a"], 4)).__name__ == "BanditPolicy"
    assert type(make_policy("ucb", [], 4)).__name__ == "NoSpeculation"
    rr = make_policy("round_robin", ["a", "b"], 3)
    got = {c.drafter for _ in range(4) for c in rr.choose([0], [5]).choices}
    assert got == {"a", "b"}


def test_confidence_gate_makes_drafting_pay_where_whole_chains_do_not():
    """Half the draft positions are sure (0.99), half unsure (0.1): a = 0.55 per token. Each verified
    token costs about half a token of goodput, so whole chains barely pay (gamma 1 at best). Gated, the
    bandit drafts the sure runs only, at a floor equal to that cost, and gains clearly more."""
    def goodput(gated: bool, seed: int) -> tuple[float, list]:
        world = World({"d": 0.55}, {"d": 0.0002}, c0=0.04, c1=0.005, seed=seed, confident=0.5)
        policy = BanditPolicy(["d"], max_gamma=6, seed=seed, gated=frozenset({"d"}) if gated else frozenset())
        picks = run_requests(policy, world, n_requests=10, steps_per_request=20, slots=8)
        return world.gained / world.seconds, picks

    ratios = []
    for seed in range(3):
        ungated, picks_u = goodput(False, seed)
        gated, picks_g = goodput(True, seed)
        ratios.append(gated / ungated)
        late = picks_g[len(picks_g) // 2:]
        floors = [c.min_prob for c in late if c.drafter]
        assert floors and 0.3 < sorted(floors)[len(floors) // 2] < 0.8, floors[:5]  # about lam * c1
        assert all(c.min_prob == 0 for c in picks_u)
    assert min(ratios) > 1.15, ratios


def test_only_gated_drafters_get_a_floor():
    world = World({"g": 0.6, "u": 0.6}, {"g": 0.001, "u": 0.001}, c0=0.04, c1=0.002)
    policy = BanditPolicy(["g", "u"], max_gamma=4, seed=0, gated=frozenset({"g"}))
    picks = run_requests(policy, world, n_requests=10, steps_per_request=10, slots=4)
    assert any(c.drafter == "g" and c.gamma for c in picks) and any(c.drafter == "u" and c.gamma for c in picks)
    # all but the first, unmeasured try, the probes after it, and the rare ungated gamma exploration (the cost
    # model needs varied N)
    g_picks = [c for c in picks if c.drafter == "g" and c.gamma][PROBE_PULLS:]
    assert sum(c.min_prob > 0 for c in g_picks) >= 0.9 * len(g_picks)
    assert all(c.min_prob == 0 for c in picks if c.drafter != "g")


def test_assigned_mode_runs_each_request_on_its_own_drafter():
    policy = assigned_policy(["ngram", "d1"], 4, {"a": "d1", "b": None})
    for slot, rid in enumerate(["a", "b", "c"]):
        policy.on_admit(slot, rid)
    got = policy.choose([0, 1, 2], [4, 4, 2]).choices
    assert [(c.drafter, c.gamma) for c in got] == [("d1", 4), (None, 0), (None, 0)]
    policy.on_admit(0, "b")  # the slot's next request has its own assignment
    assert policy.choose([0], [4]).choices[0].drafter is None
    with pytest.raises(ValueError, match="not in the pool"):
        assigned_policy(["ngram"], 4, {"a": "d9"})


@pytest.mark.parametrize("gamma,goes_on", [(1, 0.5), (4, 0.0), (4, 0.3), (5, 0.8), (3, 1.0)])
def test_chain_spend_matches_simulated_gated_chains(gamma, goes_on):
    from spin_batch.selection.joint import chain_spend

    rng = random.Random(0)
    n, proposed, ran = 20000, 0, 0
    for _ in range(n):
        k = 0
        while k < gamma and rng.random() < goes_on:
            k += 1
        proposed += k
        ran += min(k + 1, gamma)  # the position the gate stopped at was drafted too
    want_p, want_r = chain_spend(gamma, goes_on)
    assert proposed / n == pytest.approx(want_p, abs=0.05) and ran / n == pytest.approx(want_r, abs=0.05)
    assert chain_spend(gamma, None) == (gamma, gamma)


def test_the_position_a_gate_stopped_at_is_priced():
    from spin_batch.selection.joint import best_gamma, chain_spend

    # a = 0.3, goes_on = 0.3, gamma 1: E = 1.3 tokens for 0.3 proposed but 1 position drafted.
    # Charging the draft only for proposed tokens (1.3 - 0.4 * 0.3 = 1.18) would speculate; charging
    # the position run too (1.3 - 0.1 * 0.3 - 0.3 * 1) is worth less than plain decoding.
    assert best_gamma(0.3, 0.1, 0.3, [chain_spend(g, 0.3) for g in range(2)]) == (1.0, 0)
    # ungated, the same prices charge g tokens and g positions
    value, g = best_gamma(0.6, 0.1, 0.05, [chain_spend(g, None) for g in range(2)])
    assert g == 1 and value == pytest.approx(1.6 - 0.15)
    # a forward is charged only beyond the depth the drafter's other slots run anyway
    spend = [chain_spend(g, None) for g in range(5)]
    assert best_gamma(0.6, 0.1, 0.05, spend, forward_price=0.5, depth=4.0) == best_gamma(0.6, 0.1, 0.05, spend)
    assert best_gamma(0.6, 0.1, 0.05, spend, forward_price=0.5)[1] < best_gamma(0.6, 0.1, 0.05, spend)[1]


def test_draft_cost_separates_forwards_from_positions():
    from spin_batch.selection.costs import DraftCost

    dc = DraftCost(decay=0.99)
    for forwards, positions in [(4, 16), (2, 3), (4, 5), (1, 4), (3, 9), (2, 2)] * 10:
        dc.observe(forwards, positions, 0.002 * forwards + 0.0003 * positions)
    f, s = dc.coeffs()
    assert f == pytest.approx(0.002, rel=1e-3) and s == pytest.approx(0.0003, rel=1e-3)
    # one slot: forwards == positions, the split is unknowable; all of it goes on forwards, so that
    # sharing is tried (and measured) rather than priced as if every slot drafted alone
    lone = DraftCost(decay=0.99)
    for n in [1, 3, 4, 2] * 5:
        lone.observe(n, n, 0.0023 * n)
    assert lone.coeffs() == pytest.approx((0.0023, 0.0))


def test_slots_share_a_drafter_whose_cost_is_its_forwards():
    """Two drafters, equally good, each costing mostly per forward (one forward advances all of its
    slots). Splitting the batch between them pays both drafters' forwards; the joint choice puts the
    drafting slots on one drafter in nearly every step. (Slot by slot, best responses alone leave a
    split in place: a slot moving alone to the other drafter's forwards saves nothing.)"""
    mixed = steps = 0
    for seed in range(3):
        world = World({"x": 0.75, "y": 0.75}, {"x": (0.004, 0.0001), "y": (0.004, 0.0001)}, c0=0.03, c1=0.0005,
                      seed=seed)
        policy = BanditPolicy(["x", "y"], max_gamma=4, seed=seed)
        for _ in range(8):
            for s in range(8):
                policy.on_admit(s)
            for _ in range(20):
                used = {c.drafter for c in world.step(policy, list(range(8))) if c.drafter}
                mixed += len(used) > 1
                steps += 1
        assert world.gained / world.seconds > 300  # tokens per second; 1 / (c0 + 8 c1) = 295 without drafting
    assert mixed / steps < 0.05, mixed / steps


def test_a_drafter_first_tried_alone_is_then_shared():
    """The first try of a drafter is one slot (forwards == positions). Pricing that as a per-position
    cost would make every slot look as if it drafted alone; at this cost no lone slot pays, so the
    drafter would never be tried again. Priced per forward, the batch shares it and drafts."""
    world = World({"d": 0.8}, {"d": (0.004, 0.0001)}, c0=0.03, c1=0.0005, seed=0)
    policy = BanditPolicy(["d"], max_gamma=4, seed=0)
    picks = run_requests(policy, world, n_requests=4, steps_per_request=20, slots=8)
    late = picks[len(picks) // 2:]
    assert sum(c.gamma > 0 for c in late) / len(late) > 0.9


def test_an_optimistic_favourite_that_does_not_pay_yields_to_the_best_at_the_mean():
    """UCB favours the drafter it knows least ("new"), but at its posterior mean drafting with it does
    not pay. The slot then drafts with the drafter that pays at the mean rather than not at all."""
    from spin_batch.selection.joint import JointChoice

    joint = JointChoice(caps=[4], rates=[{"new": 0.95, "known": 0.62}], means=[{"new": 0.1, "known": 0.6}],
                        coeffs={"new": (0.0, 0.0), "known": (0.0, 0.0)}, goes_on={"new": None, "known": None},
                        verify_price=0.3, lam=100.0)
    drafter, gamma = joint.solve()[0]
    assert drafter == "known" and gamma > 0


def test_closing_a_drafter_is_judged_at_the_means():
    """A trace at 1 slot (the demo job): the int8 copy (sure, costly) is the favourite at the optimistic rates and
    gets gamma 5 at its mean; a distilled draft (gated, cheap) is worth less at its rate and far less at its mean.
    Closing the copy must not win by valuing the copy at a gamma chosen for its mean against the draft at its
    rate: the step drafts with the copy."""
    from spin_batch.selection.joint import JointChoice

    joint = JointChoice(caps=[6], rates=[{"copy": 0.999, "draft": 0.781}], means=[{"copy": 0.885, "draft": 0.5}],
                        coeffs={"copy": (0.00612, 0.0), "draft": (0.00131, 0.0)}, goes_on={"copy": None, "draft": 0.5},
                        verify_price=0.0567, lam=76.34)
    assert joint.solve() == [("copy", 5)]


def test_the_drain_values_a_step_by_its_slowest_slot():
    """Once nothing is left to admit, the job ends with its last request, so a step that drafts for the
    good slot only (the steady-state choice) shortens nothing: the drain drafts for both or for neither."""
    from spin_batch.selection.joint import JointChoice

    def joint(means):
        return JointChoice(caps=[4] * len(means), rates=[{"d": m} for m in means], means=[{"d": m} for m in means],
                           coeffs={"d": (0.0, 0.0)}, goes_on={"d": None}, verify_price=0.3, lam=100.0)

    mixed = joint([0.9, 0.05])
    picks = mixed.solve()
    assert picks[0][1] > 0 and picks[1] == (None, 0)  # steady state: the good slot drafts alone
    assert mixed.drain_value(picks) < mixed.n  # ... which in the drain is worth less than plain decoding
    assert mixed.drain_bound() <= mixed.n  # and the bound says so before solving
    both = joint([0.9, 0.85])
    picks = both.solve()
    assert all(g > 0 for _, g in picks)
    assert both.drain_value(picks) > both.n < both.drain_bound()
    for j in (mixed, both):  # the bound holds for any choice that drafts for every slot (else V <= n)
        for p in ([("d", 1), ("d", 1)], [("d", 4), ("d", 2)], [("d", 4), ("d", 4)]):
            assert j.drain_value(p) <= j.drain_bound() + 1e-9
        assert j.drain_value([("d", 4), (None, 0)]) < j.n


def test_the_drain_puts_every_slot_on_one_drafter_where_that_beats_the_steady_state_choice():
    """solve() maximises the sum of the slots' gains at their optimistic rates: a slot may take a cheap draft
    it knows little of ("cheap", a large ucb bonus) while the others share a costly, accurate one ("copy").
    In the drain that slot sets the step's worth, so the drain also rates every slot on one drafter, at the
    means, and drafts with that where it is worth more."""
    from spin_batch.selection.joint import JointChoice

    means = [{"copy": 0.9, "cheap": 0.4}, {"copy": 0.9, "cheap": 0.4}, {"copy": 0.8, "cheap": 0.4}]
    rates = [{"copy": 0.92, "cheap": 0.8}, {"copy": 0.92, "cheap": 0.8}, {"copy": 0.82, "cheap": 0.8}]
    joint = JointChoice(caps=[6, 6, 6], rates=rates, means=means, coeffs={"copy": (0.001, 0.0002), "cheap": (0.0, 0.0)},
                        goes_on={"copy": None, "cheap": None}, verify_price=0.1, lam=220.0)
    picks = joint.solve()
    assert [d for d, _ in picks] == ["copy", "copy", "cheap"]
    assert joint.drain_value(picks) <= joint.n  # alone, the drain would not draft at all
    drained = joint.drain_picks(picks)
    assert all(d == "copy" and g > 0 for d, g in drained) and joint.drain_value(drained) > joint.n


def test_the_drain_stops_drafting_unless_every_slot_pays():
    world = World({"d": 0.85}, {"d": 0.0005}, c0=0.03, c1=0.001, seed=0)
    policy = BanditPolicy(["d"], max_gamma=4, seed=0, backoff=False)
    run_requests(policy, world, n_requests=4, steps_per_request=20, slots=2)
    policy.state.requests[1].arms["d"] = Beta(0.5, 20.0)  # slot 1's request turned out hard to draft for
    policy.settings = replace(policy.settings, gamma_exploration=0.0)
    assert policy.choose([0, 1], [8, 8]).choices[0].gamma > 0  # steady state: slot 0 still drafts
    policy.on_drain()
    assert all(c.gamma == 0 for c in policy.choose([0, 1], [8, 8]).choices)
    assert policy.choose([0], [8]).choices[0].gamma > 0  # the last request alone: its drafts shorten the job


def test_exploration_is_charged_to_the_pooled_evidence():
    """A drafter the pool knows well keeps a small bonus in a fresh request; one it barely knows, a large one.
    (Before, the bonus came from the request's own observations alone, so every new request re-explored
    every drafter from a bonus of the same size.)"""
    policy = BanditPolicy(["known", "new"], max_gamma=4)
    policy.state.pooled["known"] = Beta(1.0 + 600, 1.0 + 400)  # 0.6 over a thousand observations
    policy.state.pooled["new"] = Beta(1.0 + 3, 1.0 + 2)  # 0.6 over five
    policy.on_admit(0)
    arms = policy.state.requests[0].arms
    evidence = 1005.0
    known = policy._rate(arms["known"], policy.state.pooled["known"], evidence) - arms["known"].mean
    new = policy._rate(arms["new"], policy.state.pooled["new"], evidence) - arms["new"].mean
    assert 0 < known < 0.05 < 0.3 < new, (known, new)


def test_a_requests_prior_follows_the_pool_until_it_drafts_with_the_drafter():
    """A request admitted before the pool knew a drafter is not stuck with the cold prior: until the request
    drafts with it, its arm is the current pooled posterior shrunk to PRIOR_STRENGTH; from then on its own
    observations sit on the prior it had then."""
    policy = BanditPolicy(["d"], max_gamma=4, seed=0, backoff=False)
    policy.on_admit(0)
    assert policy.state.requests[0].arms["d"].mean == pytest.approx(0.3)  # nothing pooled yet: the cold prior
    policy.state.pooled["d"] = Beta(1.0 + 95, 1.0 + 5)  # other requests have since found d right 95% of the time
    policy.choose([0], [4])
    arm = policy.state.requests[0].arms["d"]
    assert arm.n == pytest.approx(PRIOR_STRENGTH) and arm.mean == pytest.approx(96 / 102)
    policy.learn(NO_STEP, [Outcome(0, Choice("d", 4), 4, 1)], StepCosts({"verify": 0.01}, 5, {"d": 0.001}, {"d": 4}))
    policy.state.pooled["d"] = Beta(1.0 + 900, 1.0 + 100)
    policy.choose([0], [4])
    arm = policy.state.requests[0].arms["d"]
    assert arm.alpha == pytest.approx(96 / 102 * PRIOR_STRENGTH + 1)  # its own 1 of 4 on the prior it had
    assert arm.beta == pytest.approx(6 / 102 * PRIOR_STRENGTH + 1)


def test_tokens_accepted_past_gamma_count_as_the_whole_chain_asked_for():
    """A chain that ran past gamma on confirmed guesses (DraftRequest.room) and was accepted past it rates the
    drafter as a chain of gamma accepted in full: the rate is of what was asked, and the bonus tokens go to
    goodput alone."""
    policy = BanditPolicy(["d"], max_gamma=4, seed=0, backoff=False)
    policy.on_admit(0)
    policy.choose([0], [4])
    before = policy.state.pooled["d"].alpha, policy.state.pooled["d"].beta
    policy.learn(NO_STEP, [Outcome(0, Choice("d", 4), 7, 6)], StepCosts({"verify": 0.01}, 8, {"d": 0.001}, {"d": 4}))
    assert (policy.state.pooled["d"].alpha, policy.state.pooled["d"].beta) == (before[0] + 4, before[1])
    assert policy.state.requests[0].own["d"].alpha == 4 and policy.state.requests[0].own["d"].beta == 0
    assert policy.state.cost.goodput.value == pytest.approx(7 / 0.01)  # 6 accepted and the bonus, in the step's time


def test_tokens_past_gamma_are_valued_as_measured():
    """A drafter whose chains run past gamma on confirmed guesses is worth those tokens too: the joint choice
    adds a^g times the tokens accepted past gamma in a whole chain, less the rows proposed past it. Near a tie
    (the int8 copy at 0.93 against a cheap draft at 0.62, 1 slot) they decide it."""
    past = PastGamma()
    for gamma, drafted, accepted in [(6, 9, 8), (6, 8, 6), (6, 6, 2), (6, 7, 7)]:
        past.observe(gamma, drafted, accepted)
    assert past.value == (pytest.approx(3 / 3), pytest.approx(6 / 4))  # 2 + 0 + 1 past gamma in 3 whole chains

    def choose(past):
        return JointChoice(caps=[6], rates=[{"copy": 0.93, "small": 0.62}], means=[{"copy": 0.93, "small": 0.62}],
                           coeffs={"copy": (0.0047, 0.0), "small": (0.0003, 0.0)},
                           goes_on={"copy": None, "small": None},
                           verify_price=0.06, lam=120.0, past=past).solve()[0][0]

    assert choose(None) == "small"
    assert choose({"copy": (0.55, 0.6)}) == "copy"
    assert choose({"copy": (0.55, 6.0)}) == "small"  # rows past gamma that cost more than they bring


def test_calibration_scales_what_the_joint_choice_predicts_by_what_its_picks_made():
    """Calibration: per drafter and batch size, the draft tokens the joint choice's picks made against those
    their means predicted; the factor scales the predicted draft tokens (joint.chain_gain), so a drafter whose
    picks fall short drafts less. Probes and first trials are not the joint choice's and do not count."""
    c = Calibration()
    assert c.factor == 1.0
    c.add(0.0, 4.0)
    assert c.factor == pytest.approx(CALIBRATION_PRIOR / (CALIBRATION_PRIOR + 4.0))  # one step moves it little
    for _ in range(2000):
        c.add(1.0, 2.0)
    assert c.factor == pytest.approx(0.5, abs=0.02)

    world = World({"d": 0.8}, {"d": 0.001}, c0=0.02, c1=0.0005)
    policy = BanditPolicy(["d"], max_gamma=6, seed=0, backoff=False)
    run_requests(policy, world, n_requests=1, steps_per_request=PROBE_PULLS)  # the first trial, then probes
    assert policy.state.calibration == {}
    run_requests(policy, world, n_requests=4, steps_per_request=30)
    predicted = policy.state.calibration[("d", 1)]
    assert 0.8 < predicted.factor < 1.2  # a world whose acceptance is what the model says: predictions hold
    step = policy.choose([0], [6])
    chosen, predicted = step.choices[0], step.predicted[0]
    assert chosen.drafter == "d" and (predicted.slot, predicted.drafter, predicted.slots) == (0, "d", 1)
    arm = policy.state.requests[0].arms["d"]
    assert predicted.tokens == pytest.approx(expected_gain(chosen.gamma, arm.mean) - 1.0)
    policy.state.calibration[("d", 1)] = Calibration(realized=0.0, predicted=1000.0)  # its picks made nothing
    assert policy.choose([0], [6]).choices[0].gamma == 0
    policy.state.calibration[("d", 4)] = Calibration(realized=0.0, predicted=1000.0)  # another batch size's does not
    del policy.state.calibration[("d", 1)]
    assert policy.choose([0], [6]).choices[0].drafter == "d"


def test_a_second_is_priced_at_least_at_plain_decodings_goodput():
    """Plain decoding is always a choice, so the goodput that prices a second is at least its rate,
    n / (c0 + c1 n): a batch whose costly drafts held its goodput below that would price them too cheap."""
    pricing = Pricing([])
    for n in (16, 32, 48, 64, 16, 32):
        pricing.cost.observe_verify(n, 0.02 + 0.001 * n)
    pricing.cost.goodput_at[16] = RatioEma(0.9)
    pricing.cost.goodput_at[16].add(300.0, 1.0)  # 300 tokens/s at 16 slots, below plain's 16 / 0.036
    pricing.cost.goodput.add(300.0, 1.0)
    verify_price, lam = pricing.prices(16)
    assert lam == pytest.approx(16 / 0.036) and verify_price == pytest.approx(lam * 0.001)
    pricing.cost.goodput_at[1] = RatioEma(0.9)
    pricing.cost.goodput_at[1].add(120.0, 1.0)  # 1 slot: drafting made more than plain's 1 / 0.021
    assert pricing.prices(1)[1] == pytest.approx(120.0)


def test_a_measured_drafter_is_probed_at_the_cap_for_a_few_steps():
    """After its short first trial, a drafter is drafted by one slot a step at that slot's cap until PROBE_PULLS
    steps have drafted with it: the joint choice prices gamma at the posterior mean, so a costly drafter whose
    first short trial went badly would otherwise never be tried again."""
    from spin_batch.selection.bandit import PROBE_PULLS

    policy = BanditPolicy(["cheap", "costly"], max_gamma=6, seed=0, backoff=False, gamma_exploration=0.0)
    for n in range(1, 9):  # verify: 20 ms + 0.5 ms a row
        policy.state.cost.observe_verify(n, 0.02 + 0.0005 * n)
    for d, s in (("cheap", 0.0002), ("costly", 0.002)):
        policy.state.cost.observe_draft(d, 2, 2 * s)
    policy.state.cost.goodput.add(200.0, 1.0)
    policy.state.pooled["cheap"] = Beta(1.0 + 300, 1.0 + 300)
    policy.state.pulls["cheap"] = 300  # well known
    policy.state.pooled["costly"] = Beta(1.0 + 1, 1.0 + 1)  # its first trial: 1 of 2
    policy.state.pulls["costly"] = 1
    for s in (0, 1):
        policy.on_admit(s)
    probes = 0
    while policy.state.pulls["costly"] < PROBE_PULLS:
        step = policy.choose([0, 1], [6, 3])
        picks = step.choices
        assert picks[0] == Choice("costly", 6)  # slot 1 is the joint choice's
        policy.learn(step, [Outcome(0, picks[0], 6, 6)],
                     StepCosts({"verify": 0.0235}, 7, {"costly": 0.012}, {"costly": 6}))
        probes += 1
    assert probes == PROBE_PULLS - 1
    assert policy.state.pooled["costly"].mean > 0.85
    # now it pays (a new request's rate sits on POOL_PRIOR pseudo-tokens at the cold rate, so not yet at the cap)
    assert all(c.drafter == "costly" and c.gamma >= 4 for c in policy.choose([0, 1], [6, 6]).choices)


def test_goodput_is_kept_per_batch_size():
    """A second is priced at the goodput of the batch size the step runs at (the job's tail leaves few slots)."""
    cm = CostModel()
    one, four = Outcome(0, Choice(None, 0), 0, 0), [Outcome(s, Choice(None, 0), 0, 0) for s in range(4)]
    for _ in range(20):
        cm.learn(four, StepCosts({"verify": 0.02}, 4, {}, {}))  # 200 tokens/s at 4 slots
        cm.learn([one], StepCosts({"verify": 0.02}, 1, {}, {}))  # 50 at 1
    assert cm.lam(4) == pytest.approx(200.0) and cm.lam(1) == pytest.approx(50.0)
    assert 50.0 < cm.lam(2) < 200.0  # not measured at 2 slots: the goodput over all steps


def test_goodput_is_tokens_over_seconds_not_a_mean_of_step_ratios():
    """Short steps gain more per second; averaging their ratios would overstate the goodput (and so the price
    of every second a costly draft takes)."""
    cm = CostModel()
    for _ in range(40):
        cm.learn([Outcome(0, Choice("d", 4), 4, 4)], StepCosts({"verify": 0.01}, 5, {}, {}))  # 5 tokens in 10 ms
        cm.learn([Outcome(0, Choice("d", 4), 4, 0)], StepCosts({"verify": 0.09}, 5, {}, {}))  # 1 token in 90 ms
    assert cm.lam(1) == pytest.approx(6 / 0.1, rel=0.1)  # not (500 + 11) / 2


def test_no_probe_where_even_a_perfect_draft_cannot_pay():
    """At a batch size where a verified row costs more than the best case of a costly drafter brings, it is
    not probed: the probe would only slow the step it runs in."""
    policy = BanditPolicy(["costly"], max_gamma=4, seed=0, backoff=False, gamma_exploration=0.0)
    for n in range(16, 81, 8):  # verify: 1.2 ms a row, the batch making 400 tokens/s
        policy.state.cost.observe_verify(n, 0.02 + 0.0012 * n)
    policy.state.cost.observe_draft("costly", 4, 0.030, forwards=4)  # 6.5 ms a forward + 1 ms a row
    policy.state.cost.observe_draft("costly", 64, 0.090, forwards=4)
    policy.state.cost.goodput.add(400.0, 1.0)
    policy.state.cost.goodput_at[1] = RatioEma(0.9)
    policy.state.cost.goodput_at[1].add(60.0, 1.0)  # one slot makes 60 tokens/s
    policy.state.pooled["costly"] = Beta(1.0 + 1, 1.0 + 1)
    slots = list(range(16))
    for s in slots:
        policy.on_admit(s)
    assert all(c.gamma == 0 for c in policy.choose(slots, [4] * 16).choices)
    assert policy.choose([0], [4]).choices[0] == Choice("costly", 4)  # alone, with a goodput to match, it may pay


def test_bursts_of_plain_decoding_cost_a_fixed_share_of_goodput_while_speculation_leads():
    """At 2.2x (the int8 copy at 1 slot) a burst of plain decoding gives up over half of each of its steps;
    they are spaced so the bursts cost about GATE_COST of the goodput, and never closer than GATE_REFRESH."""
    from spin_batch.selection.gate import GATE_BURST, GATE_COST, GATE_REFRESH, StepGate

    assert StepGate.refresh(0.0) == StepGate.refresh(-0.3) == GATE_REFRESH
    assert StepGate.refresh(math.log(2.2)) == pytest.approx(GATE_BURST * (1 - 1 / 2.2) / GATE_COST)
    assert StepGate.refresh(math.log(1.4)) < StepGate.refresh(math.log(2.2))
    modes = _gate_steps(StepGate(), 2000, lambda step, mode: 220.0 if mode else 100.0)
    plain = modes[200:].count(False) / len(modes[200:])
    assert 0.5 * GATE_COST < plain * (1 - 1 / 2.2) < 1.5 * GATE_COST, plain


def _beta_binomial_requests(rng: random.Random, mean: float, kappa: float, requests: int, trials: int):
    """(successes, trials) per request whose own rate is drawn from Beta(mean * kappa, (1 - mean) * kappa)."""
    out = []
    for _ in range(requests):
        p = rng.betavariate(mean * kappa, (1 - mean) * kappa)
        n = rng.randint(trials // 2, 2 * trials)
        out.append((sum(rng.random() < p for _ in range(n)), n))
    return out


@pytest.mark.parametrize("kappa", [8.0, 20.0, 60.0])
def test_spread_measures_how_much_requests_differ(kappa):
    """The method of moments recovers the strength of the Beta that requests' rates are drawn from (within the
    noise of 400 requests), reads requests that differ only by sampling as PRIOR_MAX, and keeps PRIOR_STRENGTH
    until SPREAD_REQUESTS requests are in."""
    from spin_batch.selection.arms import PRIOR_MAX, SPREAD_REQUESTS, Spread

    rng = random.Random(int(kappa))
    spread = Spread()
    for x, n in _beta_binomial_requests(rng, 0.6, kappa, 400, 40):
        spread.add(x, n)
    assert 0.7 * kappa < spread.strength < 1.4 * kappa, spread.strength
    same = Spread()
    for _ in range(200):
        same.add(sum(rng.random() < 0.95 for _ in range(60)), 60)
    assert same.strength == PRIOR_MAX
    few = Spread()
    for x, n in _beta_binomial_requests(rng, 0.6, kappa, SPREAD_REQUESTS - 1, 40):
        few.add(x, n)
    assert few.strength == PRIOR_STRENGTH


def test_one_rejection_does_not_turn_a_request_from_a_drafter_whose_requests_all_agree():
    """A drafter right on 95% of tokens in every request (the int8 copy of the target) and a cheaper one at 45%:
    at a warm start of 6 pseudo-tokens one rejected first token took the request's rate for the copy from 0.95
    to 0.81 (on the demo job, below what its cost needs: the request drafted with distilled drafts after).
    Once finished requests show how little the copy's rate differs between them, its warm start weighs as much
    as that: the same rejection leaves the request's rate near the pool's."""
    policy = BanditPolicy(["copy", "cheap"], max_gamma=6, seed=0, backoff=False)
    policy.state.pooled = {"copy": Beta(1 + 950, 1 + 50), "cheap": Beta(1 + 450, 1 + 550)}
    rng = random.Random(0)
    for d, rate in (("copy", 0.95), ("cheap", 0.45)):
        for x, n in _beta_binomial_requests(rng, rate, 1e6, 40, 30):
            policy.state.spread[d].add(x, n)
    cold = BanditPolicy(["copy", "cheap"], max_gamma=6, seed=0, backoff=False)
    cold.state.pooled = dict(policy.state.pooled)
    means = {}
    for name, p in (("measured", policy), ("unmeasured", cold)):
        p.on_admit(0)
        p.learn(NO_STEP, [Outcome(0, Choice("copy", 6), 6, 0)],
                StepCosts({"verify": 0.02}, 7, {"copy": 0.03}, {"copy": 6}))
        means[name] = p.state.requests[0].arms["copy"].mean
    assert means["unmeasured"] < 0.83 < 0.93 < means["measured"], means


def test_finished_requests_feed_the_spread_with_their_own_observations_only():
    """A request's arm holds its warm start plus what it saw; the spread must get only what it saw, when the slot
    takes its next request."""
    policy = BanditPolicy(["d"], max_gamma=4, seed=0, backoff=False)
    policy.on_admit(0)
    policy.learn(NO_STEP, [Outcome(0, Choice("d", 4), 4, 2)], StepCosts({"verify": 0.01}, 5, {"d": 0.001}, {"d": 4}))
    policy.learn(NO_STEP, [Outcome(0, Choice("d", 4), 4, 4)], StepCosts({"verify": 0.01}, 5, {"d": 0.001}, {"d": 4}))
    assert policy.state.spread["d"].requests == 0
    policy.on_admit(0)
    spread = policy.state.spread["d"]
    assert spread.requests == 1 and spread.x == 6 and spread.n == 7  # 2 + 4 accepted, one rejection


def test_closing_trials_choose_the_other_drafters_at_the_means():
    """A trace at 1 slot (the demo job): a cheap distilled draft is the optimistic favourite (mean 0.47, rate
    0.78) over the int8 copy (mean 0.97). Closing it put the slot on the next optimistic favourite, another
    distilled draft worth even less at its mean, so the cheap draft stayed, in a third of the steps. Closing
    re-chooses at the means: the slot drafts with the copy, worth far more there."""
    from spin_batch.selection.joint import JointChoice

    joint = JointChoice(caps=[6], rates=[{"copy": 0.999, "d128": 0.775, "d384": 0.8}],
                        means=[{"copy": 0.973, "d128": 0.5, "d384": 0.47}],
                        coeffs={"copy": (0.00439, 0.0), "d128": (0.00026, 0.0), "d384": (0.00085, 0.0)},
                        goes_on={"copy": None, "d128": 0.5, "d384": 0.5}, verify_price=0.07, lam=118.0)
    assert joint._respond(0, [(None, 0)], set(joint.coeffs))[0] == "d384"  # the optimistic favourite
    assert joint.solve() == [("copy", 6)]


def test_a_gated_drafter_that_cannot_pay_in_the_best_case_is_not_probed():
    """_could_pay prices the best case (every token accepted) with the chain proposed whole: priced at the gate's
    go-on rate instead, a chain of 6 cost one verified token for the gain of six, and at a verify price near one
    token (16 slots on a CPU whose verified rows cost as much as plain steps) every drafter was probed at the cap."""
    policy = BanditPolicy(["gated"], max_gamma=6, seed=0, backoff=False, gated=frozenset({"gated"}))
    for n in (16, 16, 16, 16):
        policy.state.cost.observe_verify(n, 0.0016 * n)  # all of the step's time per row: a verified row costs a token
    policy.state.cost.observe_draft("gated", 2, 0.0004)
    policy.state.cost.goodput.add(16 / 0.0256, 1.0)
    verify_price, lam = policy.state.pricing.prices(16)
    assert verify_price == pytest.approx(1.0)
    assert not policy._could_pay("gated", 16, 6, verify_price, lam)
    policy.state.cost = CostModel()  # a cheap verified row: it could pay
    policy.state.pricing.cost = policy.state.cost
    for n in (1, 4, 8, 16):
        policy.state.cost.observe_verify(n, 0.02 + 0.0001 * n)
    policy.state.cost.observe_draft("gated", 2, 0.0004)
    policy.state.cost.goodput.add(100.0, 1.0)
    assert policy._could_pay("gated", 16, 6, *policy.state.pricing.prices(16))


def test_the_joint_choice_skips_solving_only_where_no_slot_could_draft():
    """JointChoice.open_slots is a bound: where it finds no slot that could draft, solve() drafts for none (so the
    bandit need not run it, the cost of a step's choice at large batch); every slot solve() drafts for is open."""
    from spin_batch.selection.joint import chain_spend

    rng = random.Random(3)
    skipped = drafted = 0
    for _ in range(400):
        n = rng.randint(1, 8)
        drafters = [f"d{i}" for i in range(rng.randint(1, 3))]
        means = [{d: rng.random() for d in drafters} for _ in range(n)]
        joint = JointChoice(caps=[rng.randint(1, 6) for _ in range(n)], rates=[{d: min(m[d] + rng.random() * 0.3, 0.999)
                            for d in drafters} for m in means], means=means,
                            coeffs={d: (rng.random() * 0.004, rng.random() * 0.002) for d in drafters},
                            goes_on={d: rng.choice([None, rng.random()]) for d in drafters},
                            verify_price=rng.random() * 1.2, lam=rng.uniform(50, 500),
                            past={d: (rng.random(), rng.random()) for d in drafters if rng.random() < 0.3},
                            calibration={d: rng.uniform(0.5, 1.5) for d in drafters if rng.random() < 0.3})
        picks, open_slots = joint.solve(), joint.open_slots()
        if not open_slots:
            skipped += 1
            assert all(d is None for d, _ in picks)
        drafted += any(d is not None for d, _ in picks)
        assert {k for k, (d, _) in enumerate(picks) if d is not None} <= open_slots
    assert skipped > 50 and drafted > 50, (skipped, drafted)
    assert chain_spend(0, None) == (0.0, 0.0)


def test_slots_join_a_drafter_at_twice_the_width_its_forwards_were_measured_at():
    """Measured on one slot, a drafter's fit takes joining as free; so at most twice the slots its forwards ran
    together may draft with it in a step (CostModel.joining), those it gains most for, doubling as it is measured."""
    cm = CostModel()
    assert cm.joining("d") == 1
    cm.observe_draft("d", 2, 0.004, forwards=2)  # its first trial: one slot
    assert cm.joining("d") == 2
    cm.observe_draft("d", 8, 0.006, forwards=4)  # two slots together
    assert cm.joining("d") == 4
    policy = BanditPolicy(["d"], max_gamma=4, seed=0, backoff=False)
    policy.state.cost.observe_draft("d", 2, 0.004, forwards=2)
    joint = JointChoice(caps=[4] * 4, rates=[{"d": 0.9}] * 4, means=[{"d": a} for a in (0.5, 0.9, 0.7, 0.8)],
                        coeffs={"d": (0.002, 0.0)}, goes_on={"d": None}, verify_price=0.1, lam=100.0)
    picks = [("d", 4)] * 4
    assert policy._joining(picks, joint) == [(None, 0), ("d", 4), (None, 0), ("d", 4)]  # the two most likely


def test_slots_that_could_not_draft_are_left_out_and_the_choice_is_unchanged():
    """Given the slots that could draft at all (open_slots), solve() gives the same picks as over every slot."""
    rng = random.Random(5)
    compared = 0
    for _ in range(300):
        n = rng.randint(2, 12)
        drafters = [f"d{i}" for i in range(rng.randint(1, 3))]
        means = [{d: rng.random() for d in drafters} for _ in range(n)]
        kw = dict(caps=[rng.randint(1, 6) for _ in range(n)],
                  rates=[{d: min(m[d] + rng.random() * 0.3, 0.999) for d in drafters} for m in means], means=means,
                  coeffs={d: (rng.random() * 0.004, rng.random() * 0.002) for d in drafters},
                  goes_on={d: rng.choice([None, rng.random()]) for d in drafters},
                  verify_price=rng.random() * 0.8, lam=rng.uniform(50, 500))
        pruned, whole = JointChoice(**kw), JointChoice(**kw)
        open_slots = pruned.open_slots()
        if open_slots:
            compared += open_slots != set(range(n))
            assert pruned.solve(open_slots) == whole.solve()
    assert compared > 30, compared


def test_tree_budgets_follow_declared_capabilities_and_the_target():
    """make_policy decides a job's tree budgets once: for the gated drafters that declare trees
    (Drafter.capabilities), and none where the target verifies no tree segments (the transformers backend)."""
    from spin_batch.drafters.base import Capabilities, Drafter

    class Declared(Drafter):
        def __init__(self, name: str, gates: bool, trees: bool):
            super().__init__(name)
            self.gates, self.trees = gates, trees

        def propose(self, reqs):
            raise AssertionError

    pool = {"tree": Declared("tree", True, True), "chain": Declared("chain", True, False),
            "ungated": Declared("ungated", False, True)}
    assert pool["tree"].capabilities == Capabilities(gates=True, trees=True)
    policy = make_policy("ucb", pool, 4, tree_nodes=8)
    assert policy.settings.gated == {"tree", "chain"} and policy.settings.trees == {"tree": 8}
    assert policy.state.tree_gates is not None
    flat = make_policy("ucb", pool, 4, tree_nodes=8, target_trees=False)
    assert flat.settings.trees == {} and flat.state.tree_gates is None
    assert make_policy("fixed:tree", pool, 4, tree_nodes=8, target_trees=False).trees == {}
    assert make_policy("fixed:tree", pool, 4, tree_nodes=8).trees == {"tree": 8}


def test_learn_reads_the_record_it_is_given():
    """learn() takes the step's record back: a record chosen earlier is learnt from as it was chosen, whatever
    was chosen since (the calibration of its joint choice's picks at its batch size)."""
    world = World({"d": 0.8}, {"d": 0.001}, c0=0.02, c1=0.0005)
    policy = BanditPolicy(["d"], max_gamma=6, seed=0, backoff=False, gamma_exploration=0.0)
    run_requests(policy, world, n_requests=4, steps_per_request=30, slots=2)
    first = policy.choose([0], [6])
    assert [p.slot for p in first.predicted] == [0] and first.choices[0].drafter == "d"
    later = policy.choose([0, 1], [6, 6])
    assert later.predicted and all(p.slots == 2 for p in later.predicted)
    assert ("d", 1) not in policy.state.calibration  # two slots all along
    policy.learn(first, [Outcome(0, first.choices[0], first.choices[0].gamma, 0)],
                 StepCosts({"verify": 0.02}, 7, {"d": 0.006}, {"d": 6}))
    assert policy.state.calibration[("d", 1)].predicted == pytest.approx(first.predicted[0].tokens)
