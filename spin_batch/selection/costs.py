"""The cost model: what a step costs, learnt online from the measured StepCosts.

Verification costs c0 + c1 * N for N packed tokens, and drafter d costs f_d per forward plus s_d
per draft position (one forward advances all of d's slots, so a slot drafting with others shares
their forwards). The batch's goodput lam (tokens per second) turns seconds into tokens: a verified
token is worth lam * c1 of them. Pricing adds what the confidence gate needs: per gated drafter,
the pooled rate at which its chain goes on to its next token, and the floor a draft position must
clear (the cost of one more verified token, in tokens). The measurements behind these rules:
docs/selection.md and BENCHMARKS.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from .policy import Outcome, StepCosts

DECODE_FIT_STEPS = 4.0  # decayed weight of decode steps the verify fit needs before it drops prefill steps


def decay_into(sums: list[float], values: tuple[float, ...], decay: float) -> None:
    """sums[i] = decay * sums[i] + values[i]: the running sums of a decayed least-squares fit."""
    for i, v in enumerate(values):
        sums[i] = decay * sums[i] + v


class DraftCost:
    """One drafter's time per call: f seconds per forward plus s per draft position, fitted online.

    A forward advances every slot drafting with this drafter at once, so a slot that joins others
    already drafting to its depth pays only s per position, while one drafting alone (or deeper
    than the rest) pays f for each forward it adds. Fitted by decayed least squares over
    (forwards, positions). Where the two cannot be told apart (one slot: forwards == positions; or
    always the same number of slots), all of the time is put on forwards: that prices the
    observed batches exactly and takes joining as free, an optimism the next shared steps correct.
    The other way round (all on positions) would price a slot that shares as if it drafted alone,
    and a drafter first tried by one slot would never look worth sharing, so never be shared.
    """

    def __init__(self, decay: float):
        self.decay = decay
        self._m = [0.0] * 5  # decayed sums: F^2, F P, P^2, F t, P t
        self.widest = 1.0  # the most draft positions one forward has run (slots drafting together): see Joining

    def observe(self, forwards: int, positions: int, seconds: float) -> None:
        f, p = float(forwards), float(positions)
        if f > 0:
            self.widest = max(self.widest, p / f)
        decay_into(self._m, (f * f, f * p, p * p, f * seconds, p * seconds), self.decay)

    def coeffs(self) -> tuple[float, float]:
        """(seconds per forward, seconds per draft position)."""
        ff, fp, pp, ft, pt = self._m
        det = ff * pp - fp * fp
        if ff == 0:
            return 0.0, 0.0
        if det > 1e-3 * ff * pp:
            f = (pp * ft - fp * pt) / det
            s = (ff * pt - fp * ft) / det
            if f >= 0 and s >= 0:
                return f, s
            if f < 0:  # clipped: all of the time on positions
                return 0.0, pt / pp
        return ft / ff, 0.0

    def snapshot(self) -> dict:
        return {"sums": list(self._m), "widest": self.widest}

    def restore(self, state: dict, weight: float) -> None:
        """What an earlier run fitted, its sums scaled by `weight` (the fit is the same; new steps move it sooner)."""
        self._m = [weight * float(v) for v in state["sums"]]
        self.widest = float(state["widest"])


class RatioEma:
    """Goodput over the recent steps as a whole: sum(decay^i * tokens) / sum(decay^i * seconds).

    A decayed mean of per-step ratios would weigh a short step as much as a long one, and the short steps
    of a cheap draft accepted in full gain the most per second: it would overprice every costly draft
    forward."""

    def __init__(self, decay: float):
        self.decay = decay
        self._tokens = self._seconds = 0.0
        self.seen = False

    @property
    def value(self) -> float:
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self._tokens = self.decay * self._tokens + tokens
        self._seconds = self.decay * self._seconds + seconds
        self.seen = True

    def snapshot(self) -> list[float]:
        return [self._tokens, self._seconds]

    def restore(self, state: list[float], weight: float) -> None:
        self._tokens, self._seconds = weight * float(state[0]), weight * float(state[1])
        self.seen = self._seconds > 0


class CostModel:
    """Stage times measured online: verify = c0 + c1 * tokens; drafter d = f_d * forwards + s_d * positions.

    The verify line is fitted on decode steps (no prefill chunk in the forward) once it has a few:
    a long prefill chunk costs less per token than the last few tokens of a decode step, and its
    leverage would pull c1 down to the prefill rate, so speculation would look cheaper than it is
    at large batch. Until then, every step counts.
    """

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._all = [0.0] * 5  # decayed sums over all steps: 1, N, N^2, t, N t
        self._decode = [0.0] * 5  # the same over decode steps only
        self.drafts: dict[str, DraftCost] = {}
        self.goodput = RatioEma(0.9)  # tokens per second of the whole batch: tracks faster than costs
        # the same per number of decoding slots: a second is worth what the batch makes of it at its size now
        self.goodput_at: dict[int, RatioEma] = {}

    def observe_verify(self, tokens: int, seconds: float, prefill_tokens: int = 0) -> None:
        for sums in (self._all,) if prefill_tokens else (self._all, self._decode):
            decay_into(sums, (1.0, tokens, tokens * tokens, seconds, tokens * seconds), self.decay)

    def observe_draft(self, drafter: str, positions: int, seconds: float, forwards: int | None = None) -> None:
        """forwards None: one per position (a drafter that does not batch its slots)."""
        if positions > 0:
            self.drafts.setdefault(drafter, DraftCost(self.decay)).observe(
                positions if forwards is None else forwards, positions, seconds)

    def verify_coeffs(self) -> tuple[float, float]:
        """(c0, c1): fixed seconds per step, seconds per packed token."""
        s1, sn, snn, st, snt = self._decode if self._decode[0] >= DECODE_FIT_STEPS else self._all
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

    def draft_coeffs(self, drafter: str) -> tuple[float, float]:
        """(seconds per forward, seconds per position); infinite until measured (see BanditPolicy.choose)."""
        e = self.drafts.get(drafter)
        return e.coeffs() if e is not None else (math.inf, math.inf)

    def draft_cost(self, drafter: str, sharing: float = 1.0) -> float:
        """Seconds per draft position when `sharing` slots draft together with this drafter."""
        f, s = self.draft_coeffs(drafter)
        return f / max(sharing, 1.0) + s

    def measured(self, drafter: str) -> bool:
        return drafter in self.drafts

    def joining(self, drafter: str) -> int:
        """How many slots may draft with this drafter at once: twice the most its forwards have run together.
        Until forwards of many slots are measured, its fit puts their cost on forwards and takes joining as
        free (DraftCost), so a costly drafter measured on one slot would be chosen for every slot at once.
        Doubling, each step measures the next width before the batch relies on it."""
        e = self.drafts.get(drafter)
        return 2 * max(int(e.widest), 1) if e is not None else 1

    def snapshot(self) -> dict:
        """What the model has fitted, as JSON data (selection/memory.py keeps it for the next run)."""
        return {"all": list(self._all), "decode": list(self._decode),
                "drafts": {d: e.snapshot() for d, e in self.drafts.items()},
                "goodput": self.goodput.snapshot(), "goodput_at": {str(n): g.snapshot() for n, g in self.goodput_at.items()}}

    def restore(self, state: dict, weight: float) -> None:
        """Start from an earlier run's fit, every sum scaled by `weight`: the same lines and goodputs, worth
        `weight` of the steps they came from, so this run's own steps soon outweigh them."""
        self._all = [weight * float(v) for v in state["all"]]
        self._decode = [weight * float(v) for v in state["decode"]]
        self.drafts = {}
        for d, e in state["drafts"].items():
            self.drafts[d] = DraftCost(self.decay)
            self.drafts[d].restore(e, weight)
        self.goodput.restore(state["goodput"], weight)
        self.goodput_at = {}
        for n, g in state["goodput_at"].items():
            self.goodput_at[int(n)] = RatioEma(0.9)
            self.goodput_at[int(n)].restore(g, weight)

    def decode_seconds(self, outcomes: list[Outcome], costs: StepCosts) -> float:
        """The step's time without its prefill chunks: goodput is measured on decoding alone.

        Prefill tokens riding in the same forward would otherwise make every decode token look
        cheaper to skip than it is (their cost is charged at the modelled c1 per token).
        """
        c0, c1 = self.verify_coeffs()
        # the prefill chunks' tokens, not the decoding slots' rows: a token tree verifies more rows than
        # its Outcome's drafted (its depth), and they are the decoding's cost
        decode_tokens = costs.verify_tokens - costs.prefill_tokens
        verify = costs.stage_s.get("verify", 0.0)
        if c1 > 0 and costs.prefill_tokens:
            verify = min(verify, c0 + c1 * decode_tokens)
        return verify + sum(v for k, v in costs.stage_s.items() if k != "verify")

    def learn(self, outcomes: list[Outcome], costs: StepCosts) -> tuple[int, float]:
        """Fit the step's stage times and update the goodput; returns (tokens gained, decode seconds)."""
        if costs.verify_tokens:
            self.observe_verify(costs.verify_tokens, costs.stage_s.get("verify", 0.0), costs.prefill_tokens)
        for d, positions in costs.draft_tokens.items():
            self.observe_draft(d, positions, costs.draft_s.get(d, 0.0), costs.draft_forwards.get(d))
        gained = sum(o.accepted + 1 for o in outcomes)
        decode_s = self.decode_seconds(outcomes, costs)
        if gained and decode_s > 0:
            self.goodput.add(gained, decode_s)
            self.goodput_at.setdefault(len(outcomes), RatioEma(0.9)).add(gained, decode_s)
        return gained, decode_s

    def lam(self, slots: int | None = None) -> float:
        """The goodput (tokens per second) measured at `slots` decoding slots, else over all steps.

        A second is worth what the batch makes of it at its size now: one goodput for the whole run would
        price the job's tail of 1 or 2 slots at the full batch's rate, where a costly, accurate draft looks
        far dearer than it is."""
        at = self.goodput_at.get(slots) if slots is not None else None
        return at.value if at is not None else self.goodput.value


class Pricing:
    """The cost model with the confidence gate's prices: what the bandit and the priced fixed policies share.

    A gated drafter (one that honours Choice.min_prob) is judged by what was asked of it but priced by
    what it proposes: a pooled rate at which its chain goes on to its next token, counted as proposed
    tokens against chains cut short (a Beta(1, 1) posterior). Its floor is what one more verified token
    and draft position cost, in tokens of goodput, at most 1.
    """

    def __init__(self, gated: Iterable[str], cost: CostModel | None = None):
        self.cost = cost if cost is not None else CostModel()
        self._chains = {d: [1.0, 1.0] for d in gated}  # per gated drafter: [tokens proposed, chains cut short]

    def prices(self, slots: int | None = None) -> tuple[float, float]:
        """(verify_price, lam): what a verified token costs in tokens, and the goodput (tokens per second) at
        `slots` decoding slots (CostModel.lam)."""
        c0, c1 = self.cost.verify_coeffs()
        lam = self.cost.lam(slots)
        if slots and c0 + c1 > 0:
            # plain decoding is always there to choose, so the best goodput is at least its rate: a goodput
            # that the batch's own costly drafts held below it would price their seconds too cheap
            lam = max(lam, slots / (c0 + c1 * slots))
        return lam * c1, lam

    def goes_on(self, drafter: str) -> float | None:
        """For a gated drafter, the pooled rate at which its chain proposes its next token; None: ungated."""
        counts = self._chains.get(drafter)
        return None if counts is None else counts[0] / (counts[0] + counts[1])

    def known(self, drafter: str) -> bool:
        """Whether the goodput and the drafter's cost are measured, so its floor can be priced."""
        return self.cost.goodput.seen and self.cost.measured(drafter)

    def floor(self, drafter: str, sharing: float, verify_price: float, lam: float) -> float:
        """The drafter's confidence floor when `sharing` slots draft with it: a position must be worth its
        cost (0: ungated)."""
        if drafter not in self._chains:
            return 0.0
        return min(verify_price + lam * self.cost.draft_cost(drafter, sharing), 1.0)

    def snapshot(self) -> dict:
        return {"cost": self.cost.snapshot(), "chains": {d: list(c) for d, c in self._chains.items()}}

    def restore(self, state: dict, weight: float) -> None:
        """An earlier run's costs and chain lengths (for the gated drafters this policy has), scaled by `weight`."""
        self.cost.restore(state["cost"], weight)
        for d, (proposed, cut) in state["chains"].items():
            if d in self._chains:  # the same rate, scaled no lower than the prior's one count each
                k = min(max(weight, 1.0 / max(min(proposed, cut), 1e-9)), 1.0)
                self._chains[d] = [k * float(proposed), k * float(cut)]

    def learn(self, outcomes: list[Outcome], costs: StepCosts) -> tuple[int, float]:
        """CostModel.learn, and each gated chain's length; returns (tokens gained, decode seconds)."""
        gained, decode_s = self.cost.learn(outcomes, costs)
        for o in outcomes:
            d = o.choice.drafter
            if d is not None and o.choice.gamma > 0 and o.choice.min_prob > 0 and d in self._chains:
                self._chains[d][0] += min(o.drafted, o.choice.gamma)  # not the tokens past gamma (DraftRequest.room)
                self._chains[d][1] += 1.0 if o.drafted < o.choice.gamma else 0.0
        return gained, decode_s
