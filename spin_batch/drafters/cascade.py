"""A cascade of drafters: per slot and step, the first member that is confident enough drafts.

The members are tried in the configured order. A member's proposal for a slot is taken when it
has at least `min_tokens` tokens; otherwise the slot falls through to the next member, and the
last member's proposal is taken as it is. Each member is asked only for the slots still open,
so a cheap member listed first (an n-gram lookup) spares the later, costlier ones (a model)
every step it covers.

Why this is worth an arm of its own: the SPIN policy chooses a drafter per request from what
each drafter achieved on average, but an n-gram lookup's worth changes from step to step with
the text (a copy task matches for a whole sentence, then not at all). Its own confidence gate
knows this: it keeps l tokens only while its learned acceptance after a match of that length,
raised to the l-th power, stays at or above the floor the policy sets. So "the lookup kept at
least 2 tokens" marks the steps where it is likely right, and the model drafts the rest.

The confidence floor reaches the members that honour it (`gates`), the tree budget those that grow
trees, and the cascade is gated when any member is: a lookup in front of the target's int8 copy, which
drafts ungated chains (docs/trees.md), keeps its gate, and the copy drafts what the lookup does not
cover at the length the policy asked.
Ungated (the floor of every drafter that does not honour it is 0), the lookup took every match it had,
and a cascade accepted few of its draft tokens.

The cascade proposes what one member proposed, with that member's q (None for a lookup), so
it is exactly as lossless as its members. Members are configured drafters too: the loop admits
and commits them itself, and a model member catches up on the steps it sat out.

Under a grammar (DraftRequest.grammar), a member's chain counts only to the first token the grammar refuses,
where the loop cuts it: a lookup copy the grammar refuses falls through to the model, which drafts what it allows.

Token trees: the members get the request as it is, tree budget (`nodes`) included, and a member's
tree is taken with its parents. A tree has "enough tokens" when its depth (longest root-to-leaf
path) reaches min_tokens: the accepted length a tree can give is its depth, as a chain's is its
length, so a wide but shallow lookup tree still falls through to the model.
"""

from __future__ import annotations

from dataclasses import replace

from .base import Drafter, DraftRequest, Proposal
from .trie import tree_depth


class CascadeDrafter(Drafter):
    kind = "cascade"

    def __init__(self, name: str, members: dict[str, Drafter], min_tokens: int = 2):
        super().__init__(name)
        if len(members) < 2:
            raise ValueError(f"cascade drafter {name!r} needs at least 2 members")
        if min_tokens < 1:
            raise ValueError(f"cascade drafter {name!r}: min_tokens must be >= 1, got {min_tokens}")
        self.members = members
        self.min_tokens = min_tokens
        self.gates = any(m.gates for m in members.values())  # the floor reaches the members that honour it
        self.trees = any(m.trees for m in members.values())  # a tree when a member can give one
        self.counters = {f"drafted_by.{n}": 0 for n in members}

    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list = [None for _ in reqs]
        shapes: list[list[int] | None] = [None for _ in reqs]
        open_ = list(range(len(reqs)))
        last = len(self.members) - 1
        for k, (name, member) in enumerate(self.members.items()):
            if not open_:
                break
            prop = member.propose([_asked(member, reqs[i]) for i in open_])
            still = []
            for j, i in enumerate(open_):
                draft, shape = prop.tokens[j], prop.tree(j)
                depth = len(draft) if shape is None else tree_depth(shape)
                if shape is None and reqs[i].grammar is not None:
                    depth = reqs[i].grammar.takes(draft)  # the loop cuts the rest
                if depth >= min(self.min_tokens, reqs[i].gamma) or k == last:
                    tokens[i], probs[i], shapes[i] = draft, prop.probs[j], shape
                    if draft:
                        self.counters[f"drafted_by.{name}"] += 1
                else:
                    still.append(i)
            open_ = still
        trees = any(s is not None for s in shapes)
        return Proposal(tokens, probs, shapes if trees else None)

    def stats(self) -> dict[str, float]:
        return dict(self.counters)


def _asked(member: Drafter, r: DraftRequest) -> DraftRequest:
    """The request as `member` takes it: the floor and the tree budget only where it honours them."""
    floor, nodes = (r.min_prob if member.gates else 0.0), (r.nodes if member.trees else 0)
    return r if (floor, nodes) == (r.min_prob, r.nodes) else replace(r, min_prob=floor, nodes=nodes)
