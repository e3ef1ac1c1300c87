"""The selection interface the engine sees: Policy, the Choice it makes per slot, and the Outcome and
StepCosts it learns from. A leaf: the policies import it, it imports none of them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    drafter: str | None  # None: no speculation this step
    gamma: int  # draft tokens asked for; 0 with drafter None
    min_prob: float = 0.0  # the drafter's confidence floor (DraftRequest.min_prob); 0: draft all gamma
    nodes: int = 0  # token-tree budget for a drafter that grows trees (DraftRequest.nodes); 0: a chain


NO_SPEC = Choice(None, 0)


@dataclass
class Outcome:
    """What one slot's step produced, for the policy to learn from."""

    slot: int
    choice: Choice
    drafted: int  # tokens the drafter actually proposed (past gamma only on confirmed guesses: DraftRequest.room)
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


class Policy(ABC):
    """Chooses every decoding slot's drafter and gamma at each step, and learns from what the step did."""

    @abstractmethod
    def choose(self, slots: list[int], caps: list[int]) -> list[Choice]:
        """One choice per slot; caps[i] bounds gamma for slot i (context and max_tokens room)."""

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        """A new request took `slot` (req_id: its id, for policies keyed by request)."""

    def on_stream(self) -> None:
        """A new request stream starts (BatchLoop.run): what was learnt stays, the drain is over."""

    def on_drain(self) -> None:
        """The request stream is done: the slots in flight are the last ones (see bandit.BanditPolicy)."""

    def learn(self, outcomes: list[Outcome], costs: StepCosts) -> None:
        """What the step just run produced and cost."""

    def state(self) -> dict | None:
        """What this policy learnt that holds beyond the run (costs, verdicts, pooled rates), as JSON data, for
        the next run on this machine to start from (selection/memory.py); None: nothing worth keeping."""
        return None

    def restore(self, state: dict) -> None:
        """Start from what an earlier run learnt (`state()`'s data); a policy that keeps nothing ignores it."""
