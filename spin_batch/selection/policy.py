"""The selection interface the engine sees: Policy, the Choice it makes per slot, the StepChoice record of a
step's choices that choose() returns and learn() takes back, and the Outcome and StepCosts it learns from. A
leaf: the policies import it, it imports none of them.

Data in, data out: a policy keeps what it has learnt between steps, never what one step's choose() left for
its learn(); that travels in the StepChoice, which the loop hands back with the step's outcomes."""

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


@dataclass(frozen=True)
class GateStep:
    """What a StepGate decided for a step: at how many decoding slots, and its mode (gate.StepGate.decide)."""

    slots: int
    mode: bool


@dataclass(frozen=True)
class Prediction:
    """A slot's draft as the joint choice priced it: its drafter, among how many decoding slots, and the
    draft tokens it was predicted to gain at the posterior mean, uncalibrated (bandit.Calibration)."""

    slot: int
    drafter: str
    slots: int
    tokens: float


@dataclass(frozen=True)
class StepChoice:
    """One step's choices, and what the policy that made them reads back in learn(): the record of the step.

    choices: one per decoding slot, in the order choose() was given them. The rest is the bandit's (empty for
    the policies that run what they are told): the back-off gate's decision (None: no back-off), the tree
    gate's (None: no drafter grows trees, or the step drafted nothing), and the joint choice's predictions."""

    choices: tuple[Choice, ...]
    gate: GateStep | None = None
    tree: GateStep | None = None
    predicted: tuple[Prediction, ...] = ()

    @staticmethod
    def of(choices: list[Choice]) -> StepChoice:
        return StepChoice(tuple(choices))


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
    def choose(self, slots: list[int], caps: list[int]) -> StepChoice:
        """The step's record: one choice per slot; caps[i] bounds gamma for slot i (context and max_tokens room)."""

    def on_admit(self, slot: int, req_id: str | None = None) -> None:
        """A new request took `slot` (req_id: its id, for policies keyed by request)."""

    def on_stream(self) -> None:
        """A new request stream starts (BatchLoop.run): what was learnt stays, the drain is over."""

    def on_drain(self) -> None:
        """The request stream is done: the slots in flight are the last ones (see bandit.BanditPolicy)."""

    def learn(self, step: StepChoice, outcomes: list[Outcome], costs: StepCosts) -> None:
        """What the step chosen as `step` produced and cost (with the pipeline, once per micro-batch: the
        outcomes of its slots, the same record each time)."""

    def snapshot(self) -> dict | None:
        """What this policy learnt that holds beyond the run (costs, verdicts, pooled rates), as JSON data, for
        the next run on this machine to start from (memory.py); None: nothing worth keeping."""
        return None

    def restore(self, snap: dict) -> None:
        """Start from what an earlier run learnt (snapshot()'s data); a policy that keeps nothing ignores it."""
