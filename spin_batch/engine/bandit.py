"""SPIN selection: a per-request bandit over heterogeneous drafters, with adaptive gamma.

Each request keeps, per drafter, a Beta posterior over the drafter's per-token acceptance
rate a. Acceptance is modelled as geometric: a verify that asked for g tokens and accepted k
is k successes plus one failure when k < g (a token the drafter did not propose counts as
a failure). The expected tokens a step gains with gamma g is
E(g, a) = (1 - a^(g + 1)) / (1 - a) (accepted drafts plus the recovered or bonus token).

Cost comes from an online model of measured stage times at the current batch size
(CostModel): verification costs c0 + c1 * N for N packed tokens, and drafter d costs f_d per
forward plus s_d per draft position (one forward advances all of d's slots, so a slot drafting
with others shares their forwards). The batch's goodput is (sum of tokens gained) / (step
time); it is maximised by the choices that maximise the sum over slots of E(g, a_d) - lam *
cost, where lam is the current goodput (tokens per second) and the cost counts each drafter's
forwards once (JointChoice). That makes gamma 0 win as soon as verification of extra tokens
costs more than they bring, e.g. at large batch, and it keeps the slots that draft on few
drafters: a batch split over drafters pays every drafter's forwards.

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

Drain: once the request stream is done (Policy.on_drain), a token no longer frees a slot for
the next request, and the job ends when its last request does. Any running request may be that
one, so a step shortens the job only by the progress of its slowest slot: the drain values the
joint choice at n times the least expected gain among its n slots instead of the sum of their
gains (JointChoice.drain_value), and the step drafts nothing unless that beats plain decoding.
A step that leaves any slot undrafted thus gains the job nothing and only pays for its drafts;
speculation goes on where every slot's draft pays, as in the last few requests of a job.

Back-off (StepGate): the cost model prices what it models, not all a speculating step spends
(selection itself, a drafter catching up on the tokens it skipped, bookkeeping per draft, and
whatever the fitted lines miss). So the batch also keeps score of the outcome: per batch size,
the goodput measured over steps that ran the bandit's choices and over steps that drafted
nothing, and a step speculates only while speculating steps measure ahead.

The design is explained in docs/selection.md; the measurements behind it are in BENCHMARKS.md.
"""

from __future__ import annotations

import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from .policy import NO_SPEC, Choice, Outcome, Policy, StepCosts

PRIOR_STRENGTH = 6.0  # pseudo-tokens a warm start is worth
DEFAULT_RATE = 0.3  # prior acceptance before anything was pooled
JOINT_PASSES = 3  # best-response passes over the batch (JointChoice)
DECODE_FIT_STEPS = 4.0  # decayed weight of decode steps the verify fit needs before it drops prefill steps
DRAIN_RECHECK = 16  # steps the drain keeps a verdict against drafting while its slots stay the same
GATE_WARMUP = 8  # scored speculating steps a batch size runs before plain decoding is tried
GATE_REFRESH = 16  # the mode behind runs a burst once in this many steps (or up to 4x as many), so it can win back
GATE_BURST = 3  # steps in that burst: the first one pays the switch and is not scored
GATE_WINDOW = 8  # the other mode's last scored steps a burst is paired with
GATE_STRETCH = 0.05  # the refresh waits one GATE_REFRESH more per this lead of speculation (log ratio)
GATE_DECAY = 0.8  # per paired sample, of the band's mean log ratio: ~5 samples of memory
GATE_MARGIN = 1.02  # plain decoding must measure this much more goodput (and a standard error) to turn speculation off


def expected_gain(gamma: int, a: float) -> float:
    """Expected new tokens from one verify with gamma drafts at per-token acceptance a."""
    if gamma == 0:
        return 1.0
    a = min(max(a, 0.0), 0.999999)
    return (1.0 - a ** (gamma + 1)) / (1.0 - a)


def decay_into(sums: list[float], values: tuple[float, ...], decay: float) -> None:
    """sums[i] = decay * sums[i] + values[i]: the running sums of a decayed least-squares fit."""
    for i, v in enumerate(values):
        sums[i] = decay * sums[i] + v


def chain_spend(gamma: int, goes_on: float | None) -> tuple[float, float]:
    """Expected (tokens proposed, draft positions run) of a chain capped at gamma.

    Ungated (goes_on None): gamma of each. Gated: the chain proposes k tokens with P(k >= i) =
    goes_on^i, and runs min(k + 1, gamma) positions, since the position its gate stopped at was
    drafted too.
    """
    if goes_on is None:
        return float(gamma), float(gamma)
    return expected_gain(gamma, goes_on) - 1.0, expected_gain(gamma, goes_on) - goes_on ** gamma


def chain_value(g: int, a: float, verify_price: float, position_price: float, spend: tuple[float, float]) -> float:
    """E(g, a) minus the price of the tokens verified and the draft positions run (spend: chain_spend(g, ...))."""
    proposed, ran = spend
    return expected_gain(g, a) - verify_price * proposed - position_price * ran


def best_gamma(a: float, verify_price: float, position_price: float, spend: list[tuple[float, float]],
               forward_price: float = 0.0, depth: float = 0.0) -> tuple[float, int]:
    """max over g in 0..len(spend) - 1 of E(g, a) minus the price of what the chain spends, and its g.

    spend[g] is chain_spend(g, ...): the tokens verified and the draft positions run, each position
    priced at position_price, plus forward_price for each forward the chain adds beyond `depth` (the
    positions other slots of its drafter run anyway). Gamma 0 is worth 1. A chain the gate stops at
    once proposes nothing but still costs a draft forward.
    """
    best_value, best_g = 1.0, 0
    for g in range(1, len(spend)):
        value = (chain_value(g, a, verify_price, position_price, spend[g])
                 - forward_price * max(spend[g][1] - depth, 0.0))
        if value > best_value:
            best_value, best_g = value, g
    return best_value, best_g


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

    def observe(self, forwards: int, positions: int, seconds: float) -> None:
        f, p = float(forwards), float(positions)
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


class CostModel:
    """Stage times measured online: verify = c0 + c1 * tokens; drafter d = f_d * forwards + s_d * positions.

    The verify line is fitted on decode steps (no prefill chunk in the forward) once it has a few:
    a long prefill chunk costs less per token than the last few tokens of a decode step, and its
    leverage would pull c1 down to the prefill rate, so speculation would look cheaper than it is
    at large batch (measured: BENCHMARKS.md, "selection policy A/Bs"). Until then, every step counts.
    """

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self._all = [0.0] * 5  # decayed sums over all steps: 1, N, N^2, t, N t
        self._decode = [0.0] * 5  # the same over decode steps only
        self.drafts: dict[str, DraftCost] = {}
        self.goodput = Ema(0.9, 0.0)  # tokens per second of the whole batch: tracks faster than costs

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


class DecayedMean:
    """Exponentially weighted mean of samples, with its standard error."""

    def __init__(self, decay: float):
        self.decay = decay
        self.n = 0
        self._w = self._w2 = self._s1 = self._s2 = 0.0

    def add(self, x: float) -> None:
        d = self.decay
        self._w, self._w2 = d * self._w + 1.0, d * d * self._w2 + 1.0
        self._s1, self._s2 = d * self._s1 + x, d * self._s2 + x * x
        self.n += 1

    @property
    def mean(self) -> float:
        return self._s1 / self._w if self._w else 0.0

    @property
    def stderr(self) -> float:
        """sqrt(variance / effective sample count); infinite with fewer than two samples."""
        if self.n < 2:
            return math.inf
        var = max(self._s2 / self._w - self.mean ** 2, 0.0)
        return math.sqrt(var * self._w2 / (self._w * self._w))


@dataclass
class Burst:
    """The mode that is behind, run for a few steps to be measured against the other one."""

    speculate: bool
    left: int  # steps still to run
    tokens: float = 0.0  # gained over its scored steps
    seconds: float = 0.0


class StepGate:
    """Batch-level back-off: whether a step runs the bandit's choices or drafts nothing at all.

    It compares the two modes by their measured outcome, every stage included, per batch size
    (decoding slots, in power-of-two bands), and in pairs close in time, as the bench does: this
    machine's speed drifts by more than the gap it has to judge, and a mode measured only long ago
    would be compared with the other one's recent steps.

    A band first speculates for GATE_WARMUP scored steps (the bandit's own learning). Then, and
    every GATE_REFRESH steps after (plain decoding up to 4 times as seldom while speculation is
    far ahead), the mode that is behind runs a burst of GATE_BURST steps. The burst's goodput over
    the other mode's last GATE_WINDOW scored steps is one paired sample of the ratio, and the band
    keeps a decayed mean of its log. A step speculates unless plain decoding leads by GATE_MARGIN
    plus a standard error (see speculates).

    Only steps that continue a run of their mode are scored. The first speculating step after
    plain ones pays for the drafters catching up on every token they skipped (at 4 slots, 64
    tokens after 16 plain steps), which steady speculation does not.
    """

    def __init__(self) -> None:
        self.recent: dict[tuple[int, bool], deque[tuple[float, float]]] = {}  # (band, mode): (tokens, seconds)
        self.log_ratio: dict[int, DecayedMean] = {}  # per band: of log(speculating / plain goodput), paired
        self.warm: Counter = Counter()  # per band: scored speculating steps
        self._since: Counter = Counter()  # per band: steps since the last burst
        self._burst: dict[int, Burst] = {}  # per band: the burst under way
        self._last: bool | None = None  # the mode of the previous step (the drafters' state is global)
        self.steady = False  # whether the current step continues a run of its mode (then it is scored)

    @staticmethod
    def band(slots: int) -> int:
        return max(slots, 1).bit_length()  # 1 | 2-3 | 4-7 | 8-15 | 16-31 | ...

    def verdict(self, band: int) -> bool:
        """The band's verdict so far: speculate unless plain decoding measured ahead by GATE_MARGIN
        with a standard error to spare (two pairs at least): the gate overrides the cost model on
        evidence only, where one noisy pair at a small batch would otherwise stop speculation that pays."""
        r = self.log_ratio.get(band)
        return r is None or r.n < 2 or r.mean + r.stderr >= -math.log(GATE_MARGIN)

    def decide(self, slots: int) -> bool:
        """Whether a step over this many decoding slots should run the bandit's choices."""
        band = self.band(slots)
        burst = self._burst.get(band)
        if burst is not None and burst.left == 0:
            self._pair(band, self._burst.pop(band))
        mode = self._mode(band)
        self.steady, self._last = self._last == mode, mode
        return mode

    def _mode(self, band: int) -> bool:
        if self.warm[band] < GATE_WARMUP:
            return True
        burst = self._burst.get(band)
        if burst is None:
            winner, ratio = self.verdict(band), self.log_ratio.get(band)
            self._since[band] += 1
            if ratio is not None:  # else no pair yet: a burst of plain decoding right after the warm-up
                ahead = ratio.mean if winner else 0.0
                if self._since[band] < GATE_REFRESH * min(max(ahead / GATE_STRETCH, 1.0), 4.0):
                    return winner
            self._since[band] = 0
            burst = self._burst[band] = Burst(not winner, GATE_BURST)
        burst.left -= 1
        return burst.speculate

    def observe(self, slots: int, speculate: bool, tokens: int, seconds: float) -> None:
        band = self.band(slots)
        if not self.steady or seconds <= 0:
            return
        self.recent.setdefault((band, speculate), deque(maxlen=GATE_WINDOW)).append((tokens, seconds))
        self.warm[band] += speculate
        burst = self._burst.get(band)
        if burst is not None and burst.speculate == speculate:
            burst.tokens += tokens
            burst.seconds += seconds

    def _pair(self, band: int, burst: Burst) -> None:
        """One paired sample: the burst just run against the other mode's steps before it."""
        before = self.recent.get((band, not burst.speculate))
        if not before or burst.tokens <= 0 or burst.seconds <= 0:
            return
        other = sum(t for t, _ in before) / sum(s for _, s in before)
        ratio = math.log(burst.tokens / burst.seconds / other)
        self.log_ratio.setdefault(band, DecayedMean(GATE_DECAY)).add(ratio if burst.speculate else -ratio)


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
       others) and stays closed where that raises V.
    """

    def __init__(self, caps: list[int], rates: list[dict[str, float]], means: list[dict[str, float]],
                 coeffs: dict[str, tuple[float, float]], goes_on: dict[str, float | None], verify_price: float,
                 lam: float):
        self.caps, self.rates, self.means, self.lam, self.verify_price = caps, rates, means, lam, verify_price
        self.coeffs = coeffs
        self.spend = {d: [chain_spend(g, c) for g in range(max(caps) + 1)] for d, c in goes_on.items()}
        self.n = len(caps)
        self._memo: dict[tuple, tuple[float, int]] = {}  # _best by its arguments: passes repeat most of them

    def solve(self) -> list[tuple[str | None, int]]:
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
            trial = self._settle(trial, allowed)
            trial_value = self._total(trial)
            if trial_value > value:
                picks, value, everyone = trial, trial_value, allowed
        return picks

    def drain_bound(self) -> float:
        """An upper bound on drain_value over the choices that draft for every slot (any other is worth at
        most n): each slot gains its best, for at least one priced token of the cheapest drafter. At or under
        n, solve() is not worth running in the drain."""
        best = min(max(expected_gain(cap, a) for a in means.values()) for cap, means in zip(self.caps, self.means))
        least = min(self.verify_price * spend[1][0] for spend in self.spend.values())
        return self.n * (best - least)

    def drain_value(self, picks: list[tuple[str | None, int]]) -> float:
        """V in the drain, at the posterior means: n times the least slot's expected gain, less the prices.

        Compare with n (every slot decoding plainly, worth one token each).
        """
        gains = [1.0 if d is None else expected_gain(g, self.means[k][d]) for k, (d, g) in enumerate(picks)]
        prices = sum(gain - (1.0 if d is None else chain_value(g, self.means[k][d], self.verify_price,
                                                                self.lam * self.coeffs[d][1], self.spend[d][g]))
                     for k, ((d, g), gain) in enumerate(zip(picks, gains)))
        prices += sum(self.lam * self.coeffs[d][0] * depth for d, depth in self._depths(picks).items())
        return self.n * min(gains) - prices

    def _settle(self, picks: list[tuple[str | None, int]], allowed: set[str]) -> list[tuple[str | None, int]]:
        picks = list(picks)
        for _ in range(JOINT_PASSES):
            changed = False
            for k in range(self.n):
                pick = self._respond(k, picks, allowed)
                changed |= pick != picks[k]
                picks[k] = pick
            if not changed:
                break
        return picks

    def _respond(self, k: int, picks: list[tuple[str | None, int]], allowed: set[str],
                 shared: bool = False) -> tuple[str | None, int]:
        """Slot k's best (drafter, gamma) given the others' picks; shared: forwards split n ways instead."""
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

        favourite, _ = best_at(self.rates[k])
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
        key = (k, d, a, depth, shared)
        if key not in self._memo:
            f, s = self.coeffs[d]
            spend = self.spend[d][: self.caps[k] + 1]
            self._memo[key] = (best_gamma(a, self.verify_price, self.lam * (s + f / self.n), spend) if shared else
                               best_gamma(a, self.verify_price, self.lam * s, spend, self.lam * f, depth))
        return self._memo[key]

    def _depths(self, picks: list[tuple[str | None, int]], skip: int = -1) -> dict[str, float]:
        """Per drafter, the draft positions its deepest slot runs (so its forwards), slot `skip` aside."""
        depth: dict[str, float] = {}
        for j, (d, g) in enumerate(picks):
            if j != skip and d is not None:
                depth[d] = max(depth.get(d, 0.0), self.spend[d][g][1])
        return depth

    def _total(self, picks: list[tuple[str | None, int]]) -> float:
        """V at the drafter-choosing rates."""
        value = sum(1.0 if d is None else
                    chain_value(g, self.rates[k][d], self.verify_price, self.lam * self.coeffs[d][1], self.spend[d][g])
                    for k, (d, g) in enumerate(picks))
        return value - sum(self.lam * self.coeffs[d][0] * depth for d, depth in self._depths(picks).items())


@dataclass
class RequestArms:
    arms: dict[str, Beta]
    steps: int = 0


@dataclass
class BanditPolicy(Policy):
    """`ucb` (optimistic acceptance), `thompson` (sampled acceptance), `round_robin`, `fixed` (the one
    drafter given, at max_gamma: the policy only prices its confidence floor), or `assigned` (like
    `fixed`, but each request runs the drafter `assign` maps its id to, or none).

    backoff: ucb and thompson steps pass the StepGate first (the others run what they are told)."""

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
    backoff: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("ucb", "thompson", "round_robin", "fixed", "assigned"):
            raise ValueError(f"unknown bandit mode {self.mode!r}")
        self.rng = random.Random(self.seed)
        self.pooled = {d: Beta(1.0, 1.0) for d in self.drafters}
        # per gated drafter: proposed tokens (successes) against chains cut short (failures)
        self.goes_on = {d: Beta(1.0, 1.0) for d in self.drafters if d in self.gated}
        self._rr = 0
        self._slot_drafter: dict[int, str | None] = {}  # mode `assigned`: the drafter of each slot's request
        self.gate = StepGate() if self.backoff and self.mode in ("ucb", "thompson") else None
        self._step: tuple[int, bool] | None = None  # (decoding slots, speculated) of the step being run
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
        verify_price = lam * c1
        if self.mode in ("fixed", "assigned"):  # the drafter given, at the configured gamma; only its floor is priced
            names = [self.drafters[0] if self.mode == "fixed" else self._slot_drafter.get(s) for s in slots]
            sharing = Counter(n for n, cap in zip(names, caps) if n is not None and cap > 0)
            return [self._fixed(n, cap, verify_price, lam, sharing[n]) for n, cap in zip(names, caps)]
        if self.gate is not None:
            self._step = (len(slots), self.gate.decide(len(slots)))
            if not self._step[1]:
                return [NO_SPEC] * len(slots)
        # a drafter whose cost is still unknown is tried by one slot, with a short draft: trying
        # it on every slot at once could stall the whole batch behind an expensive drafter
        # (not in the drain: a step that drafts for one slot only makes the job no shorter)
        unmeasured = [] if self.draining else [d for d in self.drafters if not self.cost.measured(d)]
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
            cap = min(cap, self.max_gamma)
            if unmeasured and cap > 0:
                out[i] = Choice(unmeasured.pop(0), min(2, cap))
            elif cap > 0 and self.cost.goodput.seen:
                open_.append((i, req, cap))
        for i, choice in self._drained(slots, open_, verify_price, lam).items():
            out[i] = choice
        cap = next((cap for i, _, cap in open_ if i == explorer), 0)
        if cap:
            # vary gamma only, with the chosen drafter or else the cheapest one: exploring an
            # expensive drafter would make the whole batch wait for its draft rounds
            name = out[explorer].drafter or min(self.drafters, key=self.cost.draft_cost)
            if self.cost.measured(name):
                g = self.rng.randint(0, cap)
                out[explorer] = Choice(name, g) if g else NO_SPEC  # ungated: the cost model must see N vary
        return out

    def _drained(self, slots: list[int], open_: list[tuple[int, RequestArms, int]], verify_price: float,
                 lam: float) -> dict[int, Choice]:
        """_joint, but in the drain a verdict against drafting is kept for DRAIN_RECHECK steps unless a slot left."""
        if not self.draining:
            return self._joint(open_, verify_price, lam)
        key = frozenset(slots)
        if self._drain_no is not None and self._drain_no[0] == key and self._drain_no[1] < DRAIN_RECHECK:
            self._drain_no = (key, self._drain_no[1] + 1)
            return {}
        out = self._joint(open_, verify_price, lam)
        self._drain_no = None if out else (key, 0)
        return out

    def _joint(self, open_: list[tuple[int, RequestArms, int]], verify_price: float, lam: float) -> dict[int, Choice]:
        """Each open slot's choice (see JointChoice), with its drafter's confidence floor."""
        if not open_:
            return {}
        joint = JointChoice(
            caps=[cap for _, _, cap in open_],
            rates=[{d: self._rate(arm, req.steps) for d, arm in req.arms.items()} for _, req, _ in open_],
            means=[{d: arm.mean for d, arm in req.arms.items()} for _, req, _ in open_],
            coeffs={d: self.cost.draft_coeffs(d) for d in self.drafters},
            goes_on={d: self._goes_on(d) for d in self.drafters}, verify_price=verify_price, lam=lam)
        if self.draining and joint.drain_bound() <= joint.n:
            return {}
        picks = joint.solve()
        if self.draining and joint.drain_value(picks) <= joint.n:
            return {}
        sharing = Counter(d for d, _ in picks if d is not None)
        return {i: Choice(d, g, self._floor(d, verify_price + lam * self.cost.draft_cost(d, sharing[d])))
                for (i, _, _), (d, g) in zip(open_, picks) if d is not None}

    def _fixed(self, name: str | None, cap: int, verify_price: float, lam: float, sharing: int) -> Choice:
        """`name` at the configured gamma, with its priced confidence floor once its cost is known."""
        if name is None or cap <= 0:
            return NO_SPEC
        known = self.cost.goodput.seen and self.cost.measured(name)
        floor = self._floor(name, verify_price + lam * self.cost.draft_cost(name, sharing)) if known else 0.0
        return Choice(name, min(cap, self.max_gamma), floor)

    def _rate(self, arm: Beta, steps: int) -> float:
        if self.mode == "thompson":
            return self.rng.betavariate(arm.alpha, arm.beta)
        bonus = self.exploration * math.sqrt(math.log(steps + 1.0) / arm.n)
        return min(arm.mean + bonus, 0.999)

    def _goes_on(self, drafter: str) -> float | None:
        """For a gated drafter, the pooled rate at which its chain proposes its next token; None: ungated."""
        b = self.goes_on.get(drafter)
        return None if b is None else b.mean

    def _floor(self, drafter: str, per_token: float) -> float:
        """The confidence gate for this drafter: a position must be worth its cost (0: ungated)."""
        return min(per_token, 1.0) if drafter in self.goes_on else 0.0

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
            self.cost.observe_verify(costs.verify_tokens, costs.stage_s.get("verify", 0.0), costs.prefill_tokens)
        for d, positions in costs.draft_tokens.items():
            self.cost.observe_draft(d, positions, costs.draft_s.get(d, 0.0), costs.draft_forwards.get(d))
        gained = sum(o.accepted + 1 for o in outcomes)
        decode_s = self._decode_seconds(outcomes, costs)
        if gained and decode_s > 0:
            self.cost.goodput.update(gained / decode_s)
        if self.gate is not None and self._step is not None:
            self.gate.observe(self._step[0], self._step[1], gained, decode_s)
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
