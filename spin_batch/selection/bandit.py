"""The SPIN bandit: per request, a Beta posterior over each drafter's acceptance rate, scored by
ucb (optimistic) or thompson (sampled), and the step's choices made jointly by goodput.

Each request keeps, per drafter, a Beta posterior over the drafter's per-token acceptance rate a.
A verify that asked for g tokens and accepted k is k successes plus one failure when k < g (a
token the drafter did not propose counts as a failure). The choice itself, which prices those
rates against the cost model, is joint.JointChoice; the cost model is costs.py; the back-off
step gate is gate.StepGate.

Token trees: a drafter that grows trees (`trees`) gets its node budget with its choice, each node
priced by the confidence floor. Whether trees are offered is decided per batch size by StepGates over
the steps that speculate: the favoured mode (trees up to TREES_FIRST_SLOTS decoding slots, chains
above) runs unless the other one measures more goodput by the gate's margin.

Warm start of a request: it starts from the pooled posterior of all requests so far, scaled down to as
many pseudo-observations as the drafter's spread between requests is worth (arms.Spread). Until the
request drafts with a drafter, its prior for it follows the pool (warmed again at every step); from then
on the request's own observations sit on the prior it had then.

Probing: a drafter is first tried by one slot with a short draft (its cost unknown), then by one slot a
step at the slot's cap until PROBE_PULLS steps in all have drafted with it, at batch sizes where it could
pay at all (_could_pay).

Exploration (ucb) is charged to the pool: a drafter's bonus shrinks with the evidence pooled over all
requests, not only with the request's own observations. The joint choice's closing step keeps an
optimistic pick only where it is also worth most at the posterior means (joint.JointChoice).

Drain: once the request stream is done (Policy.on_drain), a step shortens the job only by the progress
of its slowest slot: the joint choice is valued at n times the least expected gain among its n slots
(JointChoice.drain_value), and the step drafts nothing unless that beats plain decoding. First trials
and probes run in the drain too; a step that probes ends any standing verdict against drafting.

Data in, data out: the settings (BanditSettings, frozen) apart from the running state (BanditState: the
arms, the pool, the calibration, the gates, the drain); choose() returns the step's record (StepChoice:
the choices, the gates' decisions, the joint choice's predictions) and learn() reads only that record and
the outcomes. choose() runs its phases in order: the gates (_gates), the first trials and probes (_trials),
the joint choice (_drained, _joint), gamma exploration (_explore), and the predictions (_predictions).
BanditState.snapshot/restore carry what holds beyond a run into the next one (memory.py).

Why each rule is as it is, with the measurements: docs/selection.md ("Why the bandit is built so").
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from .arms import Beta, Calibration, PastGamma, RequestArms, Spread
from .costs import CostModel, Pricing
from .gate import StepGate
from .joint import JointChoice, best_gamma, chain_gain, chain_spend
from .policy import NO_SPEC, Choice, GateStep, Outcome, Policy, Prediction, StepChoice, StepCosts

TREES_FIRST_SLOTS = 1  # up to this many decoding slots, token trees are the tree gate's favoured mode
RECALL_WEIGHT = 0.25  # what an earlier run's evidence is worth at the start of the next one (BanditState.restore)
RECALL_POOL_CAP = 200.0  # the most pseudo-tokens an earlier run's pooled rate brings
RECALL_SPREAD_REQUESTS = 64  # the most finished requests an earlier run's spread brings
DEFAULT_RATE = 0.3  # prior acceptance before anything was pooled
PROBE_PULLS = 3  # steps that drafted with a drafter (its first trial included) before the joint choice alone decides
DRAIN_RECHECK = 16  # steps the drain keeps a verdict against drafting while its slots stay the same

Open = list[tuple[int, RequestArms, int]]  # (index, request, cap) of the slots the joint choice decides

@dataclass(frozen=True)
class BanditSettings:
    """What the bandit is told: fixed for its life."""

    drafters: tuple[str, ...]
    max_gamma: int
    mode: str = "ucb"  # ucb (optimistic acceptance) or thompson (sampled acceptance)
    gated: frozenset[str] = frozenset()  # drafters that honour Choice.min_prob (the confidence gate)
    seed: int = 0
    exploration: float = 0.5  # UCB bonus scale
    # chance per step that one slot tries a random gamma, so the cost model sees varied N. Per
    # step, not per slot: at 16 slots a per-slot chance would put an exploring draft in most
    # steps, and at large batch every extra verify token is paid by the whole batch.
    gamma_exploration: float = 0.05
    backoff: bool = True  # each step passes the StepGate first
    trees: Mapping[str, int] = field(default_factory=dict)  # per drafter that grows token trees, its node budget

    def __post_init__(self) -> None:
        if self.mode not in ("ucb", "thompson"):
            raise ValueError(f"unknown bandit mode {self.mode!r}")


class BanditState:
    """What the bandit has learnt, and where the job is: everything choose() and learn() change."""

    def __init__(self, settings: BanditSettings, cost: CostModel | None = None):
        drafters = settings.drafters
        self.rng = random.Random(settings.seed)
        self.cost = cost if cost is not None else CostModel()
        self.pricing = Pricing([d for d in drafters if d in settings.gated], self.cost)
        self.pooled = {d: Beta(1.0, 1.0) for d in drafters}
        self.spread = {d: Spread() for d in drafters}
        self.past = {d: PastGamma() for d in drafters}
        self.calibration: dict[tuple[str, int], Calibration] = {}  # per (drafter, decoding slots)
        self.pulls = Counter()  # per drafter, steps that drafted with it (any slot)
        self.requests: dict[int, RequestArms] = {}  # by slot
        self.gate = StepGate() if settings.backoff else None
        # per batch size, whether trees run: the gate's True mode is trees at few slots, chains above
        self.tree_gates = (StepGate(), StepGate()) if settings.trees else None  # (trees first, chains first)
        self.draining = False  # the request stream is done (on_drain): see the module docstring
        # the drain's last verdict against drafting: the slots it covered, and steps since. In the drain
        # nothing is learnt while nothing drafts, so the verdict stands until a slot leaves (or a while).
        self.drain_no: tuple[frozenset[int], int] | None = None

    def snapshot(self) -> dict:
        """What holds beyond this run, as JSON data: the cost model, the gates' verdicts, per drafter the pooled
        rate, the spread between requests, what chains bring past gamma, the calibration and the probes."""
        return {
            "pricing": self.pricing.snapshot(),
            "gate": self.gate.snapshot() if self.gate is not None else None,
            "tree_gates": [g.snapshot() for g in self.tree_gates] if self.tree_gates is not None else None,
            "pooled": {d: [b.alpha, b.beta] for d, b in self.pooled.items()},
            "spread": {d: [s.requests, s.n, s.x, s.n2, s.x2n] for d, s in self.spread.items()},
            "past": {d: [p.steps, p.rows, p.whole, p.beyond] for d, p in self.past.items()},
            "calibration": [[d, n, c.realized, c.predicted] for (d, n), c in self.calibration.items()],
            "pulls": dict(self.pulls),
        }

    def restore(self, snap: dict, weight: float = RECALL_WEIGHT) -> None:
        """Start from an earlier run's snapshot (for the drafters this bandit has), its evidence worth `weight` of
        what it was: the first steps price drafters, skip warm-ups and probes, and back off where that run
        found speculation did not pay, and this run's own steps soon outweigh it. The requests' own arms are
        not kept: they belong to requests that are done."""
        self.pricing.restore(snap["pricing"], weight)
        if self.gate is not None and snap.get("gate") is not None:
            self.gate.restore(snap["gate"], weight)
        if self.tree_gates is not None and snap.get("tree_gates") is not None:
            for g, s in zip(self.tree_gates, snap["tree_gates"]):
                g.restore(s, weight)
        for d, (alpha, beta) in snap["pooled"].items():
            if d in self.pooled:
                self.pooled[d] = Beta(float(alpha), float(beta)).scaled(weight, RECALL_POOL_CAP)
        for d, (requests, *sums) in snap["spread"].items():
            if d in self.spread and requests > 0:
                self.spread[d] = Spread.restored(int(requests), [float(v) for v in sums],
                                                 min(1.0, RECALL_SPREAD_REQUESTS / requests))
        for d, counts in snap["past"].items():
            if d in self.past:
                self.past[d] = PastGamma(*(int(weight * v) for v in counts))
        for d, n, realized, predicted in snap["calibration"]:
            if d in self.pooled:
                self.calibration[(d, int(n))] = Calibration(weight * realized, weight * predicted)
        for d, n in snap["pulls"].items():
            if d in self.pooled:  # probed already: the joint choice decides from the start
                self.pulls[d] = min(int(n), PROBE_PULLS)


class BanditPolicy(Policy):
    """`ucb` (optimistic acceptance) or `thompson` (sampled acceptance): BanditSettings, and a BanditState
    that choose() and learn() carry on."""

    def __init__(self, drafters: list[str], max_gamma: int, mode: str = "ucb", gated: frozenset[str] = frozenset(),
                 seed: int = 0, exploration: float = 0.5, gamma_exploration: float = 0.05, backoff: bool = True,
                 trees: Mapping[str, int] | None = None, cost: CostModel | None = None):
        self.settings = BanditSettings(tuple(drafters), max_gamma, mode, frozenset(gated), seed, exploration,
                                       gamma_exploration, backoff, dict(trees or {}))
        self.state = BanditState(self.settings, cost)

    def snapshot(self) -> dict:
        return self.state.snapshot()

    def restore(self, snap: dict) -> None:
        self.state.restore(snap)

    def on_stream(self) -> None:
        self.state.draining, self.state.drain_no = False, None

    def on_drain(self) -> None:
        self.state.draining = True

    # -- per-request state ----------------------------------------------------------------

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        """Warm start: the pooled posterior, shrunk to the strength its spread between requests gives (see
        _warm). The request that held the slot is done: its own observations measure that spread."""
        st = self.state
        done = st.requests.get(slot)
        if done is not None:
            for d, b in done.own.items():
                st.spread[d].add(b.alpha, b.n)
        warm = {d: self._warm(d) for d in st.pooled}
        st.requests[slot] = RequestArms(dict(warm), warm=warm)

    def _warm(self, drafter: str) -> Beta:
        """The pooled posterior of drafter, shrunk to the pseudo-tokens its spread between requests is worth."""
        b = self.state.pooled[drafter]
        mean = b.mean if b.n > 2.0 else DEFAULT_RATE
        strength = self.state.spread[drafter].strength
        return Beta(mean * strength, (1 - mean) * strength)

    def _arms(self, slot: int) -> RequestArms:
        """The slot's request for this step (admitted on first sight, for a caller that did not), one step on,
        its priors for the drafters it has not drafted with yet following the pool."""
        req = self.state.requests.get(slot)
        if req is None:
            self.on_admit(slot)
            req = self.state.requests[slot]
        req.steps += 1
        for d in req.warm:  # the prior follows the pool until the request drafts with d
            req.rewarm(d, self._warm(d))
        return req

    # -- select -----------------------------------------------------------------------------

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        n = len(slots)
        verify_price, lam = self.state.pricing.prices(n)
        gate, tree = self._gates(n)
        if gate is not None and not gate.mode:
            return StepChoice((NO_SPEC,) * n, gate)
        trees = tree is not None and tree.mode == (n <= TREES_FIRST_SLOTS)  # this step drafts trees
        explorer = self._explorer(n)  # drawn before the joint choice's draws (thompson)
        out, open_ = self._trials(slots, caps, verify_price, lam, trees)
        trials = any(c.drafter is not None for c in out)  # first trials or probes: something is learnt this step
        for i, choice in self._drained(slots, open_, verify_price, lam, trees, trials).items():
            out[i] = choice
        self._explore(out, open_, explorer)
        return StepChoice(tuple(out), gate, tree, self._predictions(slots, out, open_, explorer))

    def _gates(self, n: int) -> tuple[GateStep | None, GateStep | None]:
        """The back-off gate's decision at n decoding slots (None: no back-off), and, where it speculates, the
        tree gate's (None: no drafter grows trees)."""
        st = self.state
        gate = GateStep(n, st.gate.decide(n)) if st.gate is not None else None
        if st.tree_gates is None or (gate is not None and not gate.mode):
            return gate, None
        return gate, GateStep(n, st.tree_gates[0 if n <= TREES_FIRST_SLOTS else 1].decide(n))

    def _explorer(self, n: int) -> int:
        """The slot (index) that tries a random gamma this step, or -1: none (never in the drain)."""
        st = self.state
        explore = not st.draining and n and st.rng.random() < self.settings.gamma_exploration
        return st.rng.randrange(n) if explore else -1

    def _trials(self, slots: list[int], caps: list[int], verify_price: float, lam: float,
                trees: bool) -> tuple[list[Choice], Open]:
        """Each slot's first trial or probe (NO_SPEC elsewhere), and the slots left to the joint choice.

        A drafter whose cost is still unknown is tried by one slot, with a short draft: trying it on every
        slot at once could stall the whole batch behind an expensive drafter. Then one slot a step drafts
        with it to the slot's cap until the pool knows it (see Probing above). In the drain too (see Drain
        above): the drain chooses among what is priced and known, never these."""
        st, cfg = self.state, self.settings
        unmeasured = [d for d in cfg.drafters if not st.cost.measured(d)]
        probing = [d for d in cfg.drafters if st.cost.measured(d) and st.pulls[d] < PROBE_PULLS
                   and self._could_pay(d, len(slots), max(caps, default=0), verify_price, lam)]
        out: list[Choice] = [NO_SPEC] * len(slots)
        open_: Open = []
        for i, (s, cap) in enumerate(zip(slots, caps)):
            req = self._arms(s)
            cap = min(cap, cfg.max_gamma)
            if unmeasured and cap > 0:
                out[i] = Choice(unmeasured.pop(0), min(2, cap))
            elif probing and cap > 0:  # with the step's tree budget: the tree gate scores this step's mode
                d = probing.pop(0)
                out[i] = Choice(d, cap, nodes=self._nodes(d, trees))
            elif cap > 0 and st.cost.goodput.seen:
                open_.append((i, req, cap))
        return out, open_

    def _explore(self, out: list[Choice], open_: Open, explorer: int) -> None:
        """The explorer's gamma, drawn at random within its cap (out changed in place): with the chosen drafter
        or else the cheapest one, since exploring an expensive drafter would make the whole batch wait for its
        draft rounds. Ungated: the cost model must see N vary."""
        cap = next((cap for i, _, cap in open_ if i == explorer), 0)
        if not cap:
            return
        st = self.state
        name = out[explorer].drafter or min(self.settings.drafters, key=st.cost.draft_cost)
        if st.cost.measured(name):
            g = st.rng.randint(0, cap)
            out[explorer] = Choice(name, g) if g else NO_SPEC

    def _predictions(self, slots: list[int], out: list[Choice], open_: Open, explorer: int) -> tuple[Prediction, ...]:
        """What the joint choice's picks are predicted to gain at their means, uncalibrated (Calibration)."""
        past = self.state.past
        return tuple(Prediction(slots[i], c.drafter, len(slots),
                                chain_gain(c.gamma, req.arms[c.drafter].mean, past[c.drafter].value) - 1.0)
                     for i, req, _ in open_ if i != explorer and (c := out[i]).drafter is not None)

    def _could_pay(self, drafter: str, n: int, cap: int, verify_price: float, lam: float) -> bool:
        """Whether the drafter beats plain decoding at this batch size in the best case: every token
        accepted and its forwards shared by all n slots. A probe of one that cannot (the int8 copy of the
        target at 16 slots, where a verified row costs half a token) only slows the step it runs in.
        Every token accepted means every token proposed: a confidence gate would stop no chain, so the chain
        is priced whole (priced at the gate's go-on rate, a chain of 8 cost a gated drafter one verified
        token for the gain of all eight, and every drafter could pay at any batch size)."""
        cost = self.state.cost
        if cap <= 0 or not cost.goodput.seen:
            return False
        f, s = cost.draft_coeffs(drafter)
        spend = [chain_spend(g, None) for g in range(min(cap, self.settings.max_gamma) + 1)]
        return best_gamma(0.999, verify_price, lam * (s + f / max(n, 1)), spend)[1] > 0

    def _drained(self, slots: list[int], open_: Open, verify_price: float, lam: float, trees: bool,
                 trials: bool = False) -> dict[int, Choice]:
        """_joint, but in the drain a verdict against drafting is kept for DRAIN_RECHECK steps unless a slot left.
        trials: first trials or probes run this step, so something is learnt: no verdict is kept or reached."""
        st = self.state
        if not st.draining:
            return self._joint(open_, len(slots), verify_price, lam, trees)
        key = frozenset(slots)
        if trials:
            st.drain_no = None
        elif st.drain_no is not None and st.drain_no[0] == key and st.drain_no[1] < DRAIN_RECHECK:
            st.drain_no = (key, st.drain_no[1] + 1)
            return {}
        out = self._joint(open_, len(slots), verify_price, lam, trees)
        st.drain_no = None if out or trials else (key, 0)
        return out

    def _joint(self, open_: Open, n: int, verify_price: float, lam: float, trees: bool) -> dict[int, Choice]:
        """Each open slot's choice (see JointChoice) among n decoding slots, with its drafter's confidence floor."""
        if not open_:
            return {}
        st, drafters = self.state, self.settings.drafters
        evidence = sum(b.n - 2.0 for b in st.pooled.values())  # observations pooled over every drafter
        joint = JointChoice(
            caps=[cap for _, _, cap in open_],
            rates=[{d: self._rate(arm, st.pooled[d], evidence) for d, arm in req.arms.items()}
                   for _, req, _ in open_],
            means=[{d: arm.mean for d, arm in req.arms.items()} for _, req, _ in open_],
            coeffs={d: st.cost.draft_coeffs(d) for d in drafters},
            goes_on={d: st.pricing.goes_on(d) for d in drafters}, verify_price=verify_price, lam=lam,
            past={d: p.value for d, p in st.past.items() if p.rows},
            calibration={d: c.factor for (d, at), c in st.calibration.items() if at == n})
        open_slots = None  # the drain values the slowest slot, so every slot counts there (drain_bound instead)
        if st.draining:
            if joint.drain_bound() <= joint.n:
                return {}
        else:
            open_slots = joint.open_slots()
            if not open_slots:
                return {}
        picks = joint.solve(open_slots)
        if st.draining:
            picks = joint.drain_picks(picks)
            if joint.drain_value(picks) <= joint.n:
                return {}
        picks = self._joining(picks, joint)
        sharing = Counter(d for d, _ in picks if d is not None)
        return {i: Choice(d, g, st.pricing.floor(d, sharing[d], verify_price, lam), self._nodes(d, trees))
                for (i, _, _), (d, g) in zip(open_, picks) if d is not None}

    def _joining(self, picks: list[tuple[str | None, int]], joint: JointChoice) -> list[tuple[str | None, int]]:
        """The picks with each drafter held to CostModel.joining slots: those it gains most for keep it."""
        out = list(picks)
        for d in {d for d, _ in picks if d is not None}:
            mine = [k for k, (e, _) in enumerate(picks) if e == d]
            room = self.state.cost.joining(d)
            if len(mine) > room:
                for k in sorted(mine, key=lambda k: -joint.gain(k, d, picks[k][1]))[room:]:
                    out[k] = (None, 0)
        return out

    def _nodes(self, drafter: str, trees: bool) -> int:
        """The drafter's tree budget this step: 0 (a chain) unless the tree gate runs trees (`trees`)."""
        return self.settings.trees.get(drafter, 0) if trees else 0

    def _rate(self, arm: Beta, pooled: Beta, evidence: float) -> float:
        """The drafter-choosing rate: ucb, the request's mean plus a bonus for how little the pool and the
        request know of the drafter, among `evidence` observations pooled over every drafter (see the module
        docstring); thompson, a draw from the request's posterior."""
        if self.settings.mode == "thompson":
            return self.state.rng.betavariate(arm.alpha, arm.beta)
        bonus = self.settings.exploration * math.sqrt(math.log(evidence + 1.0) / (pooled.n + arm.n))
        return min(arm.mean + bonus, 0.999)

    # -- learn ------------------------------------------------------------------------------

    def learn(self, step: StepChoice, outcomes: list[Outcome], costs: StepCosts) -> None:
        st = self.state
        gained, decode_s = st.pricing.learn(outcomes, costs)
        if st.gate is not None and step.gate is not None:
            st.gate.observe(step.gate.slots, step.gate.mode, gained, decode_s)
        if st.tree_gates is not None and step.tree is not None:  # only a step that speculated has one
            n = step.tree.slots
            st.tree_gates[0 if n <= TREES_FIRST_SLOTS else 1].observe(n, step.tree.mode, gained, decode_s)
        predicted = {p.slot: p for p in step.predicted}
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
            st.past[o.choice.drafter].observe(o.choice.gamma, o.drafted, o.accepted)
            p = predicted.get(o.slot)
            if p is not None and p.drafter == o.choice.drafter:
                st.calibration.setdefault((p.drafter, p.slots), Calibration()).add(o.accepted, p.tokens)
            req = st.requests.get(o.slot)
            if req is not None:
                req.warm.pop(o.choice.drafter, None)  # its own evidence now: the prior stops following the pool
                req.arms[o.choice.drafter].observe(o.choice.gamma, accepted)
                req.own.setdefault(o.choice.drafter, Beta(0.0, 0.0)).observe(o.choice.gamma, accepted)
            st.pooled[o.choice.drafter].observe(o.choice.gamma, accepted)
        st.pulls.update({o.choice.drafter for o in outcomes if o.choice.drafter is not None and o.choice.gamma > 0})
