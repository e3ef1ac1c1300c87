"""The bench's oracle policy: each request runs the drafter its hindsight schedule assigned it (or none).

Used only by `spin-batch bench`'s `oracle` method (bench.oracle picks the assignment, bench.run_loop
runs it). Each request is run exactly as `fixed:<name>` would run it, confidence floor included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .selection.costs import Pricing
from .selection.factory import gated_drafters
from .selection.fixed import fixed_choices
from .selection.policy import Outcome, Policy, StepChoice, StepCosts


class AssignedDrafters(Policy):
    """Each slot drafts with the drafter `assign` maps its request's id to (None or absent: no drafting), at
    the configured gamma; pricing sets the gated drafters' confidence floors."""

    def __init__(self, assign: Mapping[str, str | None], gamma: int, pricing: Pricing):
        self.assign = assign
        self.gamma = gamma
        self.pricing = pricing
        self._slot_drafter: dict[int, str | None] = {}  # the drafter of each slot's request

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        self._slot_drafter[slot] = self.assign.get(req_id)

    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        return StepChoice.of(fixed_choices([self._slot_drafter.get(s) for s in slots], caps, self.gamma, self.pricing))

    def learn(self, step: StepChoice, outcomes: list[Outcome], costs: StepCosts) -> None:
        self.pricing.learn(outcomes, costs)


def assigned_policy(drafters: Mapping | Iterable[str], gamma: int, assign: Mapping[str, str | None],
                    confidence_gate: bool = True) -> AssignedDrafters:
    """The oracle's policy over the loop's drafters (by name); an assigned drafter outside them is an error."""
    unknown = sorted({n for n in assign.values() if n is not None} - set(drafters))
    if unknown:
        raise ValueError(f"assigned drafters {unknown} are not in the pool ({', '.join(drafters)})")
    return AssignedDrafters(assign, gamma, Pricing(gated_drafters(drafters, confidence_gate)))
