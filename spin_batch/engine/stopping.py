"""When a request is done, and the text it ends with.

A request stops at an end-of-sequence token (unless the job ignores EOS) or one of its
stop_token_ids, at its max_tokens, at the context limit, or at the first stop string in its decoded
completion. With min_tokens, no stop string ends the completion before its min_tokens-th token (as
in vLLM: an occurrence wholly within the text of the first min_tokens - 1 tokens is passed over);
EOS and the stop token ids cannot come earlier (engine/controls.py masks them). A verify step may add
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
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids: end the completion like EOS, even with ignore_eos
    min_tokens: int = 0  # no stop string ends the completion before this many tokens

    def stops_at(self, token: int) -> bool:
        """Whether this token ends the completion (an EOS or a stop token id)."""
        return token in self.eos or token in self.stop_ids


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
            if rule.stops_at(t):
                reason = "stop"
            elif len(tokens) - prompt_len >= rule.max_tokens or len(tokens) >= rule.max_model_len:
                reason = "length"
            if reason:
                break
        if rule.stop and self._stop_in_tail(tokens[prompt_len:], added, rule.stop):
            gen = tokens[prompt_len:]
            # an occurrence counts where it ends past the text of the first min_tokens - 1 tokens
            floor = len(self.decode(gen[: rule.min_tokens - 1])) if rule.min_tokens > 1 else 0
            for n in range(max(len(gen) - added + 1, rule.min_tokens), len(gen) + 1):
                text = self.decode(gen[:n])
                found = [i for x in rule.stop if (i := text.find(x, max(floor - len(x) + 1, 0))) >= 0]
                cut = min(found, default=-1)
                if cut >= 0:
                    dropped = len(gen) - n
                    del tokens[len(tokens) - dropped:]
                    return Extended(added - dropped, "stop", text[:cut])
        return Extended(added, reason)

    def text(self, generated: list[int], rule: StopRule) -> str:
        """The completion's text when no stop string cut it: without a final EOS or stop token id (as
        vLLM leaves a stop token's text out)."""
        body = generated[:-1] if generated and rule.stops_at(generated[-1]) else generated
        return self.decode(body)

    def _stop_in_tail(self, generated: list[int], added: int, stop: tuple[str, ...]) -> bool:
        """Whether a stop string may end in this step's tokens: decodes only a short tail, not the
        whole completion at every step (a token decodes to at least one character but for rare
        partial bytes, so 4 tokens per stop character plus slack covers it)."""
        window = added + 4 * max(len(x) for x in stop) + 8
        tail = self.decode(generated[-window:])
        return any(x in tail for x in stop)
