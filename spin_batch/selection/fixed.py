"""The policies that run what they are told: no speculation, one fixed drafter, drafters in turn.

A fixed drafter that honours the confidence gate still gets a floor, priced as the bandit prices it
(costs.Pricing); fixed_choices is that rule for any per-slot assignment of drafters (the bench's
oracle assigns one per request).
"""

from __future__ import annotations

from collections import Counter

from .costs import Pricing
from .policy import NO_SPEC, Choice, Outcome, Policy, StepChoice, StepCosts


class NoSpeculation(Policy):
    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        return StepChoice.of([NO_SPEC for _ in slots])


def fixed_choices(names: list[str | None], caps: list[int], gamma: int, pricing: Pricing | None = None,
                  trees: dict[str, int] | None = None) -> list[Choice]:
    """Each slot's drafter (None: no drafting) at gamma, within its cap. With pricing, a gated drafter gets
    its confidence floor once the cost model knows its cost (before that, and ungated, the floor is 0).
    trees: the token-tree budget per drafter that grows trees (a gated one: its nodes are priced)."""
    trees = trees or {}
    if pricing is None:
        return [Choice(n, min(cap, gamma)) if n is not None and cap > 0 else NO_SPEC for n, cap in zip(names, caps)]
    verify_price, lam = pricing.prices(len(names))
    sharing = Counter(n for n, cap in zip(names, caps) if n is not None and cap > 0)
    out = []
    for n, cap in zip(names, caps):
        if n is None or cap <= 0:
            out.append(NO_SPEC)
            continue
        floor = pricing.floor(n, sharing[n], verify_price, lam) if pricing.known(n) else 0.0
        out.append(Choice(n, min(cap, gamma), floor, trees.get(n, 0)))
    return out


class FixedDrafter(Policy):
    """`fixed:<name>`: every slot drafts with one drafter at the configured gamma.

    pricing: for a gated drafter, the cost model that sets its confidence floor (None: no floor)."""

    def __init__(self, drafter: str, gamma: int, pricing: Pricing | None = None, nodes: int = 0):
        self.drafter = drafter
        self.gamma = gamma
        self.pricing = pricing
        self.trees = {drafter: nodes} if nodes > 1 else {}

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        return StepChoice.of(fixed_choices([self.drafter] * len(slots), caps, self.gamma, self.pricing, self.trees))

    def learn(self, step: StepChoice, outcomes: list[Outcome], costs: StepCosts) -> None:
        if self.pricing is not None:
            self.pricing.learn(outcomes, costs)


class RoundRobin(Policy):
    """`round_robin`: the drafters in turn, shifted by slot, each step at the configured gamma."""

    def __init__(self, drafters: list[str], gamma: int):
        self.drafters = drafters
        self.gamma = gamma
        self._turn = 0

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        self._turn += 1
        return StepChoice.of([Choice(self.drafters[(self._turn + s) % len(self.drafters)], min(self.gamma, c))
                              if c else NO_SPEC for s, c in zip(slots, caps)])
