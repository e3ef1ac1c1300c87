"""The job's sections: input, output, target, spin, batch and sampling.

Each is a frozen dataclass whose ``_parse`` reads its mapping through a
:class:`~spin_batch.config.parsing._Section`, checking each key beside the field it fills.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..grammars import StructuredError, problem, structured_from
from ..records import LOGPROBS_MODES, MAX_LOGPROBS, MAX_SAMPLES
from .parsing import (
    BACKENDS,
    _bool,
    _choice,
    _describe,
    _dtype,
    _target_dtype,
    _int,
    _Invalid,
    _num,
    _optional,
    _path,
    _paths,
    _pattern,
    _Section,
    _switch,
    _text,
    _texts,
)


# --------------------------------------------------------------------------- input / output / target


@dataclass(frozen=True)
class InputConfig:
    """Where prompts come from and how rows are interpreted."""

    paths: tuple[str, ...]
    # auto: by suffix, and a JSONL file whose first row has custom_id and url/body is an OpenAI batch file
    format: Literal["auto", "jsonl", "parquet", "openai"] = "auto"
    id_column: str = "id"  # the column options are not used for OpenAI batch lines (the body is the request)
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    # a column holding each row's own sampling settings (an object: max_tokens, temperature, top_p,
    # top_k, stop, seed; null or a field left out: the job's value)
    params_column: str | None = None
    chat_template: Literal["auto", True, False] = "auto"
    # extra arguments of the chat template (``{enable_thinking: false}``); a row's own replace them
    chat_template_kwargs: dict[str, Any] | None = None
    system_prompt: str | None = None
    # a JSONL line longer than this becomes an error row without being read whole (memory stays bounded)
    max_line_bytes: int = 64 * 1024 * 1024

    @classmethod
    def _parse(cls, s: _Section) -> InputConfig:
        return cls(
            paths=s.take("paths", _paths),
            format=s.take("format", _choice("auto", "jsonl", "parquet", "openai")),
            id_column=s.take("id_column", _text()),
            prompt_column=s.take("prompt_column", _text()),
            messages_column=s.take("messages_column", _text()),
            params_column=s.take("params_column", _optional(_text())),
            chat_template=s.take("chat_template", _choice("auto", True, False)),
            chat_template_kwargs=s.take("chat_template_kwargs", _optional(_kwargs)),
            system_prompt=s.take("system_prompt", _optional(_text(nonempty=False))),
            max_line_bytes=s.take("max_line_bytes", _int(lo=1)),
        )


@dataclass(frozen=True)
class OutputConfig:
    """Where results go, in which form, with which input columns, and how often they are flushed.

    The Parquet parts under ``dir/outputs`` are always written (they are the resume log);
    ``format`` openai adds ``dir/results.jsonl`` (OpenAI batch response lines) at the end of a
    run, both adds it and ``dir/results.parquet``. ``keep_columns`` picks the input columns that
    come back beside the output columns; an input column named like an output column comes back
    as ``column_prefix`` + its name.
    """

    dir: str
    rows_per_part: int = 256
    flush_interval_s: float = 60.0
    stats_interval_s: float = 10.0
    format: Literal["parquet", "openai", "both"] = "parquet"
    keep_columns: Literal["all", "none"] | tuple[str, ...] = "all"
    column_prefix: str = "input_"

    @classmethod
    def _parse(cls, s: _Section) -> OutputConfig:
        positive = _num(lambda x: x > 0, "> 0")
        return cls(
            dir=s.take("dir", _path),
            rows_per_part=s.take("rows_per_part", _int(lo=1)),
            flush_interval_s=s.take("flush_interval_s", positive),
            stats_interval_s=s.take("stats_interval_s", positive),
            format=s.take("format", _choice("parquet", "openai", "both")),
            keep_columns=s.take("keep_columns", _keep_columns),
            column_prefix=s.take("column_prefix", _text()),
        )


def _keep_columns(value: Any) -> str | tuple[str, ...]:
    """all, none, or a list of column names (each non-empty, none twice)."""
    if isinstance(value, str):
        return _choice("all", "none")(value)
    if not isinstance(value, (list, tuple)):
        raise _Invalid(f"expected all, none or a list of column names, got {_describe(value)}")
    names = _texts(nonempty=False)(value)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _Invalid(f"names a column more than once: {', '.join(twice)}")
    return names


@dataclass(frozen=True)
class TargetConfig:
    """The model whose outputs are produced (and verified against)."""

    model: str = "builtin:smollm2-135m"
    # auto: bfloat16 where the CPU has bfloat16 dot products and the C kernels run it (or a GPU takes it),
    # else float32; resolved before anything runs (preflight.resolve_dtype)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    # the kernels every model of the job runs on (spin_batch/models/execution.py): auto (CPU: measured per
    # model; CUDA: Triton with CUDA graphs where Triton imports) | c (the C decoder, CPU only) | torch |
    # triton (CPU only under TRITON_INTERPRET=1). Whether they can run here is checked by validate.
    kernels: Literal["auto", "c", "torch", "triton"] = "auto"
    # which code runs the model (docs/backends.md): auto (native where the architecture is ours: Llama,
    # Mistral, Qwen2; else transformers) | native | transformers (transformers' modelling code, our attention)
    backend: Literal["auto", "native", "transformers"] = "auto"
    trust_remote_code: bool = False  # the transformers backend may run modelling code shipped in the folder
    # int8: the target itself runs with int8 weights and int8 inputs on the C int8 GEMM (models/quantize.py), a
    # quarter of float32's bytes a token; its text is the int8 model's (docs/numerics.md), every run and every
    # batch size, and speculation stays exact to it. none: the weights as loaded.
    quantize: Literal["none", "int8"] = "none"
    # the names OpenAI lines may give as body.model, the first one named in responses (vLLM's
    # --served-model-name); empty: target.model. A line naming another model is an error line.
    served_model_name: tuple[str, ...] = ()

    @property
    def c_kernels_allowed(self) -> bool:
        """Whether the target may run on the C kernels (kernels auto or c, the native backend): where bfloat16 is
        batch-invariant, which target.dtype auto asks of it."""
        return self.kernels in ("auto", "c") and self.backend != "transformers"

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_name or (self.model,)

    @classmethod
    def _parse(cls, s: _Section) -> TargetConfig:
        device = _pattern(r"auto|cpu|cuda(:[0-9]+)?", "auto, cpu, cuda or cuda:<index>")
        target = cls(
            model=s.take("model", _path),
            dtype=s.take("dtype", _target_dtype),
            device=s.take("device", device),
            kernels=s.take("kernels", _choice("auto", "c", "torch", "triton")),
            backend=s.take("backend", _choice(*BACKENDS)),
            trust_remote_code=s.take("trust_remote_code", _bool),
            quantize=s.take("quantize", _choice("none", "int8")),
            served_model_name=s.take("served_model_name", _texts(nonempty=False)),
        )
        if s.ok("device", "kernels") and target.kernels == "c" and target.device.startswith("cuda"):
            s.errs.add(s.key_path("kernels"), f"c is the C decoder on CPU; target.device is {target.device}")
        return target


# --------------------------------------------------------------------------- spin / batch / sampling

#: Selector grammar: selector kind -> what its ``:<argument>`` must be
#: (``None`` = takes no argument, ``"drafter"`` = a configured drafter name).
#: ``auto`` is not listed: it is resolved to one of these at parse time.
#: Add new selectors (e.g. ``"ucb": None``) here.
SELECTOR_GRAMMAR: dict[str, str | None] = {
    "none": None,
    "fixed": "drafter",
    "ucb": None,
    "thompson": None,
    "round_robin": None,
}


def _selector_forms() -> str:
    """Human-readable list of accepted selector spellings."""
    forms = ["auto"]
    for kind, arg in SELECTOR_GRAMMAR.items():
        forms.append(kind if arg is None else f"{kind}:<{arg}>")
    return ", ".join(forms)


def _resolve_selector(value: str, names: Sequence[str]) -> str:
    """Validate ``value`` against :data:`SELECTOR_GRAMMAR` and resolve ``auto``."""
    if value == "auto":
        return "ucb" if names else "none"
    kind, sep, arg = value.partition(":")
    if kind not in SELECTOR_GRAMMAR:
        raise _Invalid(f"invalid selector {value!r}; expected one of: {_selector_forms()}")
    arg_type = SELECTOR_GRAMMAR[kind]
    if arg_type is None:
        if sep:
            raise _Invalid(f"selector {kind!r} takes no argument, got {value!r}")
        return value
    if not arg:
        raise _Invalid(f"selector {kind!r} needs an argument: {kind}:<{arg_type}>")
    if arg not in names:
        configured = ", ".join(repr(n) for n in names) or "(none)"
        raise _Invalid(f"unknown drafter {arg!r} in {value!r}; configured drafters: {configured}")
    return value


def _top_k(value: Any) -> int:
    """``0`` or ``-1`` (disabled, normalised to 0) or a positive integer."""
    k = _int()(value)
    if k < -1:
        raise _Invalid(f"must be -1 or 0 (disabled) or an integer >= 1, got {k}")
    return max(k, 0)


@dataclass(frozen=True)
class SpinConfig:
    """Speculative decoding: which drafter to use and how far to speculate."""

    selector: str = "auto"
    num_speculative_tokens: int = 4
    pipeline: Literal["auto", "on", "off"] = "auto"  # auto: off (no measured case where it pays: docs/gpu.md)
    # model drafters stop a chain where their own confidence no longer pays for a verified token
    confidence_gate: bool = True
    # the bandits speculate at a step only while speculating steps measure more goodput than plain ones
    backoff: bool = True
    # token trees: a drafter that grows trees (model drafters) may propose up to this many draft nodes per
    # slot and step, verified in one pass; each node must clear the confidence gate's price, so trees
    # shrink where verified rows are dear (many slots). 0: chains only. At most 63 (64 rows with the root).
    tree_nodes: int = 16
    # start the policy from what earlier runs of this kind learnt on this machine (spin_batch/memory.py):
    # drafters' costs and rates, and where speculation did not pay; never changes a row's text
    warm_start: bool = True

    @classmethod
    def _parse(cls, s: _Section) -> SpinConfig:
        # The selector is resolved against the drafters in _parse_root.
        return cls(
            selector=s.take("selector", _text()),
            num_speculative_tokens=s.take("num_speculative_tokens", _int(lo=1, hi=32)),
            pipeline=s.take("pipeline", _switch),
            confidence_gate=s.take("confidence_gate", _bool),
            backoff=s.take("backoff", _bool),
            tree_nodes=s.take("tree_nodes", _int(lo=0, hi=63)),
            warm_start=s.take("warm_start", _bool),
        )


@dataclass(frozen=True)
class BatchConfig:
    """Continuous-batching capacity and per-step token budget."""

    slots: int = 8
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    # reuse the K/V of prompt prefixes across rows (engine/prefix_cache.py; docs/prefix_cache.md): auto is on
    # where reuse is exact (the target on the C decoder), on | off force it
    prefix_cache: Literal["auto", "on", "off"] = "auto"
    prefix_cache_mb: int = 512  # its byte budget, least recently used blocks out first

    @classmethod
    def _parse(cls, s: _Section) -> BatchConfig:
        slots = s.take("slots", _int(lo=1))
        budget = s.take("max_num_batched_tokens", _int(lo=1))
        if s.ok("slots", "max_num_batched_tokens") and budget < slots:
            s.errs.add(
                s.key_path("max_num_batched_tokens"),
                f"must be >= batch.slots ({slots}), got {budget}",
            )
        return cls(
            slots=slots,
            max_model_len=s.take("max_model_len", _int(lo=16)),
            max_num_batched_tokens=budget,
            prefix_cache=s.take("prefix_cache", _switch),
            prefix_cache_mb=s.take("prefix_cache_mb", _int(lo=1)),
        )


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling parameters (shared by all rows of a job)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # each generated / prompt token's log-probability and its top K (null: none; 0: the token's only)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    # the controls (engine/controls.py; vLLM's meanings and ranges); a row's own replace them
    stop_token_ids: tuple[int, ...] = ()  # token ids that end a completion, as EOS does
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end a completion sooner
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # token id -> bias (a mapping in YAML), clamped to [-100, 100]
    # what an OpenAI line's omitted temperature, top_p, top_k, min_p and repetition_penalty take:
    # model: the model's generation_config.json, else vLLM's defaults (temperature 1), as vLLM
    # does; job: this section's values, as a plain row does
    openai_defaults: Literal["model", "job"] = "model"
    n: int = 1  # samples per prompt, each its own output row (index 0 .. n - 1); the prompt is prefilled once
    sampler: str = "gumbel"  # gumbel: the same text whatever is drafted; rejection (docs/numerics.md)
    # every row's output constraint, as vLLM's structured_outputs: {choice: [...]}, {regex: ...}, {json: schema},
    # {json_object: true} or {grammar: ...} (docs/structured.md); a row's own replaces it
    structured: dict[str, Any] | None = None

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0

    @classmethod
    def _parse(cls, s: _Section) -> SamplingConfig:
        sampling = cls(
            temperature=s.take("temperature", _num(lambda x: x >= 0, ">= 0")),
            top_p=s.take("top_p", _num(lambda x: 0 < x <= 1, "in (0, 1]")),
            top_k=s.take("top_k", _top_k),
            seed=s.take("seed", _int()),
            max_tokens=s.take("max_tokens", _int(lo=0)),
            stop=s.take("stop", _texts(nonempty=False)),
            ignore_eos=s.take("ignore_eos", _bool),
            logprobs=s.take("logprobs", _optional(_int(lo=0, hi=MAX_LOGPROBS))),
            prompt_logprobs=s.take("prompt_logprobs", _optional(_int(lo=0, hi=MAX_LOGPROBS))),
            logprobs_mode=s.take("logprobs_mode", _choice(*LOGPROBS_MODES)),
            stop_token_ids=s.take("stop_token_ids", _token_ids),
            min_tokens=s.take("min_tokens", _int(lo=0)),
            min_p=s.take("min_p", _num(lambda x: 0 <= x <= 1, "in [0, 1]")),
            presence_penalty=s.take("presence_penalty", _num(lambda x: -2 <= x <= 2, "in [-2, 2]")),
            frequency_penalty=s.take("frequency_penalty", _num(lambda x: -2 <= x <= 2, "in [-2, 2]")),
            repetition_penalty=s.take("repetition_penalty", _num(lambda x: x > 0, "> 0")),
            logit_bias=s.take("logit_bias", _logit_bias),
            openai_defaults=s.take("openai_defaults", _choice("model", "job")),
            n=s.take("n", _int(lo=1, hi=MAX_SAMPLES)),
            sampler=s.take("sampler", _choice("gumbel", "rejection")),
            structured=s.take("structured", _optional(_structured)),
        )
        if s.ok("min_tokens", "max_tokens") and sampling.min_tokens > sampling.max_tokens:
            s.errs.add(s.key_path("min_tokens"), f"must be <= sampling.max_tokens ({sampling.max_tokens}), "
                                                 f"got {sampling.min_tokens}")
        return sampling


def _structured(value: Any) -> dict[str, Any]:
    """vLLM's structured_outputs object, which the grammar engine compiles (grammars.py)."""
    try:
        got = structured_from(value, "structured")
    except StructuredError as e:
        raise _Invalid(str(e)) from None
    why = problem(got)
    if why is not None:
        raise _Invalid(why)
    return dict(value)


def _token_ids(value: Any) -> tuple[int, ...]:
    """A list of token ids (integers >= 0)."""
    if not isinstance(value, (list, tuple)):
        raise _Invalid(f"expected a list of token ids, got {_describe(value)}")
    return tuple(_int(lo=0)(x) for x in value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A mapping token id -> bias (or the list of [id, bias] pairs job_to_dict writes), the biases clamped to
    [-100, 100] as vLLM does; sorted by id."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)):
        raise _Invalid(f"expected a mapping of token id -> bias, got {_describe(value)}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _Invalid(f"expected a mapping of token id -> bias, got {_describe(value)}")
        key, bias = pair
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        out[_int(lo=0)(token)] = min(max(_num()(bias), -100.0), 100.0)
    return tuple(sorted(out.items()))


def _kwargs(value: Any) -> dict[str, Any]:
    """A mapping with string keys."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _Invalid(f"expected a mapping of names to values, got {_describe(value)}")
    return dict(value)
