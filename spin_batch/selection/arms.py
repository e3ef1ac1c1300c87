"""A request's view of each drafter, and what the job pools over requests: the pieces the bandit's
state is made of (bandit.BanditState).

Beta is a posterior over a drafter's per-token acceptance rate; RequestArms is one request's Betas (warm
started from the pool, bandit.py's Warm start); Spread measures how much requests differ, which sets the
strength of that warm start; PastGamma and Calibration are what the joint choice adds to the rates (the
tokens a chain brings past gamma, and its realized draft tokens against those predicted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_STRENGTH = 6.0  # pseudo-tokens a warm start is worth until the spread between requests is measured
PRIOR_MAX = 100.0  # the most pseudo-tokens a measured spread may make of it
SPREAD_REQUESTS = 4  # finished requests with observations of a drafter before its spread is measured
CALIBRATION_PRIOR = 16.0  # predicted draft tokens a calibration starts with at factor 1 (Calibration)
CALIBRATION_DECAY = 0.995  # per step of a drafter's chosen slots, at one batch size


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
    drafters it picks the means that came out high, so its predictions run high where it chooses among many
    (docs/selection.md, "Why the bandit is built so"). Decayed sums, with CALIBRATION_PRIOR predicted tokens at
    factor 1 so that a few steps move it little."""

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
    rho = 1 / (kappa + 1), N = sum n_r. Why a measured strength and not a fixed one: docs/selection.md
    ("Why the bandit is built so")."""

    def __init__(self) -> None:
        self.requests = 0
        self.n = self.x = self.n2 = self.x2n = 0.0  # sums of n_r, x_r, n_r^2, x_r^2 / n_r
        # kappa in pseudo-tokens, within [PRIOR_STRENGTH, PRIOR_MAX]; PRIOR_STRENGTH until measured. Read at
        # every warm start (each slot, each step), so kept here and renewed only when a request is added.
        self.strength = PRIOR_STRENGTH

    @classmethod
    def restored(cls, requests: int, sums: list[float], weight: float) -> Spread:
        """An earlier run's spread (its request count and sums n, x, n^2, x^2/n), as if from `weight` of its
        requests: the same strength, which new requests then move sooner."""
        spread = cls()
        spread.requests = max(int(weight * requests), 1)
        spread.n, spread.x, spread.n2, spread.x2n = (weight * v for v in sums)
        spread.strength = spread._measure()
        return spread

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
