"""SPIN selection: a per-request bandit over heterogeneous drafters, with adaptive gamma.

Each request keeps, per drafter, a Beta posterior over the drafter's per-token acceptance
rate a. Acceptance is modelled as geometric: a verify that asked for g tokens and accepted k
is k successes plus one failure when k < g (a token the drafter did not propose counts as
a failure). The expected tokens a step gains with gamma g is
E(g, a) = (1 - a^(g + 1)) / (1 - a) (accepted drafts plus the recovered or bonus token).

Cost comes from an online model of measured stage times at the current batch size
(CostModel): verification costs c0 + c1 * N for N packed tokens, and drafter d costs c_d per
draft token. The batch's goodput is (sum of tokens gained) / (step time); it is maximised
when every slot picks argmax over (d, g) of E(g, a_d) - lam * marginal_cost(d, g), where lam
is the current goodput (tokens per second). That makes gamma 0 win as soon as verification
of extra tokens costs more than they bring, e.g. at large batch.

Confidence gate (drafters that know their own distribution: the model drafters). Gamma is
then a cap: the slot's chain also stops before a position where the product of the draft's
top probabilities falls below the cost of one more verified token, in tokens (lam times its
marginal cost). A token the draft is unsure of is thus never paid for, which is what lets
drafting pay at large batch, where every verified token costs the whole batch. The bandit
still judges the arm by what it asked for (a gated stop ends the chain like a rejection), and
prices it by what it proposes: a pooled per-drafter rate c at which a chain goes on to its
next token, so a gated chain of cap g costs E(g, c) - 1 verified tokens instead of g, and
E(g, c) - c^g draft positions (the position the gate stopped at was drafted too).

Warm start: new requests start from the pooled posterior of all requests so far, scaled
down to a few pseudo-observations, so short requests do not pay for exploration.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .policy import NO_SPEC, Choice, Outcome, Policy, StepCosts

PRIOR_STRENGTH = 6.0  # pseudo-tokens a warm start is worth
DEFAULT_RATE = 0.3  # prior acceptance before anything was pooled


def expected_gain(gamma: int, a: float) -> float:
    """Expected new tokens from one verify with gamma drafts at per-token acceptance a."""
    if gamma == 0:
        return 1.0
    a = min(max(a, 0.0), 0.999999)
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def chain_spend(gamma: int, goes_on: float | None) -> tuple[float, float]:
    """Expected (tokens proposed, draft positions run) of a chain capped at gamma.

    Ungated (goes_on None): gamma of each. Gated: the chain proposes k tokens with P(k >= i) =
    goes_on^i, and runs min(k + 1, gamma) positions, since the position its gate stopped at was
    drafted too.
    """
    if goes_on is None:
        return float(gamma), float(gamma)
    return expected_gain(gamma, goes_on) - 1.0, expected_gain(gamma, goes_on) - goes_on ** gamma


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


class Ema:
    def __init__(self, decay: float, init: float):
        self.decay = decay
        self.value = init
        self.seen = False

    def update(self, x: float) -> float:
        self.value = x if not self.seen else self.decay * self.value + (1 - self.decay) * x
        self.seen = True
        return self.value


class CostModel:
    """Stage times measured online: verify = c0 + c1 * tokens, draft_d = c_d * tokens."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._m = [0.0] * 5  # decayed sums: 1, N, N^2, t, N t
        self.draft_per_token: dict[str, Ema] = {}
        self.goodput = Ema(0.9, 0.0)  # tokens per second of the whole batch: tracks faster than costs

    def observe_verify(self, tokens: int, seconds: float) -> None:
        d = self.decay
        for i, v in enumerate((1.0, tokens, tokens * tokens, seconds, tokens * seconds)):
            self._m[i] = d * self._m[i] + v

    def observe_draft(self, drafter: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.draft_per_token.setdefault(drafter, Ema(self.decay, 0.0)).update(seconds / tokens)

    def verify_coeffs(self) -> tuple[float, float]:
        """(c0, c1): fixed seconds per step, seconds per packed token."""
        s1, sn, snn, st, snt = self._m
        if s1 == 0:
            return 0.0, 0.0
        var = snn / s1 - (sn / s1) ** 2
        if var <= 1e-3 * max(1.0, (sn / s1) ** 2):
            # too little spread in N to separate the two: assume all cost is per token, the
            # view least favourable to speculation; gamma exploration will reveal the rest
            return 0.0, st / sn
        c1 = max((snt / s1 - (sn / s1) * (st / s1)) / var, 0.0)
        c0 = max(st / s1 - c1 * sn / s1, 0.0)
        return c0, c1

    def draft_cost(self, drafter: str) -> float:
        """Seconds per draft token; infinite until measured (see BanditPolicy.choose)."""
        e = self.draft_per_token.get(drafter)
        return e.value if e is not None else math.inf

    def measured(self, drafter: str) -> bool:
        return drafter in self.draft_per_token


@dataclass
class RequestArms:
    arms: dict[str, Beta]
    steps: int = 0


@dataclass
class BanditPolicy(Policy):
    """`ucb` (optimistic acceptance), `thompson` (sampled acceptance), `round_robin`, `fixed` (the one
    drafter given, at max_gamma: the policy only prices its confidence floor), or `assigned` (like
    `fixed`, but each request runs the drafter `assign` maps its id to, or none)."""

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
    assign: dict[str, str | None] = field(default_factory=dict)  # mode `assigned`: request id -> drafter

    def __post_init__(self) -> None:
        if self.mode not in ("ucb", "thompson", "round_robin", "fixed", "assigned"):
            raise ValueError(f"unknown bandit mode {self.mode!r}")
        self.rng = random.Random(self.seed)
        self.pooled = {d: Beta(1.0, 1.0) for d in self.drafters}
        # per gated drafter: proposed tokens (successes) against chains cut short (failures)
        self.goes_on = {d: Beta(1.0, 1.0) for d in self.drafters if d in self.gated}
        self._rr = 0
        self._slot_drafter: dict[int, str | None] = {}  # mode `assigned`: the drafter of each slot's request

    # -- per-request state ----------------------------------------------------------------

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        """Warm start: the pooled posterior, shrunk to PRIOR_STRENGTH pseudo-tokens."""
        self._slot_drafter[slot] = self.assign.get(req_id)  # mode `assigned`; None: no drafting
        arms = {}
        for d, b in self.pooled.items():
            mean = b.mean if b.n > 2.0 else DEFAULT_RATE
            arms[d] = Beta(mean * PRIOR_STRENGTH, (1 - mean) * PRIOR_STRENGTH)
        self.requests[slot] = RequestArms(arms)

    # -- select -----------------------------------------------------------------------------

    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        if self.mode == "round_robin":
            self._rr += 1
            return [Choice(self.drafters[(self._rr + s) % len(self.drafters)], min(self.max_gamma, c)) if c else NO_SPEC
                    for s, c in zip(slots, caps)]
        _, c1 = self.cost.verify_coeffs()
        lam = self.cost.goodput.value
        if self.mode == "fixed":  # one drafter at the configured gamma; only its confidence floor is priced
            return [self._fixed(self.drafters[0], cap, c1, lam) for cap in caps]
        if self.mode == "assigned":
            return [self._fixed(self._slot_drafter.get(s), cap, c1, lam) for s, cap in zip(slots, caps)]
        # a drafter whose cost is still unknown is tried by one slot, with a short draft: trying
        # it on every slot at once could stall the whole batch behind an expensive drafter
        unmeasured = [d for d in self.drafters if not self.cost.measured(d)]
        explorer = self.rng.randrange(len(slots)) if slots and self.rng.random() < self.gamma_exploration else -1
        out = []
        for i, (s, cap) in enumerate(zip(slots, caps)):
            req = self.requests.get(s)
            if req is None:
                self.on_admit(s)
                req = self.requests[s]
            req.steps += 1
            cap = min(cap, self.max_gamma)
            if unmeasured and cap > 0:
                out.append(Choice(unmeasured.pop(0), min(2, cap)))
            else:
                out.append(self._best(req, cap, c1, lam, explore=i == explorer))
        return out

    def _fixed(self, name: str | None, cap: int, c1: float, lam: float) -> Choice:
        """`name` at the configured gamma, with its priced confidence floor once its cost is known."""
        if name is None or cap <= 0:
            return NO_SPEC
        known = self.cost.goodput.seen and self.cost.measured(name)
        floor = self._floor(name, self._per_token(name, c1, lam)) if known else 0.0
        return Choice(name, min(cap, self.max_gamma), floor)

    def _rate(self, arm: Beta, steps: int) -> float:
        if self.mode == "thompson":
            return self.rng.betavariate(arm.alpha, arm.beta)
        bonus = self.exploration * math.sqrt(math.log(steps + 1.0) / arm.n)
        return min(arm.mean + bonus, 0.999)

    def _best(self, req: RequestArms, cap: int, c1: float, lam: float, explore: bool = False) -> Choice:
        if cap <= 0 or not self.cost.goodput.seen:
            return NO_SPEC
        # the drafter: best value at its optimistic (ucb) or sampled (thompson) acceptance rate
        drafter, top = None, -math.inf
        for d, arm in req.arms.items():
            value, _ = self._best_gamma(self._rate(arm, req.steps), *self._prices(d, c1, lam), cap, self._goes_on(d))
            if value > top:
                drafter, top = d, value
        # its gamma, 0 included: from the posterior mean, so optimism does not buy speculation
        mean = req.arms[drafter].mean
        value, g = self._best_gamma(mean, *self._prices(drafter, c1, lam), cap, self._goes_on(drafter))
        best = Choice(drafter, g, self._floor(drafter, self._per_token(drafter, c1, lam))) if g else NO_SPEC
        if explore:
            # vary gamma only, with the chosen drafter or else the cheapest one: exploring an
            # expensive drafter would make the whole batch wait for its draft rounds
            name = best.drafter or min(self.drafters, key=self.cost.draft_cost)
            if not self.cost.measured(name):
                return best
            g = self.rng.randint(0, cap)
            return Choice(name, g) if g else NO_SPEC  # ungated: the cost model must see N vary
        return best

    def _per_token(self, drafter: str, c1: float, lam: float) -> float:
        """What one more drafted-and-verified token costs, in tokens of the batch's goodput."""
        return sum(self._prices(drafter, c1, lam))

    def _prices(self, drafter: str, c1: float, lam: float) -> tuple[float, float]:
        """(one verified token, one draft position), in tokens of the batch's goodput."""
        return lam * c1, lam * self.cost.draft_cost(drafter)

    def _goes_on(self, drafter: str) -> float | None:
        """For a gated drafter, the pooled rate at which its chain proposes its next token; None: ungated."""
        b = self.goes_on.get(drafter)
        return None if b is None else b.mean

    def _floor(self, drafter: str, per_token: float) -> float:
        """The confidence gate for this drafter: a position must be worth its cost (0: ungated)."""
        return min(per_token, 1.0) if drafter in self.goes_on else 0.0

    @staticmethod
    def _best_gamma(a: float, verify_price: float, draft_price: float, cap: int,
                    goes_on: float | None = None) -> tuple[float, int]:
        """max over g in 0..cap of E(g, a) minus the price of the tokens verified and the positions
        drafted (chain_spend), and its g (gamma 0 is worth 1). A chain the gate stops at once
        proposes nothing but still costs a draft forward."""
        best_value, best_g = 1.0, 0
        for g in range(1, cap + 1):
            proposed, ran = chain_spend(g, goes_on)
            value = expected_gain(g, a) - verify_price * proposed - draft_price * ran
            if value > best_value:
                best_value, best_g = value, g
        return best_value, best_g

    # -- learn ------------------------------------------------------------------------------

    def _decode_seconds(self, outcomes: list[Outcome], costs: StepCosts) -> float:
        """The step's time without its prefill chunks: goodput is measured on decoding alone.

        Prefill tokens riding in the same forward would otherwise make every decode token look
        cheaper to skip than it is (their cost is charged at the modelled c1 per token).
        """
        c0, c1 = self.cost.verify_coeffs()
        decode_tokens = sum(o.drafted + 1 for o in outcomes)
        verify = costs.stage_s.get("verify", 0.0)
        if c1 > 0 and costs.verify_tokens > decode_tokens:
            verify = min(verify, c0 + c1 * decode_tokens)
        return verify + sum(v for k, v in costs.stage_s.items() if k != "verify")

    def learn(self, outcomes: list[Outcome], costs: StepCosts) -> None:
        if costs.verify_tokens:
            self.cost.observe_verify(costs.verify_tokens, costs.stage_s.get("verify", 0.0))
        for d, tokens in costs.draft_tokens.items():
            self.cost.observe_draft(d, tokens, costs.draft_s.get(d, 0.0))
        gained = sum(o.accepted + 1 for o in outcomes)
        decode_s = self._decode_seconds(outcomes, costs)
        if gained and decode_s > 0:
            self.cost.goodput.update(gained / decode_s)
        for o in outcomes:
            if o.choice.drafter is None or o.choice.gamma == 0:
                continue
            # Judged against what was asked: a drafter that proposes fewer tokens than gamma (an
            # n-gram drafter with no match proposes none) stops the chain there, like a rejection.
            # Counting only proposed tokens would rate a drafter that rarely proposes as if it
            # always did.
            req = self.requests.get(o.slot)
            if req is not None:
                req.arms[o.choice.drafter].observe(o.choice.gamma, o.accepted)
            self.pooled[o.choice.drafter].observe(o.choice.gamma, o.accepted)
            if o.choice.min_prob > 0 and o.choice.drafter in self.goes_on:
                self.goes_on[o.choice.drafter].observe(o.choice.gamma, o.drafted)
