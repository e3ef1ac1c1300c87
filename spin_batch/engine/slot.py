"""A request in flight (Slot), a step's micro-batches (micro_batches), the packed verify batch of one (Plan),
and the step's record for the run's statistics: the data BatchLoop's stages pass between them
(engine/loop.py)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..models.segments import Segments
from ..records import Request
from ..sampling import SamplingParams
from ..selection.policy import Choice
from ..stats import StepRecord
from .controls import NO_CONTROLS, LogitControls
from .logprobs import NO_LOGPROBS, LogprobAsk, Scored
from .prefill_share import SampleGroup
from .stopping import StopRule
from .structured import GrammarState
from .tree_verify import DraftTree
from .verify import Verdict


@dataclass
class Slot:
    """One request in flight."""

    index: int
    req: Request
    prompt_len: int
    tokens: list[int]  # prompt + generated, committed
    sp: SamplingParams  # this request's sampling settings
    rule: StopRule  # when it is done
    gen: torch.Generator | None  # its random stream (sampling only)
    controls: LogitControls = NO_CONTROLS  # what its logits go through before the verifier reads them
    prefilled: int = 0  # prompt tokens already in the target cache
    spec_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    pulls: Counter = field(default_factory=Counter)
    t_start: float = field(default_factory=time.perf_counter)
    share_s: float = 0.0  # this request's share of step wall time (step time / slots in the step)
    finish_reason: str | None = None
    text: str | None = None
    ask: LogprobAsk = NO_LOGPROBS  # the log-probabilities it asks for, kept below as they come
    logprobs: list[Scored] = field(default_factory=list)
    prompt_logprobs: list[Scored | None] = field(default_factory=lambda: [None])
    sample: int = 0  # which of its request's n samples
    group: SampleGroup | None = None  # its request's samples, where n > 1
    reuse_prefix: bool = True  # may take cached prefix blocks (off: a row that needs every prompt position's logits)
    grammar: GrammarState | None = None  # its output constraint's state (engine/structured.py), None: free text

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def controlled(self) -> bool:
        """Whether its logits need controls at this step (min_tokens holds only until it is reached)."""
        short = len(self.tokens) - self.prompt_len < self.rule.min_tokens
        return (self.controls.active(self.sp.temperature) or (short and bool(self.rule.eos | self.rule.stop_ids))
                or self.grammar is not None)


MicroBatch = tuple[list[Slot], list[Choice]]  # decoding slots and their choices, verified in one target forward


def micro_batches(decode: list[Slot], choices: list[Choice], pipeline: bool) -> list[MicroBatch]:
    """One micro-batch, or two balanced by verify tokens (1 + gamma) when the pipeline is on.

    A step in which no slot drafts stays whole: with nothing to overlap, a second micro-batch
    would only cost a second target forward (two launches of every layer, the weights read twice).
    """
    drafts = any(c.drafter is not None and c.gamma > 0 for c in choices)
    if not pipeline or len(decode) < 2 or not drafts:
        return [(decode, choices)]
    size = [max(c.gamma, c.nodes) + 1 for c in choices]
    order = sorted(range(len(decode)), key=lambda i: -size[i])
    halves: list[list[int]] = [[], []]
    load = [0, 0]
    for i in order:
        g = 0 if load[0] <= load[1] else 1
        halves[g].append(i)
        load[g] += size[i]
    return [([decode[i] for i in sorted(h)], [choices[i] for i in sorted(h)]) for h in halves]


@dataclass
class Plan:
    """The packed verify batch of one step."""

    decode: list[Slot]  # decoding slots, in segment order
    chunks: list[tuple[Slot, int]]  # (slot, chunk length) prefill chunks, after the decode segments
    drafts: list[list[int]]  # [len(decode)] draft tokens per decoding slot (a tree: its nodes)
    trees: list[list[int] | None]  # [len(decode)] a token tree's node parents (DraftTree), None for a chain
    seg: Segments
    flat: torch.Tensor  # [N] token ids
    logits_rows: list[int]  # rows that need logits: every decode row, the last row of finishing chunks, then `prompt`s
    finishing: list[Slot]  # slots whose prompt completes in this step (they take their first token)
    # (slot, first position, rows) of prompt chunks scored for prompt logprobs: their rows close logits_rows
    prompt: list[tuple[Slot, int, int]] = field(default_factory=list)
    reused: int = 0  # prompt tokens copied into slots instead of prefilled (prefill_share.py)


def step_record(plan: Plan, choices: list[Choice], verdict: Verdict, generated: int,
                times: dict[str, float]) -> StepRecord:
    """What one step did, for RunStats: the packed forward, what each drafter drafted and had accepted."""
    drafted: Counter = Counter()
    accepted: Counter = Counter()
    spec: Counter = Counter()
    pulls: Counter = Counter()
    for s, c, d, k in zip(plan.decode, choices, plan.drafts, verdict.accepted):
        name = c.drafter or "none"
        pulls[name] += 1
        if d:
            drafted[name] += len(d)
            accepted[name] += k
            spec[name] += 1
    return StepRecord(
        active=len(plan.decode) + len(plan.chunks),
        forward_tokens=plan.seg.num_tokens,
        prefill_tokens=sum(n for _, n in plan.chunks),
        reused_tokens=plan.reused,
        generated=generated,
        packed_cells=plan.seg.packed_tokens(),
        padded_cells=plan.seg.padded_tokens(),
        stage_s=times,
        drafted=dict(drafted),
        accepted=dict(accepted),
        spec_steps=dict(spec),
        pulls=dict(pulls),
    )


def reach(drafts: list[int], parents: list[int] | None) -> int:
    """Draft tokens on the longest path: a chain's length, a tree's depth."""
    return len(drafts) if parents is None else max(DraftTree(drafts, parents).depths(), default=0)


def lap(times: dict[str, float], stage: str, t0: float) -> float:
    """Adds the seconds since t0 to times[stage]; returns now."""
    t = time.perf_counter()
    times[stage] = times.get(stage, 0.0) + t - t0
    return t
