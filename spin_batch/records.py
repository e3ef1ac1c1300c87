"""What flows between io and the engine: a Request in, a Completion out.

A leaf module: io/ builds Requests from input rows and turns Completions into output rows; the
engine decodes Requests into Completions. Neither imports the other; the runner joins them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .grammars import Structured

#: The most top tokens a request may ask for, per generated or prompt token (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
#: Which distribution logprobs are taken from (vLLM's logprobs_mode names): the raw logits' or the sampler's.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


MAX_SAMPLES = 128  # the most samples one prompt may ask for (sampling.n, a row's n)


@dataclass(frozen=True)
class RowParams:
    """One row's own generation settings; a field left None takes the job's value.

    The reader validates each value (a bad one makes the row an error row), so the engine can
    take them as they are.
    """

    max_tokens: int | None = None  # >= 0; 0: score the prompt only
    temperature: float | None = None  # >= 0; 0: greedy
    top_p: float | None = None  # (0, 1]
    top_k: int | None = None  # >= 0; 0: off
    stop: tuple[str, ...] | None = None  # stop strings (each non-empty)
    seed: int | None = None  # the row's random stream (sampling); else derived from the job seed and the id
    logprobs: int | None = None  # 0..20: each generated token's log-probability and this many top tokens
    prompt_logprobs: int | None = None  # 0..20: the same for each prompt token (vLLM's extension)
    stop_token_ids: tuple[int, ...] | None = None  # token ids that end the completion (each >= 0)
    min_tokens: int | None = None  # >= 0: EOS, stop token ids and stop strings cannot end it sooner
    min_p: float | None = None  # [0, 1]
    presence_penalty: float | None = None  # [-2, 2]
    frequency_penalty: float | None = None  # [-2, 2]
    repetition_penalty: float | None = None  # > 0; 1: off
    logit_bias: tuple[tuple[int, float], ...] | None = None  # (token id, bias in [-100, 100])
    chat_template_kwargs: Mapping[str, Any] | None = None  # extra arguments of the chat template

    def over(self, base: RowParams) -> RowParams:
        """These settings, with each field left None taken from ``base``."""
        return RowParams(**{f.name: getattr(base, f.name) if getattr(self, f.name) is None else getattr(self, f.name)
                            for f in fields(self)})
    n: int | None = None  # >= 1: samples of the prompt (each its own output row, `index` 0..n-1)
    structured: Structured | None = None  # the text's constraint (grammars.py): choice, regex, JSON schema ...


NO_PARAMS = RowParams()


@dataclass(frozen=True)
class Request:
    """One input row.

    Attributes:
        source: ``"<absolute shard path>#<0-based row index>"``: where the row was read (information;
            the resume key is the id and ``digest``, io/identity.py).
        id: the row id as a string, or None when the row has no usable id.
        prompt: plain-text prompt, or None.
        messages: chat messages ``({"role": str, "content": str}, ...)``, or None.
        error: when set the row is bad; it becomes an error row and is never decoded.
        params: the row's own generation settings (RowParams; all None: the job's).
        endpoint: the OpenAI batch line's kind ("chat" for /v1/chat/completions, "completion"
            for /v1/completions), None for a plain row.
        model: the OpenAI body's "model", echoed in the response line; None otherwise.
        keep: the input columns carried to the output row (output.keep_columns), or None.
        digest: what decides the row's text, digested (io/identity.py); None where not known.
        input_key: set for a row keyed by its place, not by its id alone (io/identity.py).
    """

    source: str
    id: str | None
    prompt: str | None
    messages: tuple[dict, ...] | None
    error: str | None = None
    params: RowParams = NO_PARAMS
    endpoint: Literal["chat", "completion"] | None = None
    model: str | None = None
    keep: Mapping[str, Any] | None = None
    digest: str | None = field(default=None, compare=False)  # derived from the fields above
    input_key: str | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        """True when the row is valid and should be decoded."""
        return self.error is None


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target at its position, with the most likely tokens there.

    ``rank`` is the token's place in that distribution (1: the most likely). The top lists hold the
    K tokens the request asked for, most likely first (empty when it asked for 0).
    """

    token_id: int
    token: str  # the token decoded alone
    logprob: float
    rank: int
    top_ids: tuple[int, ...] = ()
    top_tokens: tuple[str, ...] = ()
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Completion:
    """The engine's answer to one Request: a completion, or an error (status "error")."""

    request: Request
    text: str | None
    finish_reason: Literal["stop", "length", "error"]
    prompt_tokens: int
    completion_tokens: int = 0
    error: str | None = None
    num_spec_steps: int = 0  # verify steps in which the request had drafts
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0  # accepted drafts that reached the completion
    drafter_pulls: Mapping[str, int] = field(default_factory=dict)  # steps per drafter ("none": no draft)
    decode_time_s: float = 0.0
    token_ids: tuple[int, ...] = ()  # the generated token ids (what the bench compares across methods)
    share_s: float = 0.0  # the request's share of the steps' wall time (a step's time / the slots it served)
    logprobs: tuple[TokenLogprob, ...] | None = None  # [completion_tokens] when the request asked for them
    # [prompt_tokens] when it asked for them; the first is None (no distribution comes before it)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    index: int = 0  # which sample of the request (n > 1), 0 for the first
    more: tuple[Completion, ...] = ()  # on sample 0's completion: samples 1 .. n - 1, in order

    @property
    def status(self) -> Literal["ok", "error"]:
        return "error" if self.error is not None else "ok"

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per speculative step (accepted drafts + the step's own token); None without one."""
        if not self.num_spec_steps:
            return None
        return (self.num_accepted_draft_tokens + self.num_spec_steps) / self.num_spec_steps

    @classmethod
    def failed(cls, request: Request, message: str, prompt_tokens: int = 0) -> Completion:
        return cls(request, None, "error", prompt_tokens, error=message)
