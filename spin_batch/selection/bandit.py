"""The SPIN bandit: per request, a Beta posterior over each drafter's acceptance rate, scored by
ucb (optimistic) or thompson (sampled), and the step's choices made jointly by goodput.

Each request keeps, per drafter, a Beta posterior over the drafter's per-token acceptance rate a.
A verify that asked for g tokens and accepted k is k successes plus one failure when k < g (a
token the drafter did not propose counts as a failure). The choice itself, which prices those
rates against the cost model, is joint.JointChoice; the cost model is costs.py; the back-off
step gate is gate.StepGate.

Token trees: a drafter that grows trees (`trees`) gets its node budget with its choice, each node
priced by the confidence floor. Whether trees are offered at all is decided per batch size by
StepGates over the steps that speculate, as the back-off decides speculation: the favoured mode
runs unless the other one measures more goodput by the gate's margin. Trees are favoured at one
decoding slot (TREES_FIRST_SLOTS), where rows are cheapest beside the step and trees measured ahead,
chains above it, where they measured a few percent behind (BENCHMARKS.md, 2026-12-06 token trees):
the cost model prices a node's verified row, not all a tree spends (its draft rounds re-feed the
tree, the tree rule and the compaction run per slot), and a gap that small is the outcome's to settle.

Warm start: new requests start from the pooled posterior of all requests so far, scaled down to
as many pseudo-observations as the drafter's spread between requests is worth (Spread: few where
requests differ, so a request soon follows its own observations; many where they all agree, so one
unlucky step does not turn a request from a drafter that is right in every request). Until a request drafts
with a drafter, its prior for it follows the pool (it is warmed again at every step); from then on
the request's own observations sit on the prior it had then. Warmed once at admission only, the
requests already running when a costly drafter was first measured kept the cold prior for it (0.3)
for their whole length, at which it never paid: at 4 slots, 16 demo prompts, the int8 copy of the
target (96% of its tokens accepted) drafted in a third of the run's steps (BENCHMARKS.md). A prior
that kept following the pool after the request's own observations drafted more at 16 slots, where
drafting barely pays: 0.94x against 0.97x autoregressive (one bench each, ranges 0.93-0.95 and
0.95-0.99), so it was not kept.

Probing: a drafter is first tried by one slot with a short draft (its cost unknown), then by one slot
a step at the slot's cap until PROBE_PULLS steps in all have drafted with it, at batch sizes where it
could pay at all (_could_pay). Counted in steps, not in observations: a poor drafter's chain gives
about one observation a step, so probing it to 12 observations took ten steps of a short job (spin
at 1 slot on 16 short requests, held to AVX2: 1.48x against 1.53x before probing). The joint choice
sets gamma at the posterior mean, so without this a drafter whose first trial went badly was not
drafted with again, whatever its cost would have bought.

Exploration (ucb) is charged to the pool: a drafter's bonus shrinks with the evidence pooled over all
requests (its pooled posterior plus the request's own), not only with the request's own few
observations. Each request exploits its own posterior, but a drafter the job already knows well is
not explored again in every new request. A bonus on a rate flatters a cheap draft far more than a
costly one that is nearly always right (the int8 copy of the target: its value at 0.999 is hardly
above its value at 0.95), so per-request exploration kept taking cheap drafts in its place: paired
in one bench, 1.76x against 1.68x autoregressive at 1 slot and 1.34x against 1.27x at 4
(BENCHMARKS.md, the int8 copy).
The joint choice's closing step then keeps an optimistic pick only where it is also worth most at
the posterior means (joint.JointChoice), so most exploration is the probing above and each request's
prior following the pool until it drafts.

Drain: once the request stream is done (Policy.on_drain), a token no longer frees a slot for the
next request, and the job ends when its last request does. Any running request may be that one,
so a step shortens the job only by the progress of its slowest slot: the drain values the joint
choice at n times the least expected gain among its n slots instead of the sum of their gains
(JointChoice.drain_value), and the step drafts nothing unless that beats plain decoding. A step
that leaves any slot undrafted thus gains the job nothing and only pays for its drafts;
speculation goes on where every slot's draft pays, as in the last few requests of a job. The drain
limits the joint choice, not exploration: first trials and probes run in it too. It chooses among
drafters the cost model has priced, so one never tried could never be chosen there, and a job with
fewer rows than slots, all drain from its first step, drafted nothing at all (3 rows at 4 slots, 8 at
16). A step that probes reaches no verdict against drafting and ends any standing one: it learns.

The design is explained in docs/selection.md; the measurements behind it are in BENCHMARKS.md.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from .costs import CostModel, Pricing
from .gate import StepGate

TREES_FIRST_SLOTS = 1  # up to this many decoding slots, token trees are the tree gate's favoured mode
from .joint import JointChoice, best_gamma, chain_gain, chain_spend
from .policy import NO_SPEC, Choice, Outcome, Policy, StepCosts

RECALL_WEIGHT = 0.25  # what an earlier run's evidence is worth at the start of the next one (BanditPolicy.restore)
RECALL_POOL_CAP = 200.0  # the most pseudo-tokens an earlier run's pooled rate brings
RECALL_SPREAD_REQUESTS = 64  # the most finished requests an earlier run's spread brings
PRIOR_STRENGTH = 6.0  # pseudo-tokens a warm start is worth until the spread between requests is measured
PRIOR_MAX = 100.0  # the most pseudo-tokens a measured spread may make of it
SPREAD_REQUESTS = 4  # finished requests with observations of a drafter before its spread is measured
DEFAULT_RATE = 0.3  # prior acceptance before anything was pooled
PROBE_PULLS = 3  # steps that drafted with a drafter (its first trial included) before the joint choice alone decides
CALIBRATION_PRIOR = 16.0  # predicted draft tokens a calibration starts with at factor 1 (Calibration)
CALIBRATION_DECAY = 0.995  # per step of a drafter's chosen slots, at one batch size
DRAIN_RECHECK = 16  # steps the drain keeps a verdict against drafting while its slots stay the same


@dataclass
class Beta:
    alpha: float
    beta: float

    @property
    def mean(self) -> float:
        return self.alpha / (self.alpha + self.beta)

    @property
    def n(self) -> float:
        return self.alpha + self.beta

    def observe(self, drafted: int, accepted: int) -> None:
        self.alpha += accepted
        self.beta += 1.0 if accepted < drafted else 0.0

    def scaled(self, weight: float, cap: float, prior: float = 1.0) -> Beta:
        """Its observations (what it holds beyond a Beta(prior, prior)) worth `weight` of what they were and at most
        `cap` pseudo-tokens."""
        a, b = max(self.alpha - prior, 0.0), max(self.beta - prior, 0.0)
        k = min(weight, cap / (a + b)) if a + b > 0 else 0.0
        return Beta(prior + k * a, prior + k * b)


@dataclass
class PastGamma:
    """What a drafter's chains bring past gamma (DraftRequest.room: picks that the guesses of the chain's last
    forward confirmed), for the joint choice to value: tokens accepted past gamma in the steps whose gamma
    tokens were all accepted, and tokens proposed past gamma per step (verified rows)."""

    steps: int = 0
    rows: int = 0  # tokens proposed past gamma
    whole: int = 0  # steps whose gamma tokens were all accepted
    beyond: int = 0  # tokens accepted past gamma in those

    def observe(self, gamma: int, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.rows += max(drafted - gamma, 0)
        if accepted >= gamma:
            self.whole += 1
            self.beyond += accepted - gamma

    @property
    def value(self) -> tuple[float, float]:
        """(accepted past gamma per whole chain, proposed past gamma per step): joint.chain_value's `past`."""
        return self.beyond / max(self.whole, 1), self.rows / max(self.steps, 1)


@dataclass
class Calibration:
    """A drafter's draft tokens accepted against those the joint choice predicted when it chose the drafter, at
    one batch size: the factor on its predicted draft tokens (joint.chain_gain).

    The joint choice drafts where a request's posterior mean makes a chain pay, and among many slots and
    drafters it picks the means that came out high: at 16 slots (demo job, cap 8) the distilled drafts it
    chose were predicted 2.1-2.5 tokens a step at their means and made 1.4-1.9, a chain that seemed to pay
    where it did not. At 1 slot, with one request and the int8 copy, predictions held. Decayed sums, with
    CALIBRATION_PRIOR predicted tokens at factor 1 so that a few steps move it little."""

    realized: float = 0.0
    predicted: float = 0.0

    def add(self, realized: float, predicted: float) -> None:
        self.realized = CALIBRATION_DECAY * self.realized + realized
        self.predicted = CALIBRATION_DECAY * self.predicted + predicted

    @property
    def factor(self) -> float:
        return (self.realized + CALIBRATION_PRIOR) / (self.predicted + CALIBRATION_PRIOR)


class Spread:
    """How much a drafter's acceptance rate differs between requests, as the strength of a warm start.

    Each request's rate is taken as drawn from a Beta of mean P (the pooled rate) and strength kappa:
    a request's own observations then move its rate off P by their weight against kappa. kappa is
    measured on finished requests by the method of moments of the beta-binomial: the spread of their
    observed rates beyond what sampling alone gives. With n_r observations at rate p_r over R
    requests, S = sum n_r (p_r - P)^2 has expectation P(1 - P) (R - 1 + rho (N - sum n_r^2 / N)),
    rho = 1 / (kappa + 1), N = sum n_r. Measured on the demo job at 1 slot (32 requests each): the int8
    copy of the target 0.96 with kappa about 100 (its requests at 0.88 to 1.0), a distilled draft 0.41
    with about 21, the n-gram/draft cascade 0.51 with about 11. At the fixed strength of 6, one
    rejected first token took a request's copy from 0.97 to 0.83, and the request drafted with the
    distilled drafts, at about half the goodput, for the rest of its length. Measured from 4 requests
    on: in simulation, a drafter like the copy then reads at least 39 in 9 cases of 10 (at least 42 from
    8), while one that differs like the distilled drafts (21) reads 100 in a quarter of the cases (a
    tenth from 8); such a request then follows the pool more than it should, which costs far less than
    the copy left behind, and the estimate settles as requests finish."""

    def __init__(self) -> None:
        self.requests = 0
        self.n = self.x = self.n2 = self.x2n = 0.0  # sums of n_r, x_r, n_r^2, x_r^2 / n_r
        # kappa in pseudo-tokens, within [PRIOR_STRENGTH, PRIOR_MAX]; PRIOR_STRENGTH until measured. Read at
        # every warm start (each slot, each step), so kept here and renewed only when a request is added.
        self.strength = PRIOR_STRENGTH

    def add(self, successes: float, trials: float) -> None:
        """One finished request's own observations of the drafter."""
        if trials <= 0:
            return
        self.requests += 1
        self.n += trials
        self.x += successes
        self.n2 += trials * trials
        self.x2n += successes * successes / trials
        self.strength = self._measure()

    def _measure(self) -> float:
        if self.requests < SPREAD_REQUESTS:
            return PRIOR_STRENGTH
        p = self.x / self.n
        if p <= 0.0 or p >= 1.0:
            return PRIOR_STRENGTH
        spread = self.x2n - 2.0 * p * self.x + p * p * self.n  # sum n_r (p_r - P)^2
        excess = spread / (p * (1.0 - p)) - (self.requests - 1)
        width = self.n - self.n2 / self.n
        if width <= 0.0:
            return PRIOR_STRENGTH
        rho = excess / width
        if rho <= 1.0 / (PRIOR_MAX + 1.0):
            return PRIOR_MAX
        return min(max(1.0 / rho - 1.0, PRIOR_STRENGTH), PRIOR_MAX)


@dataclass
class RequestArms:
    arms: dict[str, Beta]
    steps: int = 0
    # per drafter not drafted with yet, the pooled prior that is its arm: re-warmed each step
    warm: dict[str, Beta] = field(default_factory=dict)
    own: dict[str, Beta] = field(default_factory=dict)  # per drafter drafted with, its own observations alone

    def rewarm(self, drafter: str, prior: Beta) -> None:
        """The arm of a drafter this request has not drafted with yet becomes `prior`."""
        self.arms[drafter] = self.warm[drafter] = prior


@dataclass
class BanditPolicy(Policy):
    """`ucb` (optimistic acceptance) or `thompson` (sampled acceptance).

    backoff: each step passes the StepGate first."""

    drafters: list[str]
    max_gamma: int
    mode: str = "ucb"
    gated: frozenset[str] = frozenset()  # drafters that honour Choice.min_prob (the confidence gate)
    seed: int = 0
    exploration: float = 0.5  # UCB bonus scale
    # chance per step that one slot tries a random gamma, so the cost model sees varied N. Per
    # step, not per slot: at 16 slots a per-slot chance would put an exploring draft in most
    # steps, and at large batch every extra verify token is paid by the whole batch.
    gamma_exploration: float = 0.05
    cost: CostModel = field(default_factory=CostModel)
    pooled: dict[str, Beta] = field(default_factory=dict)
    requests: dict[int, RequestArms] = field(default_factory=dict)  # by slot
    backoff: bool = True
    trees: dict[str, int] = field(default_factory=dict)  # per drafter that grows token trees, its node budget

    def __post_init__(self) -> None:
        if self.mode not in ("ucb", "thompson"):
            raise ValueError(f"unknown bandit mode {self.mode!r}")
        self.rng = random.Random(self.seed)
        self.pooled = {d: Beta(1.0, 1.0) for d in self.drafters}
        self.spread = {d: Spread() for d in self.drafters}
        self.past = {d: PastGamma() for d in self.drafters}
        self.calibration: dict[tuple[str, int], Calibration] = {}  # per (drafter, decoding slots)
        # per slot the joint choice drafted for this step: (drafter, decoding slots, predicted draft tokens)
        self._predicted: dict[int, tuple[str, int, float]] = {}
        self.pulls = Counter()  # per drafter, steps that drafted with it (any slot)
        self.pricing = Pricing([d for d in self.drafters if d in self.gated], self.cost)
        self.gate = StepGate() if self.backoff else None
        self._step: tuple[int, bool] | None = None  # (decoding slots, speculated) of the step being run
        # per batch size, whether trees run: the gate's True mode is trees at few slots, chains above
        self.tree_gates = (StepGate(), StepGate()) if self.trees else None  # (trees first, chains first)
        self._tree_step: tuple[int, bool, bool] | None = None  # (decoding slots, gate mode, trees) of this step
        self.draining = False  # the request stream is done (on_drain): see the module docstring
        # the drain's last verdict against drafting: the slots it covered, and steps since. In the drain
        # nothing is learnt while nothing drafts, so the verdict stands until a slot leaves (or a while).
        self._drain_no: tuple[frozenset[int], int] | None = None

    def on_stream(self) -> None:
        self.draining, self._drain_no = False, None

    def on_drain(self) -> None:
        self.draining = True

    # -- per-request state ----------------------------------------------------------------

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        """Warm start: the pooled posterior, shrunk to the strength its spread between requests gives (see
        _warm). The request that held the slot is done: its own observations measure that spread."""
        done = self.requests.get(slot)
        if done is not None:
            for d, b in done.own.items():
                self.spread[d].add(b.alpha, b.n)
        warm = {d: self._warm(d) for d in self.pooled}
        self.requests[slot] = RequestArms(dict(warm), warm=warm)

    def _warm(self, drafter: str) -> Beta:
        """The pooled posterior of drafter, shrunk to the pseudo-tokens its spread between requests is worth."""
        b = self.pooled[drafter]
        mean = b.mean if b.n > 2.0 else DEFAULT_RATE
        strength = self.spread[drafter].strength
        return Beta(mean * strength, (1 - mean) * strength)

    # -- select -----------------------------------------------------------------------------

    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        verify_price, lam = self.pricing.prices(len(slots))
        self._predicted = {}
        if self.gate is not None:
            self._step = (len(slots), self.gate.decide(len(slots)))
            if not self._step[1]:
                return [NO_SPEC] * len(slots)
        if self.tree_gates is not None:
            trees_first = len(slots) <= TREES_FIRST_SLOTS
            mode = self.tree_gates[0 if trees_first else 1].decide(len(slots))
            self._tree_step = (len(slots), mode, mode == trees_first)
        # a drafter whose cost is still unknown is tried by one slot, with a short draft: trying
        # it on every slot at once could stall the whole batch behind an expensive drafter
        unmeasured = [d for d in self.drafters if not self.cost.measured(d)]
        # then one slot a step drafts with it to the slot's cap until the pool knows it (see Probing above).
        # In the drain too (see Drain above): the drain chooses among what is priced and known, never these
        probing = [d for d in self.drafters if self.cost.measured(d) and self.pulls[d] < PROBE_PULLS
                   and self._could_pay(d, len(slots), max(caps, default=0), verify_price, lam)]
        explore = not self.draining and slots and self.rng.random() < self.gamma_exploration
        explorer = self.rng.randrange(len(slots)) if explore else -1
        out: list[Choice] = [NO_SPEC] * len(slots)
        open_: list[tuple[int, RequestArms, int]] = []  # (index, request, cap) the bandit decides jointly
        for i, (s, cap) in enumerate(zip(slots, caps)):
            req = self.requests.get(s)
            if req is None:
                self.on_admit(s)
                req = self.requests[s]
            req.steps += 1
            for d in req.warm:  # the prior follows the pool until the request drafts with d
                req.rewarm(d, self._warm(d))
            cap = min(cap, self.max_gamma)
            if unmeasured and cap > 0:
                out[i] = Choice(unmeasured.pop(0), min(2, cap))
            elif probing and cap > 0:  # with the step's tree budget: the tree gate scores this step's mode
                d = probing.pop(0)
                out[i] = Choice(d, cap, nodes=self._nodes(d))
            elif cap > 0 and self.cost.goodput.seen:
                open_.append((i, req, cap))
        trials = any(c.drafter is not None for c in out)  # first trials or probes: something is learnt this step
        for i, choice in self._drained(slots, open_, verify_price, lam, trials).items():
            out[i] = choice
        cap = next((cap for i, _, cap in open_ if i == explorer), 0)
        if cap:
            # vary gamma only, with the chosen drafter or else the cheapest one: exploring an
            # expensive drafter would make the whole batch wait for its draft rounds
            name = out[explorer].drafter or min(self.drafters, key=self.cost.draft_cost)
            if self.cost.measured(name):
                g = self.rng.randint(0, cap)
                out[explorer] = Choice(name, g) if g else NO_SPEC  # ungated: the cost model must see N vary
        # what the joint choice's picks are predicted to gain at their means, uncalibrated (Calibration)
        self._predicted = {slots[i]: (c.drafter, len(slots), chain_gain(c.gamma, req.arms[c.drafter].mean,
                                                                        self.past[c.drafter].value) - 1.0)
                           for i, req, _ in open_ if i != explorer and (c := out[i]).drafter is not None}
        return out

    def _could_pay(self, drafter: str, n: int, cap: int, verify_price: float, lam: float) -> bool:
        """Whether the drafter beats plain decoding at this batch size in the best case: every token
        accepted and its forwards shared by all n slots. A probe of one that cannot (the int8 copy of the
        target at 16 slots, where a verified row costs half a token) only slows the step it runs in.
        Every token accepted means every token proposed: a confidence gate would stop no chain, so the chain
        is priced whole (priced at the gate's go-on rate, a chain of 8 cost a gated drafter one verified
        token for the gain of all eight, and every drafter could pay at any batch size)."""
        if cap <= 0 or not self.cost.goodput.seen:
            return False
        f, s = self.cost.draft_coeffs(drafter)
        spend = [chain_spend(g, None) for g in range(min(cap, self.max_gamma) + 1)]
        return best_gamma(0.999, verify_price, lam * (s + f / max(n, 1)), spend)[1] > 0

    def _drained(self, slots: list[int], open_: list[tuple[int, RequestArms, int]], verify_price: float,
                 lam: float, trials: bool = False) -> dict[int, Choice]:
        """_joint, but in the drain a verdict against drafting is kept for DRAIN_RECHECK steps unless a slot left.
        trials: first trials or probes run this step, so something is learnt: no verdict is kept or reached."""
        if not self.draining:
            return self._joint(open_, len(slots), verify_price, lam)
        key = frozenset(slots)
        if trials:
            self._drain_no = None
        elif self._drain_no is not None and self._drain_no[0] == key and self._drain_no[1] < DRAIN_RECHECK:
            self._drain_no = (key, self._drain_no[1] + 1)
            return {}
        out = self._joint(open_, len(slots), verify_price, lam)
        self._drain_no = None if out or trials else (key, 0)
        return out

    def _joint(self, open_: list[tuple[int, RequestArms, int]], n: int, verify_price: float,
               lam: float) -> dict[int, Choice]:
        """Each open slot's choice (see JointChoice) among n decoding slots, with its drafter's confidence floor."""
        if not open_:
            return {}
        evidence = sum(b.n - 2.0 for b in self.pooled.values())  # observations pooled over every drafter
        joint = JointChoice(
            caps=[cap for _, _, cap in open_],
            rates=[{d: self._rate(arm, self.pooled[d], evidence) for d, arm in req.arms.items()}
                   for _, req, _ in open_],
            means=[{d: arm.mean for d, arm in req.arms.items()} for _, req, _ in open_],
            coeffs={d: self.cost.draft_coeffs(d) for d in self.drafters},
            goes_on={d: self.pricing.goes_on(d) for d in self.drafters}, verify_price=verify_price, lam=lam,
            past={d: p.value for d, p in self.past.items() if p.rows},
            calibration={d: c.factor for (d, at), c in self.calibration.items() if at == n})
        open_slots = None  # the drain values the slowest slot, so every slot counts there (drain_bound instead)
        if self.draining:
            if joint.drain_bound() <= joint.n:
                return {}
        else:
            open_slots = joint.open_slots()
            if not open_slots:
                return {}
        picks = joint.solve(open_slots)
        if self.draining:
            picks = joint.drain_picks(picks)
            if joint.drain_value(picks) <= joint.n:
                return {}
        picks = self._joining(picks, joint)
        sharing = Counter(d for d, _ in picks if d is not None)
        return {i: Choice(d, g, self.pricing.floor(d, sharing[d], verify_price, lam), self._nodes(d))
                for (i, _, _), (d, g) in zip(open_, picks) if d is not None}

    def _joining(self, picks: list[tuple[str | None, int]], joint: JointChoice) -> list[tuple[str | None, int]]:
        """The picks with each drafter held to CostModel.joining slots: those it gains most for keep it."""
        out = list(picks)
        for d in {d for d, _ in picks if d is not None}:
            mine = [k for k, (e, _) in enumerate(picks) if e == d]
            room = self.cost.joining(d)
            if len(mine) > room:
                for k in sorted(mine, key=lambda k: -joint.gain(k, d, picks[k][1]))[room:]:
                    out[k] = (None, 0)
        return out

    def _nodes(self, drafter: str) -> int:
        """The drafter's tree budget this step: 0 (a chain) unless the tree gate runs trees."""
        trees = self._tree_step is not None and self._tree_step[2]
        return self.trees.get(drafter, 0) if trees else 0

    def _rate(self, arm: Beta, pooled: Beta, evidence: float) -> float:
        """The drafter-choosing rate: ucb, the request's mean plus a bonus for how little the pool and the
        request know of the drafter, among `evidence` observations pooled over every drafter (see the module
        docstring); thompson, a draw from the request's posterior."""
        if self.mode == "thompson":
            return self.rng.betavariate(arm.alpha, arm.beta)
        bonus = self.exploration * math.sqrt(math.log(evidence + 1.0) / (pooled.n + arm.n))
        return min(arm.mean + bonus, 0.999)

    # -- learn ------------------------------------------------------------------------------

    # -- memory between runs -------------------------------------------------------------------

    def state(self) -> dict:
        """What holds beyond this run: the cost model, the gates' verdicts, per drafter the pooled rate, the
        spread between requests, what chains bring past gamma and the calibration of predictions."""
        return {
            "pricing": self.pricing.state(),
            "gate": self.gate.state() if self.gate is not None else None,
            "tree_gates": [g.state() for g in self.tree_gates] if self.tree_gates is not None else None,
            "pooled": {d: [b.alpha, b.beta] for d, b in self.pooled.items()},
            "spread": {d: [s.requests, s.n, s.x, s.n2, s.x2n] for d, s in self.spread.items()},
            "past": {d: [p.steps, p.rows, p.whole, p.beyond] for d, p in self.past.items()},
            "calibration": [[d, n, c.realized, c.predicted] for (d, n), c in self.calibration.items()],
            "pulls": dict(self.pulls),
        }

    def restore(self, state: dict, weight: float = RECALL_WEIGHT) -> None:
        """Start from an earlier run's state (for the drafters this policy has), its evidence worth `weight` of
        what it was: the first steps price drafters, skip warm-ups and probes, and back off where that run
        found speculation did not pay, and this run's own steps soon outweigh it. Requests' own arms are not
        kept: they belong to requests that are done."""
        self.pricing.restore(state["pricing"], weight)
        if self.gate is not None and state.get("gate") is not None:
            self.gate.restore(state["gate"], weight)
        if self.tree_gates is not None and state.get("tree_gates") is not None:
            for g, s in zip(self.tree_gates, state["tree_gates"]):
                g.restore(s, weight)
        for d, (alpha, beta) in state["pooled"].items():
            if d in self.pooled:
                self.pooled[d] = Beta(float(alpha), float(beta)).scaled(weight, RECALL_POOL_CAP)
        for d, (requests, *sums) in state["spread"].items():
            if d in self.spread and requests > 0:
                k = min(1.0, RECALL_SPREAD_REQUESTS / requests)
                spread = self.spread[d] = Spread()
                spread.requests = max(int(k * requests), 1)
                spread.n, spread.x, spread.n2, spread.x2n = (k * float(v) for v in sums)
                spread.strength = spread._measure()
        for d, (steps, rows, whole, beyond) in state["past"].items():
            if d in self.past:
                self.past[d] = PastGamma(*(int(weight * v) for v in (steps, rows, whole, beyond)))
        for d, n, realized, predicted in state["calibration"]:
            if d in self.pooled:
                self.calibration[(d, int(n))] = Calibration(weight * realized, weight * predicted)
        for d, n in state["pulls"].items():
            if d in self.pooled:  # probed already: the joint choice decides from the start
                self.pulls[d] = min(int(n), PROBE_PULLS)

    def learn(self, outcomes: list[Outcome], costs: StepCosts) -> None:
        gained, decode_s = self.pricing.learn(outcomes, costs)
        if self.gate is not None and self._step is not None:
            self.gate.observe(self._step[0], self._step[1], gained, decode_s)
        if self.tree_gates is not None and self._tree_step is not None and (self._step is None or self._step[1]):
            n, mode, _ = self._tree_step
            self.tree_gates[0 if n <= TREES_FIRST_SLOTS else 1].observe(n, mode, gained, decode_s)
        for o in outcomes:
            if o.choice.drafter is None or o.choice.gamma == 0:
                continue
            # Judged against what was asked: a drafter that proposes fewer tokens than gamma (an
            # n-gram drafter with no match proposes none) stops the chain there, like a rejection.
            # Counting only proposed tokens would rate a drafter that rarely proposes as if it
            # always did.
            # Tokens past gamma (DraftRequest.room) are not counted: the rate is of what was asked; they are
            # valued on their own (PastGamma).
            accepted = min(o.accepted, o.choice.gamma)
            self.past[o.choice.drafter].observe(o.choice.gamma, o.drafted, o.accepted)
            predicted = self._predicted.get(o.slot)
            if predicted is not None and predicted[0] == o.choice.drafter:
                self.calibration.setdefault(predicted[:2], Calibration()).add(o.accepted, predicted[2])
            req = self.requests.get(o.slot)
            if req is not None:
                req.warm.pop(o.choice.drafter, None)  # its own evidence now: the prior stops following the pool
                req.arms[o.choice.drafter].observe(o.choice.gamma, accepted)
                req.own.setdefault(o.choice.drafter, Beta(0.0, 0.0)).observe(o.choice.gamma, accepted)
            self.pooled[o.choice.drafter].observe(o.choice.gamma, accepted)
        self.pulls.update({o.choice.drafter for o in outcomes if o.choice.drafter is not None and o.choice.gamma > 0})
