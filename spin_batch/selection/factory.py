"""make_policy: the job's selector (spin.selector) as a Policy.

Selectors: `none` (plain decoding), `fixed:<name>` (one drafter at the configured gamma; a gated
drafter also gets the confidence floor, priced like the bandit's), `round_robin` (the drafters in
turn), and the SPIN bandits `ucb` and `thompson` (bandit.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from .bandit import BanditPolicy
from .costs import Pricing
from .fixed import FixedDrafter, NoSpeculation, RoundRobin
from .policy import Policy


class Capabilities(Protocol):
    """What a drafter declares it can do (drafters.base.Capabilities)."""

    @property
    def gates(self) -> bool: ...  # honours Choice.min_prob

    @property
    def trees(self) -> bool: ...  # may answer Choice.nodes with a token tree


class Capable(Protocol):
    """A drafter as the factory sees it: its declared capabilities (drafters.base.Drafter.capabilities)."""

    @property
    def capabilities(self) -> Capabilities: ...


Drafters = Mapping[str, Capable] | Iterable[str]  # the loop's drafters by name, or bare names (none gated)


def gated_drafters(drafters: Drafters, confidence_gate: bool = True) -> frozenset[str]:
    """The drafters whose floor the policy sets: those that declare they honour Choice.min_prob (`gates`),
    with the confidence gate on. Bare names (no drafter objects) are never gated."""
    if not confidence_gate or not isinstance(drafters, Mapping):
        return frozenset()
    return frozenset(n for n, d in drafters.items() if d.capabilities.gates)


def tree_drafters(drafters: Drafters, tree_nodes: int, gated: frozenset[str],
                  target_trees: bool = True) -> dict[str, int]:
    """Per drafter that grows token trees, its node budget: the gated drafters that declare `trees` (a tree's
    nodes are priced by the gate's floor; ungated, a tree would always take its whole budget), where the target
    verifies tree segments (target_trees: models.protocol.TargetModel.tree_segments). The one place a job's
    tree budgets are decided; the loop fits each to the slot's context."""
    if tree_nodes <= 1 or not target_trees or not isinstance(drafters, Mapping):
        return {}
    return {n: tree_nodes for n, d in drafters.items() if d.capabilities.trees and n in gated}


def make_policy(selector: str, drafters: Drafters, max_gamma: int, seed: int = 0, confidence_gate: bool = True,
                backoff: bool = True, tree_nodes: int = 0, target_trees: bool = True) -> Policy:
    """`drafters`: the loop's drafters by name, or bare names (then none is gated). With confidence_gate,
    the drafters that honour Choice.min_prob get a floor priced by the cost model. With backoff, ucb and
    thompson speculate at a step only while that measures ahead (gate.StepGate). tree_nodes: the token-tree
    budget of the gated drafters that grow trees (0: chains), on a target that verifies trees (target_trees)."""
    names = list(drafters)
    gated = gated_drafters(drafters, confidence_gate)
    trees = tree_drafters(drafters, tree_nodes, gated, target_trees)
    if selector == "none":
        return NoSpeculation()
    if selector in ("ucb", "thompson"):
        if not names:
            return NoSpeculation()
        return BanditPolicy(names, max_gamma, mode=selector, seed=seed, gated=gated, backoff=backoff, trees=trees)
    if selector == "round_robin":
        return RoundRobin(names, max_gamma) if names else NoSpeculation()
    if selector.startswith("fixed:"):
        name = selector.split(":", 1)[1]
        if name not in names:
            raise ValueError(f"selector {selector!r}: no drafter named {name!r} (have: {', '.join(names)})")
        return FixedDrafter(name, max_gamma, Pricing([name]) if name in gated else None, trees.get(name, 0))
    raise ValueError(f"unknown selector {selector!r}")
