"""Prompt-lookup drafting: continue the most recent earlier occurrence of the current suffix.

No model runs. The longest suffix n-gram (max_ngram down to min_ngram) that occurred before
is looked up in prompt + generated tokens; the tokens that followed it are the draft. It may
propose fewer tokens than asked, or none.

Confidence gate (DraftRequest.min_prob): the drafter learns, from what the verifier kept of its
own drafts, how often a token drafted after a match of length n is accepted (a_n, pooled over
requests), and proposes only as many tokens l as keep a_n^l at or above the floor. A lookup is
a deterministic function of the context, so this changes what is proposed, never the output.

Token trees (DraftRequest.nodes > 1): the text often continues a suffix in several ways. The tree
merges the continuations of several earlier matches into a trie: the latest match of the longest
suffix first (the chain draft, so nodes 0.. are the chain when the budget allows), then that
suffix's earlier matches, then shorter suffixes' matches, until the tree has `nodes` nodes. Each
continuation is gated as a chain is (a node at depth l from a match of length n stays while
a_n^l >= min_prob); a node several continuations share stays if any of them keeps it. Siblings
are distinct tokens picked by rule, not drawn: q is one-hot per node (None), which is exact.
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import Drafter, DraftRequest, Proposal, common_prefix
from .trie import Trie

MAX_MATCHES = 32  # continuations a tree considers per request and step
MAX_PROBES = 512  # positions compared against a suffix once the first match is found


def lookup_match(tokens: list[int], gamma: int, min_ngram: int, max_ngram: int) -> tuple[int, list[int]]:
    """(n, draft): up to gamma tokens that followed the latest earlier match of the last n tokens."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        # scan right to left for the latest earlier match that has at least one follower
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i:i + n] == suffix:
                return n, tokens[i + n : i + n + gamma]
    return 0, []


def lookup(tokens: list[int], gamma: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Draft up to gamma tokens by matching the last n tokens against earlier text."""
    return lookup_match(tokens, gamma, min_ngram, max_ngram)[1]


def lookup_matches(tokens: list[int], gamma: int, min_ngram: int, max_ngram: int,
                   limit: int = MAX_MATCHES, probes: int = MAX_PROBES) -> Iterator[tuple[int, list[int]]]:
    """(n, continuation) for earlier matches of the suffix, longest suffix first and latest match first
    within one length; the first is lookup_match's. Continuations start at distinct positions (a match
    of the last n tokens is also one of the last n - 1, which adds nothing). Bounded: at most `limit`
    continuations, and after the first match at most `probes` more positions compared."""
    size = len(tokens)
    rev = tokens[::-1]  # rev[j] is tokens[size - 1 - j]: list.index scans right to left in C
    starts: set[int] = set()
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n:]
        j = n  # position size - n - 1, the latest with a follower
        while probes > 0:
            try:
                j = rev.index(suffix[0], j)
            except ValueError:
                break
            i, j = size - 1 - j, j + 1
            probes -= 1 if starts else 0
            if tokens[i:i + n] == suffix and i + n not in starts:
                starts.add(i + n)
                yield n, tokens[i + n : i + n + gamma]
                if len(starts) >= limit:
                    return


class NgramDrafter(Drafter):
    kind = "ngram"
    gates = True
    trees = True

    def __init__(self, name: str, min_ngram: int = 1, max_ngram: int = 3):
        super().__init__(name)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        # per match length n: [accepted draft tokens, chains that ended in a rejection]. The prior is
        # optimistic (0.75): a gate above the estimate proposes nothing, so it would never learn.
        self.outcomes = {n: [3.0, 1.0] for n in range(min_ngram, max_ngram + 1)}
        # slot -> (tokens before the draft, its branches: (n, path from the root) each; a chain: one)
        self.pending: dict[int, tuple[int, list[tuple[int, list[int]]]]] = {}

    def rate(self, n: int) -> float:
        """Per-token acceptance of drafts after a match of length n, so far."""
        acc, rej = self.outcomes[n]
        return acc / (acc + rej)

    def gated(self, n: int, draft: list[int], min_prob: float) -> list[int]:
        """The draft's first l tokens, l the most with rate(n)^l >= min_prob (all when the floor is 0)."""
        if not draft or min_prob <= 0:
            return draft
        a, keep, conf = self.rate(n), 0, 1.0
        while keep < len(draft) and conf * a >= min_prob:
            conf *= a
            keep += 1
        return draft[:keep]

    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        drafts, shapes = [], []
        for r in reqs:
            draft, shape, branches = self._tree(r) if r.nodes > 1 else self._chain(r)
            if branches:
                self.pending[r.slot] = (len(r.tokens), branches)
            drafts.append(draft)
            shapes.append(shape)
        trees = any(s is not None for s in shapes)
        return Proposal(drafts, [None] * len(reqs), shapes if trees else None)

    def _chain(self, r: DraftRequest) -> tuple[list[int], None, list[tuple[int, list[int]]]]:
        n, draft = lookup_match(r.tokens, r.gamma, self.min_ngram, self.max_ngram)
        draft = self.gated(n, draft, r.min_prob)
        return draft, None, [(n, draft)] if draft else []

    def _tree(self, r: DraftRequest) -> tuple[list[int], list[int] | None, list[tuple[int, list[int]]]]:
        """The continuations of several matches merged into a trie of at most r.nodes nodes. A branch
        is recorded for learning only where it added a node (a continuation already in the trie adds
        nothing to verify)."""
        trie, branches = Trie(r.nodes), []
        for n, cont in lookup_matches(r.tokens, r.gamma, self.min_ngram, self.max_ngram):
            cont = self.gated(n, cont, r.min_prob)
            before = trie.size
            placed = trie.insert(cont)
            if trie.size > before:
                branches.append((n, cont[: len(placed)]))
            if trie.full:
                break
        return trie.tokens, trie.shape(), branches

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        """Learn from what the verifier kept: the committed tokens start with the accepted drafts.

        A tree is learnt from the one branch that matched: the branch with the longest common prefix
        with the committed tokens (the earliest such branch on a tie, so a tree that matched nowhere
        counts against the chain's match length). That branch is the path the verifier followed; the
        other branches are alternatives to it, and counting them as rejections would lower a_n by the
        tree's width and so starve the chain gate. a_n thus estimates the acceptance of the matched
        continuation, the chain's rule when the tree is a chain.
        """
        got = self.pending.pop(slot, None)
        if got is None:
            return
        start, branches = got
        new = tokens[start:]
        k, (n, draft) = max(((common_prefix(b[1], new), b) for b in branches), key=lambda kb: kb[0])
        self.outcomes[n][0] += k
        self.outcomes[n][1] += 1.0 if k < len(draft) else 0.0

    def on_admit(self, slot: int) -> None:
        self.pending.pop(slot, None)

    def stats(self) -> dict[str, float]:
        return {f"acceptance_after_{n}gram": round(self.rate(n), 4) for n in self.outcomes}
