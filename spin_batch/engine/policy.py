"""Selection: which drafter, and how many draft tokens (gamma), each slot uses at a step.

Selectors: `none` (plain decoding) and `fixed:<name>` (one drafter, the configured gamma).
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


NO_SPEC = Choice(None, 0)


class Policy:
    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        """One choice per slot; caps[i] bounds gamma for slot i (context and max_tokens room)."""
        raise NotImplementedError

    def on_admit(self, slot: int) -> None:
        pass

    def learn(self, outcomes: list[Outcome], stage_times: dict[str, float]) -> None:
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


def make_policy(selector: str, drafter_names: list[str], max_gamma: int) -> Policy:
    if selector == "none":
        return NoSpeculation()
    if selector.startswith("fixed:"):
        name = selector.split(":", 1)[1]
        if name not in drafter_names:
            raise ValueError(f"selector {selector!r}: no drafter named {name!r} (have: {', '.join(drafter_names)})")
        return FixedDrafter(name, max_gamma)
    raise ValueError(f"unknown selector {selector!r}")
