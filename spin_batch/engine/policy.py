"""Selection: which drafter, and how many draft tokens (gamma), each slot uses at a step.

Selectors: `none` (plain decoding), `fixed:<name>` (one drafter, the configured gamma), and
the SPIN bandits `ucb`, `thompson`, `round_robin` (engine/bandit.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    drafter: str | None  # None: no speculation this step
    gamma: int  # draft tokens asked for; 0 with drafter None


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
    draft_tokens: dict[str, int]  # draft tokens asked of each drafter (gamma summed over its slots)


NO_SPEC = Choice(None, 0)


class Policy:
    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        """One choice per slot; caps[i] bounds gamma for slot i (context and max_tokens room)."""
        raise NotImplementedError

    def on_admit(self, slot: int) -> None:
        pass

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


def make_policy(selector: str, drafter_names: list[str], max_gamma: int, seed: int = 0) -> Policy:
    if selector == "none":
        return NoSpeculation()
    if selector in ("ucb", "thompson", "round_robin"):
        from .bandit import BanditPolicy

        if not drafter_names:
            return NoSpeculation()
        return BanditPolicy(list(drafter_names), max_gamma, mode=selector, seed=seed)
    if selector.startswith("fixed:"):
        name = selector.split(":", 1)[1]
        if name not in drafter_names:
            raise ValueError(f"selector {selector!r}: no drafter named {name!r} (have: {', '.join(drafter_names)})")
        return FixedDrafter(name, max_gamma)
    raise ValueError(f"unknown selector {selector!r}")
