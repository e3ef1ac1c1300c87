"""When a request is done, and the text it ends with.

A request stops at an end-of-sequence token (unless the job ignores EOS), at its max_tokens, at
the context limit, or at the first stop string in its decoded completion. A verify step may add
several tokens at once; the completion then ends where one token a step would have ended it: at
the EOS or the token that reaches a limit, or at the token that completes the first stop string
(the text is cut before that string).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopRule:
    """One request's stopping conditions (the job's, with the row's own max_tokens and stop)."""

    max_tokens: int
    max_model_len: int  # prompt + completion
    stop: tuple[str, ...] = ()
    eos: frozenset[int] = frozenset()  # empty when the job ignores EOS


@dataclass(frozen=True)
class Extended:
    added: int  # tokens of the step kept in the completion
    finish_reason: str | None  # "stop", "length", or None: the request goes on
    text: str | None = None  # the completion's text when a stop string cut it


class Stopping:
    """Applies StopRules; `decode(ids)` is the tokenizer's decode (special tokens skipped)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode

    def extend(self, tokens: list[int], prompt_len: int, new: list[int], rule: StopRule) -> Extended:
        """Append a step's new tokens to `tokens` (prompt + completion), dropping those past a stop."""
        added, reason = 0, None
        for t in new:
            tokens.append(t)
            added += 1
            if t in rule.eos:
                reason = "stop"
            elif len(tokens) - prompt_len >= rule.max_tokens or len(tokens) >= rule.max_model_len:
                reason = "length"
            if reason:
                break
        if rule.stop and self._stop_in_tail(tokens[prompt_len:], added, rule.stop):
            gen = tokens[prompt_len:]
            for n in range(len(gen) - added + 1, len(gen) + 1):
                text = self.decode(gen[:n])
                cut = min((text.find(x) for x in rule.stop if x in text), default=-1)
                if cut >= 0:
                    dropped = len(gen) - n
                    del tokens[len(tokens) - dropped:]
                    return Extended(added - dropped, "stop", text[:cut])
        return Extended(added, reason)

    def text(self, generated: list[int], rule: StopRule) -> str:
        """The completion's text when no stop string cut it: without a final EOS token."""
        body = generated[:-1] if generated and generated[-1] in rule.eos else generated
        return self.decode(body)

    def _stop_in_tail(self, generated: list[int], added: int, stop: tuple[str, ...]) -> bool:
        """Whether a stop string may end in this step's tokens: decodes only a short tail, not the
        whole completion at every step (a token decodes to at least one character but for rare
        partial bytes, so 4 tokens per stop character plus slack covers it)."""
        window = added + 4 * max(len(x) for x in stop) + 8
        tail = self.decode(generated[-window:])
        return any(x in tail for x in stop)
