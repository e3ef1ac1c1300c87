"""The drafter protocol: drafters only propose; the verifier (engine/verify.py) decides."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling import GREEDY, SamplingParams


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (a draft's accepted length against what was committed)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class DraftGrammar(Protocol):
    """A slot's output constraint as its drafter sees it (engine/structured.py's DraftGrammar): what the grammar
    allows after a draft path (tokens drafted past the committed ones). Asking never moves the slot's state."""

    def refused(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[n, V] bool over target ids: True where the token is refused after paths[r]; all True where nothing
        may follow paths[r]."""

    def ends(self, path: Sequence[int]) -> bool:
        """Whether nothing may be drafted after path (it completes the grammar or ends in a stop token)."""

    def takes(self, tokens: list[int]) -> int:
        """How many leading tokens of a chain the grammar takes (the loop cuts the chain there)."""

    def forced(self, path: Sequence[int], cap: int) -> list[int]:
        """The tokens the grammar forces after path (at most cap): draft tokens that need no forward."""


@dataclass
class DraftRequest:
    """What a drafter sees of one slot at one step."""

    slot: int
    tokens: list[int]  # committed tokens: prompt + generated; the last one is not yet in the target cache
    gamma: int  # tokens asked for (>= 1); a drafter may propose fewer
    gen: torch.Generator | None  # the request's random stream (sampling only)
    # Confidence floor: a drafter that knows its own distribution (a model) stops the chain before
    # a position where the product of its top probabilities would fall below this. The test uses
    # only the draft distributions, never the sampled token, so it keeps sampling exact. 0: off.
    min_prob: float = 0.0
    sp: SamplingParams = GREEDY  # the request's own sampling settings (greedy: argmax, q None)
    # Token-tree budget: a drafter with `trees` may propose a tree of at most this many nodes, no
    # deeper than gamma, instead of a chain (0 or 1: a chain). Each node must clear min_prob as a
    # chain's position does (its path's confidence product), so the floor prices every node.
    nodes: int = 0
    # Draft room past gamma (the context and max_tokens allow this many more). A drafter whose chain
    # forward checks guesses (lookahead, model.py) keeps the picks that its last forward's guesses
    # confirm past gamma, within this room: tokens that cost no draft forward of their own.
    room: int = 0
    # The slot's output constraint, None for free text. A drafter that knows its distribution proposes only
    # tokens it allows (masks its logits by it along each draft path); the loop cuts any draft at the first
    # token it refuses.
    grammar: DraftGrammar | None = None


@dataclass
class Proposal:
    tokens: list[list[int]]  # [S] draft tokens per request (a chain: len <= gamma; a tree: its nodes)
    probs: list[torch.Tensor | None]  # [S] each [len, V] draft distribution q; None: deterministic (one-hot q)
    # [S] per request, None for a chain, or a tree's parents: node i's parent among the request's nodes
    # (-1: the root, the last committed token; a parent precedes its children), every node at depth
    # <= gamma. A tree's q is per node given its earlier siblings (engine/tree_verify.py says which q is
    # exact); a drafter that picks siblings by rank gives None. None here: every request got a chain.
    parents: list[list[int] | None] | None = None

    def tree(self, i: int) -> list[int] | None:
        """Request i's tree parents, or None for a chain."""
        return None if self.parents is None else self.parents[i]


@dataclass(frozen=True)
class Capabilities:
    """What a drafter does beyond proposing chains, declared for the policy that chooses for it
    (selection.factory.make_policy): the confidence floor and token trees."""

    gates: bool = False  # honours DraftRequest.min_prob (a drafter that knows its own distribution)
    trees: bool = False  # may answer DraftRequest.nodes with a token tree (Proposal.parents)


class Drafter(ABC):
    """A source of draft tokens. Per-slot state, if any, is keyed by the batch slot index.

    A drafter declares what it can do in `gates` and `trees` (per class, or per instance where it depends on
    what it wraps); the policy reads them as `capabilities`."""

    kind: str = ""
    gates = False  # honours DraftRequest.min_prob (a drafter that knows its own distribution)
    trees = False  # may answer DraftRequest.nodes with a token tree (Proposal.parents)
    # A models.distilled.TargetFeatures the loop fills at every target forward, for drafters that read
    # the target's hidden states; None for the others.
    features = None

    def __init__(self, name: str):
        self.name = name

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(self.gates, self.trees)

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> Proposal: ...

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        """After verification: the slot's committed tokens (prompt + generated), read only."""

    def on_admit(self, slot: int) -> None:
        """A new request took this slot: forget whatever the drafter held for it."""

    def stats(self) -> dict[str, float]:
        """Drafter-specific counters for summary.json (empty by default)."""
        return {}
