"""Selection: which drafter, and how many draft tokens (gamma), each slot uses at a step.

Selectors: `none` (plain decoding), `fixed:<name>` (one drafter, the configured gamma; a gated
drafter also gets the confidence floor, priced like the bandits'), and the SPIN bandits `ucb`,
`thompson`, `round_robin` (engine/bandit.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    drafter: str | None  # None: no speculation this step
    gamma: int  # draft tokens asked for; 0 with drafter None
    min_prob: float = 0.0  # the drafter's confidence floor (DraftRequest.min_prob); 0: draft all gamma


@dataclass
class Outcome:
    """What one slot's step produced, for the policy to learn from."""

    slot: int
    choice: Choice
    drafted: int  # tokens the drafter actually proposed (<= gamma)
    accepted: int


@dataclass
class StepCosts:
    """Measured cost of one step, for the policy's cost model."""

    stage_s: dict[str, float]  # seconds per stage (select, draft, verify, accept, commit)
    verify_tokens: int  # N of the packed target forward
    draft_s: dict[str, float]  # seconds spent in each drafter's propose()
    draft_tokens: dict[str, int]  # draft positions each drafter ran (per slot: min(proposed + 1, gamma))
    # draft forwards (rounds) each drafter ran: the most positions any of its slots ran, since one
    # forward advances all of its live slots. Absent: one forward per position (no batching).
    draft_forwards: dict[str, int] = field(default_factory=dict)
    prefill_tokens: int = 0  # of verify_tokens, those of prefill chunks riding in the same forward


NO_SPEC = Choice(None, 0)


class Policy:
    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        """One choice per slot; caps[i] bounds gamma for slot i (context and max_tokens room)."""
        raise NotImplementedError

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        """A new request took `slot` (req_id: its id, for policies keyed by request)."""

    def on_stream(self) -> None:
        """A new request stream starts (BatchLoop.run): what was learnt stays, the drain is over."""

    def on_drain(self) -> None:
        """The request stream is done: the slots in flight are the last ones (see BanditPolicy)."""

    def learn(self, outcomes: list[Outcome], costs: StepCosts) -> None:
        pass


class NoSpeculation(Policy):
    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        return [NO_SPEC for _ in slots]


class FixedDrafter(Policy):
    def __init__(self, drafter: str, gamma: int):
        self.drafter = drafter
        self.gamma = gamma

    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        return [Choice(self.drafter, min(self.gamma, c)) if c > 0 else NO_SPEC for c in caps]


def make_policy(selector: str, drafters, max_gamma: int, seed: int = 0, confidence_gate: bool = True,
                assign: dict[str, str | None] | None = None, backoff: bool = True) -> Policy:
    """`drafters`: the loop's drafters by name, or bare names (then none is gated). With confidence_gate,
    the bandits give the drafters that honour Choice.min_prob (`gates`) a floor priced by their cost model.
    With backoff, ucb and thompson speculate at a step only while that measures ahead (bandit.StepGate).

    `assign` (the bench's realised oracle) overrides the selector: each request id runs its own fixed
    drafter, or none (None or absent), exactly as `fixed:<name>` would run it.
    """
    from .bandit import BanditPolicy  # imports this module

    drafter_names = list(drafters)
    gated = frozenset(n for n, d in drafters.items() if d.gates) \
        if confidence_gate and isinstance(drafters, dict) else frozenset()
    if assign is not None:
        unknown = sorted({n for n in assign.values() if n is not None} - set(drafter_names))
        if unknown:
            raise ValueError(f"assigned drafters {unknown} are not in the pool ({', '.join(drafter_names)})")
        return BanditPolicy(drafter_names, max_gamma, mode="assigned", seed=seed, gated=gated, assign=assign)
    if selector == "none":
        return NoSpeculation()
    if selector in ("ucb", "thompson", "round_robin"):
        if not drafter_names:
            return NoSpeculation()
        return BanditPolicy(drafter_names, max_gamma, mode=selector, seed=seed, gated=gated, backoff=backoff)
    if selector.startswith("fixed:"):
        name = selector.split(":", 1)[1]
        if name not in drafter_names:
            raise ValueError(f"selector {selector!r}: no drafter named {name!r} (have: {', '.join(drafter_names)})")
        if name in gated:  # the bandit's cost model sets its confidence floor
            return BanditPolicy([name], max_gamma, mode="fixed", seed=seed, gated=gated)
        return FixedDrafter(name, max_gamma)
    raise ValueError(f"unknown selector {selector!r}")
