"""The back-off step gate (StepGate): whether a step runs the bandit's choices or drafts nothing.

The cost model prices what it models, not all a speculating step spends (selection itself, a
drafter catching up on the tokens it skipped, bookkeeping per draft, and whatever the fitted lines
miss). So the batch also keeps score of the outcome: per batch size, the goodput measured over
steps that ran the bandit's choices and over steps that drafted nothing, and a step speculates
only while speculating steps measure ahead.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass

GATE_WARMUP = 8  # scored speculating steps a batch size runs before plain decoding is tried
GATE_REFRESH = 16  # the mode behind runs a burst at least this many steps apart, so it can win back
GATE_BURST = 3  # steps in that burst: the first one pays the switch and is not scored
GATE_WINDOW = 8  # the other mode's last scored steps a burst is paired with
GATE_COST = 0.01  # while speculation leads, bursts of plain decoding are spaced to cost this share of goodput
GATE_DECAY = 0.8  # per paired sample, of the band's mean log ratio: ~5 samples of memory
GATE_MARGIN = 1.02  # plain decoding must measure this much more goodput (and a standard error) to turn speculation off


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

    def snapshot(self) -> list[float]:
        return [self.n, self._w, self._w2, self._s1, self._s2]

    def restore(self, state: list[float], weight: float) -> None:
        """An earlier mean, its samples worth `weight` of what they were: the same mean and standard error, which
        a new sample moves further."""
        n, w, w2, s1, s2 = state
        self.n = int(n)
        self._w, self._w2, self._s1, self._s2 = weight * w, weight * weight * w2, weight * s1, weight * s2

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
    every GATE_REFRESH steps after (plain decoding more seldom while speculation is far ahead, see
    refresh), the mode that is behind runs a burst of GATE_BURST steps. The burst's goodput over
    the other mode's last GATE_WINDOW scored steps is one paired sample of the ratio, and the band
    keeps a decayed mean of its log. A step speculates unless plain decoding leads by GATE_MARGIN
    plus a standard error (see verdict).

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

    def snapshot(self) -> dict:
        """The verdicts so far, per band, as JSON data (selection/memory.py keeps them for the next run)."""
        return {"log_ratio": {str(b): r.snapshot() for b, r in self.log_ratio.items()},
                "warm": {str(b): n for b, n in self.warm.items()}}

    def restore(self, state: dict, weight: float) -> None:
        """Start from an earlier run's verdicts: a band with paired ratios is warm, and they count `weight` of what
        they did; the bursts still come, so a verdict that no longer holds here is overturned. A band with no
        pair warms up again: its first burst is paired with this run's steps of the other mode, which a band
        taken as warm without a verdict has none of until it speculates."""
        for b, r in state["log_ratio"].items():
            self.log_ratio[int(b)] = DecayedMean(GATE_DECAY)
            self.log_ratio[int(b)].restore(r, weight)
        for b, n in state["warm"].items():
            if int(b) in self.log_ratio:
                self.warm[int(b)] = min(int(n), GATE_WARMUP)

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
            winner, ratio = self.verdict(band), self.log_ratio.get(band) or self._ahead_above(band)
            self._since[band] += 1
            if ratio is not None:  # else no pair yet: a burst of plain decoding right after the warm-up
                if self._since[band] < self.refresh(ratio.mean if winner else 0.0):
                    return winner
            self._since[band] = 0
            burst = self._burst[band] = Burst(not winner, GATE_BURST)
        burst.left -= 1
        return burst.speculate

    def _ahead_above(self, band: int) -> DecayedMean | None:
        """The paired ratio of the nearest larger band where speculation measured ahead, for a band with no pair
        of its own: a verified row costs less the fewer the slots, so speculation that pays at a larger batch
        pays at a smaller one too, and the smaller band spaces its bursts by that lead. Without it, the bands
        a 4-slot job passes through between admissions (1, 2-3) ran a plain burst at every turn: their steps
        fall between the larger band's, so none continued a run of its mode to be scored, no pair came, and
        the next step began another burst (15 plain steps of 49 at 1-3 decoding slots, demo job, 4 slots)."""
        measured = [self.log_ratio[b] for b in sorted(self.log_ratio) if b > band and self.log_ratio[b].n >= 2]
        return measured[0] if measured and measured[0].mean - measured[0].stderr > 0 else None

    @staticmethod
    def refresh(lead: float) -> float:
        """Steps between bursts while speculation leads by `lead` (log goodput ratio; 0 while it does not):
        a burst of plain decoding gives up 1 - exp(-lead) of each of its steps' worth, so spaced to cost
        GATE_COST of goodput (the figures: docs/selection.md, Back-off)."""
        return max(GATE_REFRESH, GATE_BURST * (1.0 - math.exp(-max(lead, 0.0))) / GATE_COST)

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
