"""The loop's settings, and what one request decodes with: the job's settings overridden by the row's own.

A row's own settings (RowParams) replace the job's field by field. An OpenAI batch line's omitted
fields first take LoopSettings.openai_defaults (the model's generation config, as vLLM does), then
the job's. :func:`refusal` says why a request cannot be decoded at all, as vLLM answers 400.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..grammars import Structured
from ..records import Request, RowParams
from ..sampling import SamplingParams
from .controls import NO_CONTROLS, LogitControls
from .logprobs import NO_LOGPROBS, LogprobAsk
from .stopping import StopRule


@dataclass(frozen=True)
class LoopSettings:
    slots: int
    max_model_len: int
    max_num_batched_tokens: int
    max_tokens: int  # the job's; a row's own params override it, as they do sampling, seed and stop
    sampling: SamplingParams
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    pipeline: bool = False  # two micro-batches: one drafts while the other verifies
    stop_token_ids: frozenset[int] = frozenset()  # the job's; a row's own replace them
    min_tokens: int = 0
    controls: LogitControls = NO_CONTROLS  # the job's min_p, logit_bias and penalties (engine/controls.py)
    # what an OpenAI line's omitted fields take before the job's (the model's generation config); None: the job's
    openai_defaults: RowParams | None = None
    logprobs: LogprobAsk = NO_LOGPROBS  # the job's; a row's own logprobs / prompt_logprobs override it
    n: int = 1  # samples per prompt (the job's; a row's own params override it)
    structured: Structured | None = None  # the job's output constraint (engine/structured.py); a row's own replaces it


def request_settings(cfg: LoopSettings, req: Request) -> tuple[SamplingParams, StopRule, LogitControls]:
    """A request's sampling settings, stop rule and logits controls."""
    own = req.params
    if req.endpoint is not None and cfg.openai_defaults is not None:
        own = own.over(cfg.openai_defaults)
    job, jc = cfg.sampling, cfg.controls
    sp = SamplingParams(
        temperature=job.temperature if own.temperature is None else own.temperature,
        top_k=job.top_k if own.top_k is None else own.top_k,
        top_p=job.top_p if own.top_p is None else own.top_p,
        sampler=job.sampler,
    )
    rule = StopRule(
        max_tokens=cfg.max_tokens if own.max_tokens is None else own.max_tokens,
        max_model_len=cfg.max_model_len,
        stop=cfg.stop if own.stop is None else own.stop,
        eos=frozenset() if cfg.ignore_eos else cfg.eos_token_ids,
        stop_ids=cfg.stop_token_ids if own.stop_token_ids is None else frozenset(own.stop_token_ids),
        min_tokens=cfg.min_tokens if own.min_tokens is None else own.min_tokens,
    )
    controls = LogitControls(
        min_p=jc.min_p if own.min_p is None else own.min_p,
        logit_bias=jc.logit_bias if own.logit_bias is None else own.logit_bias,
        repetition_penalty=jc.repetition_penalty if own.repetition_penalty is None else own.repetition_penalty,
        presence_penalty=jc.presence_penalty if own.presence_penalty is None else own.presence_penalty,
        frequency_penalty=jc.frequency_penalty if own.frequency_penalty is None else own.frequency_penalty,
    )
    return sp, rule, controls


def structured_of(cfg: LoopSettings, req: Request) -> Structured | None:
    """A request's output constraint: its own, else the job's."""
    return cfg.structured if req.params.structured is None else req.params.structured


def refusal(cfg: LoopSettings, req: Request, ids: list[int], vocab: int) -> str | None:
    """Why a request with these prompt ids cannot be decoded (vLLM's 400 answers, in its words), or None.

    The row's own max_tokens must fit the context beside the prompt; the job's is a cap, which the
    context may cut short (finish_reason "length").
    """
    limit = cfg.max_model_len
    _, rule, controls = request_settings(cfg, req)
    if rule.max_tokens == 0 and len(ids) > limit:  # scored only: the prompt alone must fit
        return f"prompt has {len(ids)} tokens, more than max_model_len {limit}"
    if rule.max_tokens > 0 and len(ids) + 1 > limit:
        return f"prompt has {len(ids)} tokens; max_model_len {limit} leaves no room to generate"
    own = req.params.max_tokens
    if own is not None and len(ids) + own > limit:
        return (f"'max_tokens' or 'max_completion_tokens' is too large: {own}. This model's maximum context "
                f"length is {limit} tokens and your request has {len(ids)} input tokens ({own} > {limit} - "
                f"{len(ids)})")
    if rule.min_tokens > rule.max_tokens:
        return f"min_tokens must be less than or equal to max_tokens={rule.max_tokens}, got {rule.min_tokens}"
    outside = [t for t, _ in controls.logit_bias if t >= vocab]
    if outside:
        return f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}"
    return None
