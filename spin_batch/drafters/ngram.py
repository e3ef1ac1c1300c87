"""Prompt-lookup drafting: continue the most recent earlier occurrence of the current suffix.

No model runs. The longest suffix n-gram (max_ngram down to min_ngram) that occurred before
is looked up in prompt + generated tokens; the tokens that followed it are the draft. It may
propose fewer tokens than asked, or none.

Confidence gate (DraftRequest.min_prob): the drafter learns, from what the verifier kept of its
own drafts, how often a token drafted after a match of length n is accepted (a_n, pooled over
requests), and proposes only as many tokens l as keep a_n^l at or above the floor. A lookup is
a deterministic function of the context, so this changes what is proposed, never the output.
"""

from __future__ import annotations

from .base import Drafter, DraftRequest, Proposal, common_prefix


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


class NgramDrafter(Drafter):
    kind = "ngram"
    gates = True

    def __init__(self, name: str, min_ngram: int = 1, max_ngram: int = 3):
        super().__init__(name)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        # per match length n: [accepted draft tokens, chains that ended in a rejection]. The prior is
        # optimistic (0.75): a gate above the estimate proposes nothing, so it would never learn.
        self.outcomes = {n: [3.0, 1.0] for n in range(min_ngram, max_ngram + 1)}
        self.pending: dict[int, tuple[int, list[int], int]] = {}  # slot -> (n, draft, tokens before it)

    def rate(self, n: int) -> float:
        """Per-token acceptance of drafts after a match of length n, so far."""
        acc, rej = self.outcomes[n]
        return acc / (acc + rej)

    def propose(self, reqs: list[DraftRequest]) -> Proposal:
        drafts = []
        for r in reqs:
            n, draft = lookup_match(r.tokens, r.gamma, self.min_ngram, self.max_ngram)
            if draft and r.min_prob > 0:
                a, keep, conf = self.rate(n), 0, 1.0
                while keep < len(draft) and conf * a >= r.min_prob:
                    conf *= a
                    keep += 1
                draft = draft[:keep]
            if draft:
                self.pending[r.slot] = (n, draft, len(r.tokens))
            drafts.append(draft)
        return Proposal(drafts, [None] * len(reqs))

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        """Learn from what the verifier kept: the committed tokens start with the accepted drafts."""
        got = self.pending.pop(slot, None)
        if got is None:
            return
        n, draft, start = got
        new = tokens[start:]
        k = common_prefix(draft, new)
        self.outcomes[n][0] += k
        self.outcomes[n][1] += 1.0 if k < len(draft) else 0.0

    def on_admit(self, slot: int) -> None:
        self.pending.pop(slot, None)

    def stats(self) -> dict[str, float]:
        return {f"acceptance_after_{n}gram": round(self.rate(n), 4) for n in self.outcomes}
