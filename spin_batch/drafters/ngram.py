"""Prompt-lookup drafting: continue the most recent earlier occurrence of the current suffix.

No model runs. The longest suffix n-gram (max_ngram down to min_ngram) that occurred before
is looked up in prompt + generated tokens; the tokens that followed it are the draft. It may
propose fewer tokens than asked, or none.
"""

from __future__ import annotations

from ..engine.sampling import SamplingParams
from .base import Drafter, DraftRequest, Proposal


def lookup(tokens: list[int], gamma: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Draft up to gamma tokens by matching the last n tokens against earlier text."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = tokens[size - n:]
        first = suffix[0]
        # scan right to left for the latest earlier match that has at least one follower
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i:i + n] == suffix:
                return tokens[i + n : i + n + gamma]
    return []


class NgramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, name: str, min_ngram: int = 1, max_ngram: int = 3):
        super().__init__(name)
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, reqs: list[DraftRequest], sp: SamplingParams) -> Proposal:
        drafts = [lookup(r.tokens, r.gamma, self.min_ngram, self.max_ngram) for r in reqs]
        return Proposal(drafts, [None] * len(reqs))
