"""The joint choice: every open slot's drafter and gamma at one step, chosen together by goodput.

Acceptance is modelled as geometric: at per-token acceptance a, a verify with gamma g gains
E(g, a) = (1 - a^(g + 1)) / (1 - a) tokens (accepted drafts plus the recovered or bonus token).
The batch's goodput is (sum of tokens gained) / (step time); it is maximised by the choices that
maximise the sum over slots of E(g, a_d) - lam * cost, where lam is the current goodput (tokens
per second) and the cost counts each drafter's forwards once. That makes gamma 0 win as soon as
verification of extra tokens costs more than they bring, e.g. at large batch, and it keeps the
slots that draft on few drafters: a batch split over drafters pays every drafter's forwards.

A gated chain (the confidence gate, see costs.Pricing) of cap g at go-on rate c costs E(g, c) - 1
verified tokens instead of g, and E(g, c) - c^g draft positions (the position the gate stopped at
was drafted too). In the drain a choice is worth its slowest slot's gain (JointChoice.drain_value).

chain_gain adds what the model alone misses: the tokens a drafter was measured to gain past gamma
(DraftRequest.room), and a per-drafter calibration of the predicted draft tokens by what the joint
choice's picks made at this batch size (bandit.Calibration).
"""

from __future__ import annotations

import math

JOINT_PASSES = 3  # best-response passes over the batch (JointChoice)
# tokens a slot's draft must gain beyond plain decoding: the work a draft costs that no line of the cost
# model prices (its request, the accept rule, the commit), so a choice the model calls a tie is not drafted
DRAFT_MARGIN = 0.05


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


NO_PAST = (0.0, 0.0)


def chain_gain(g: int, a: float, past: tuple[float, float] = NO_PAST, calibration: float = 1.0) -> float:
    """Expected new tokens from a chain of g at rate a: E(g, a), plus a^g times the tokens the drafter was
    measured to gain past gamma in a whole chain (past[0]); its drafts' share (all but the one token any
    verify makes) scaled by the drafter's calibration (realized against predicted, see bandit.Calibration)."""
    return 1.0 + calibration * (expected_gain(g, a) + a ** g * past[0] - 1.0)


def chain_value(g: int, a: float, verify_price: float, position_price: float, spend: tuple[float, float],
                past: tuple[float, float] = NO_PAST, calibration: float = 1.0) -> float:
    """chain_gain minus the price of the tokens verified and the draft positions run (spend: chain_spend(g, ...)).

    past: the drafter's tokens past gamma (DraftRequest.room), as measured: (accepted past gamma in a step
    whose gamma tokens were all accepted, proposed past gamma per step). They gain a^g times the first and
    cost the verified rows of the second."""
    proposed, ran = spend
    return chain_gain(g, a, past, calibration) - verify_price * (proposed + past[1]) - position_price * ran


def best_gamma(a: float, verify_price: float, position_price: float, spend: list[tuple[float, float]],
               forward_price: float = 0.0, depth: float = 0.0, past: tuple[float, float] = NO_PAST,
               calibration: float = 1.0) -> tuple[float, int]:
    """max over g in 0..len(spend) - 1 of E(g, a) minus the price of what the chain spends, and its g.

    spend[g] is chain_spend(g, ...): the tokens verified and the draft positions run, each position
    priced at position_price, plus forward_price for each forward the chain adds beyond `depth` (the
    positions other slots of its drafter run anyway). Gamma 0 is worth 1. A chain the gate stops at
    once proposes nothing but still costs a draft forward. past, calibration: chain_value's.
    """
    best_value, best_g = 1.0, 0
    # chain_value inlined, the same operations in the same order (the joint choice calls this most)
    clamped = min(max(a, 0.0), 0.999999)
    past_gain, past_rows = past
    for g in range(1, len(spend)):
        proposed, ran = spend[g]
        gain = 1.0 + calibration * ((1.0 - clamped ** (g + 1)) / (1.0 - clamped) + a ** g * past_gain - 1.0)
        value = (gain - verify_price * (proposed + past_rows) - position_price * ran
                 - forward_price * max(ran - depth, 0.0))
        if value > best_value + (DRAFT_MARGIN if best_g == 0 else 0.0):
            best_value, best_g = value, g
    return best_value, best_g


class JointChoice:
    """Every open slot's (drafter, gamma) at one step, chosen together: a drafter's slots share its forwards.

    The batch's value V sums, over slots, E(g, a) minus the price of the tokens the slot verifies
    and of the draft positions it runs; and takes off, per drafter, the price of its forwards: as
    many as its deepest slot runs. A slot's drafter is the best at its optimistic (ucb) or sampled
    (thompson) rate; its gamma the best at the posterior mean, so optimism does not buy speculation.
    Where that favourite does not pay at its mean, the slot takes the best drafter at the mean.

    1. Every slot chooses as if each drafter's forwards were shared by all the slots.
    2. Best responses: each slot in turn takes its best choice given the others', which prices
       exactly the forwards it adds (none where another slot of its drafter drafts as deep).
    3. Closing: best responses cannot empty a drafter that two slots share, even where moving them
       all would pay; each drafter in use is closed in turn (its slots choose again among the
       others, at the posterior means) and stays closed where that raises V at the means (see
       _total). Choosing again at the optimistic rates moved a slot from one little-known cheap
       draft to the next, worth still less at its mean, so the first stayed where the int8 copy
       was worth far more.
    """

    def __init__(self, caps: list[int], rates: list[dict[str, float]], means: list[dict[str, float]],
                 coeffs: dict[str, tuple[float, float]], goes_on: dict[str, float | None], verify_price: float,
                 lam: float, past: dict[str, tuple[float, float]] | None = None,
                 calibration: dict[str, float] | None = None):
        """past: per drafter whose chains run past gamma, its measured tokens past gamma; calibration: per
        drafter, its realized draft tokens against those predicted at this batch size (chain_gain; 1 if absent)."""
        self.caps, self.rates, self.means, self.lam, self.verify_price = caps, rates, means, lam, verify_price
        self.coeffs = coeffs
        self.past = past or {}
        self.calibration = calibration or {}
        self.spend = {d: [chain_spend(g, c) for g in range(max(caps) + 1)] for d, c in goes_on.items()}
        self.n = len(caps)
        self._memo: dict[tuple, object] = {}  # _best, _pays, gain, _value by their arguments: passes repeat most
        self._open: set[int] | None = None  # the slots solve() gives best responses to (its open_); None: every slot

    def solve(self, open_: set[int] | None = None) -> list[tuple[str | None, int]]:
        """Every slot's (drafter, gamma); open_: the slots that could draft at all (open_slots), the others
        plain decoding without a best response of their own (None: every slot)."""
        self._open = open_
        everyone = set(self.coeffs)
        picks = [(None, 0)] * self.n
        for k in range(self.n):
            picks[k] = self._respond(k, picks, everyone, shared=True)
        picks = self._settle(picks, everyone)
        value = self._total(picks)
        for d in sorted({d for d, _ in picks if d is not None}, key=lambda d: -self.coeffs[d][0]):
            if self.coeffs[d][0] <= 0 or all(p[0] != d for p in picks):
                continue  # free forwards (an n-gram matcher): nothing to save by closing it
            allowed = everyone - {d}
            trial = [(None, 0) if p[0] == d else p for p in picks]
            trial = self._settle(trial, allowed, exploit=True)
            trial_value = self._total(trial)
            if trial_value > value:
                picks, value, everyone = trial, trial_value, allowed
        return picks

    def open_slots(self) -> set[int]:
        """The slots that could draft in solve(): a slot is open where some drafter's chain beats plain decoding
        at its posterior mean and cap with no forward of its own to pay (another slot's forwards carry it).
        Each of these only raises a chain's value, so a closed slot answers plain decoding to every pick of the
        others, and where none is open solve() need not run. Checked first for the batch as a whole (the
        highest mean, the largest cap): the common case at large batch, where nothing could pay."""
        cap = max(self.caps)
        if not any(self._pays(d, max(means[d] for means in self.means), cap) for d in self.coeffs):
            return set()
        return {k for k in range(self.n) if any(self._pays(d, self.means[k][d], self.caps[k]) for d in self.coeffs)}

    def _pays(self, d: str, a: float, cap: int) -> bool:
        """Whether a chain of drafter d at rate a and cap beats plain decoding with no forward of its own to pay."""
        key = ("pays", d, a, cap)
        if key not in self._memo:
            self._memo[key] = best_gamma(a, self.verify_price, self.lam * self.coeffs[d][1], self.spend[d][: cap + 1],
                                         past=self.past.get(d, NO_PAST), calibration=self.calibration.get(d, 1.0))
        return self._memo[key][1] > 0

    def drain_bound(self) -> float:
        """An upper bound on drain_value over the choices that draft for every slot (any other is worth at
        most n): each slot gains its best, for at least one priced token of the cheapest drafter. At or under
        n, solve() is not worth running in the drain."""
        best = min(max(chain_gain(cap, a, self.past.get(d, NO_PAST), self.calibration.get(d, 1.0))
                       for d, a in means.items()) for cap, means in zip(self.caps, self.means))
        least = min(self.verify_price * spend[1][0] for spend in self.spend.values())
        return self.n * (best - least)

    def drain_picks(self, picks: list[tuple[str | None, int]]) -> list[tuple[str | None, int]]:
        """The drain's choice: `picks` (solve's, made for the sum of the slots' gains) or every slot on one
        drafter at its gamma for the slot's mean, whichever drain_value rates highest. solve may leave the
        slowest slot to a cheap draft, or to none, where all slots on one drafter would pay: at 4 slots in
        the demo job's drain, 17 steps drafted nothing where every slot on the int8 copy gained 6 tokens."""
        candidates = [picks]
        for d in sorted(self.coeffs):
            uniform = [(d, self._best(k, d, self.means[k][d], 0.0, True)[1]) for k in range(self.n)]
            if all(g > 0 for _, g in uniform):
                candidates.append(uniform)
            candidates += self._paced(d)
        return max(candidates, key=self.drain_value)

    def _paced(self, d: str) -> list[list[tuple[str | None, int]]]:
        """Every slot on drafter d, drafting only as deep as it needs to keep pace with the slowest: per chain
        length g, the least slot's gain with every slot at g (its cap where shorter) is the pace, and each slot
        takes the shortest chain that reaches it. In the drain only the least gain counts, so a slot drafting
        deeper than that pays for rows that shorten nothing; and at each slot's own best gamma, one request
        whose mean came out low (a rejection in its first steps, at the few pseudo-observations of a small job)
        left the others' costs whole against its small gain, so the drain drafted nothing, learnt nothing, and
        kept it so (simulated, 8 slots all at rate 0.9: at most 3 of the last 20 steps drafted in each of 8
        seeds, against all of them paced)."""
        gains = [[self.gain(k, d, g) for g in range(self.caps[k] + 1)] for k in range(self.n)]
        out = []
        for g in range(1, max(self.caps) + 1):
            pace = min(row[min(g, len(row) - 1)] for row in gains)
            if pace <= 1.0:
                continue
            out.append([(d, next((j for j, v in enumerate(row) if v >= pace), len(row) - 1)) for row in gains])
        return out

    def drain_value(self, picks: list[tuple[str | None, int]]) -> float:
        """V in the drain, at the posterior means: n times the least slot's expected gain, less the prices.

        Compare with n (every slot decoding plainly, worth one token each).
        """
        gains = [1.0 if d is None else self.gain(k, d, g) for k, (d, g) in enumerate(picks)]
        prices = sum(gain - (1.0 if d is None else self._value(k, d, g))
                     for k, ((d, g), gain) in enumerate(zip(picks, gains)))
        prices += sum(self.lam * self.coeffs[d][0] * depth for d, depth in self._depths(picks).items())
        return self.n * min(gains) - prices

    def _settle(self, picks: list[tuple[str | None, int]], allowed: set[str],
                exploit: bool = False) -> list[tuple[str | None, int]]:
        picks = list(picks)
        for _ in range(JOINT_PASSES):
            changed = False
            for k in range(self.n):
                pick = self._respond(k, picks, allowed, exploit=exploit)
                changed |= pick != picks[k]
                picks[k] = pick
            if not changed:
                break
        return picks

    def _respond(self, k: int, picks: list[tuple[str | None, int]], allowed: set[str],
                 shared: bool = False, exploit: bool = False) -> tuple[str | None, int]:
        """Slot k's best (drafter, gamma) given the others' picks; shared: forwards split n ways instead;
        exploit: the drafter too is chosen at the posterior means (the closing trials, see solve)."""
        if self._open is not None and k not in self._open:
            return None, 0
        depth = {} if shared else self._depths(picks, skip=k)

        def best_at(rates: dict[str, float]) -> tuple[str | None, int]:
            """The allowed drafter worth most at these rates (None: none allowed), and its gamma."""
            top, best, best_g = -math.inf, None, 0
            for d in rates:
                if d in allowed:
                    value, g = self._best(k, d, rates[d], depth.get(d, 0.0), shared)
                    if value > top:
                        top, best, best_g = value, d, g
            return best, best_g

        favourite, _ = best_at(self.means[k] if exploit else self.rates[k])
        if favourite is None:
            return None, 0
        _, g = self._best(k, favourite, self.means[k][favourite], depth.get(favourite, 0.0), shared)
        if g:
            return favourite, g
        # The optimistic favourite does not pay at its mean: exploit the best drafter at the mean
        # instead of not drafting at all (the favourite is still tried wherever its mean pays).
        d, g = best_at(self.means[k])  # gamma 0 unless it pays
        return (d, g) if g else (None, 0)

    def _best(self, k: int, d: str, a: float, depth: float, shared: bool) -> tuple[float, int]:
        key = (self.caps[k], d, a, depth, shared)  # slot k matters only by its cap: slots alike share an entry
        if key not in self._memo:
            f, s = self.coeffs[d]
            spend = self.spend[d][: self.caps[k] + 1]
            past, calibration = self.past.get(d, NO_PAST), self.calibration.get(d, 1.0)
            self._memo[key] = (best_gamma(a, self.verify_price, self.lam * (s + f / self.n), spend, past=past,
                                          calibration=calibration) if shared else
                               best_gamma(a, self.verify_price, self.lam * s, spend, self.lam * f, depth, past,
                                          calibration))
        return self._memo[key]

    def gain(self, k: int, d: str, g: int) -> float:
        """Slot k's expected tokens from (d, g) at the posterior mean (chain_gain)."""
        a = self.means[k][d]
        key = ("gain", d, a, g)  # slots at the same mean (the pool's, until they draft) share it
        if key not in self._memo:
            self._memo[key] = chain_gain(g, a, self.past.get(d, NO_PAST), self.calibration.get(d, 1.0))
        return self._memo[key]

    def _value(self, k: int, d: str, g: int) -> float:
        """chain_value of slot k's pick (d, g) at the posterior mean, its forwards aside."""
        a = self.means[k][d]
        key = ("value", d, a, g)
        if key not in self._memo:
            self._memo[key] = chain_value(g, a, self.verify_price, self.lam * self.coeffs[d][1], self.spend[d][g],
                                          self.past.get(d, NO_PAST), self.calibration.get(d, 1.0))
        return self._memo[key]

    def _depths(self, picks: list[tuple[str | None, int]], skip: int = -1) -> dict[str, float]:
        """Per drafter, the draft positions its deepest slot runs (so its forwards), slot `skip` aside."""
        depth: dict[str, float] = {}
        for j, (d, g) in enumerate(picks):
            if j != skip and d is not None:
                depth[d] = max(depth.get(d, 0.0), self.spend[d][g][1])
        return depth

    def _total(self, picks: list[tuple[str | None, int]]) -> float:
        """V at the posterior means: what the picks are expected to gain. (At the drafter-choosing rates, with
        each gamma chosen at the mean, closing compared a sure drafter at a gamma below its best for its rate
        against an optimistic one at its best: at 1 slot the int8 copy, mean 0.885 and gamma 5, lost to a
        distilled draft at 0.78 optimistic and 0.5 expected, in a third of the steps.)"""
        value = sum(1.0 if d is None else self._value(k, d, g) for k, (d, g) in enumerate(picks))
        return value - sum(self.lam * self.coeffs[d][0] * depth for d, depth in self._depths(picks).items())
