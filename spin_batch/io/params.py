"""A row's own generation settings: one check for an OpenAI request body and a params column.

Both name the same sampling fields (``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``top_k``, ``stop``, ``seed``, ``n``, ``logprobs``, ``prompt_logprobs``, and the controls
``stop_token_ids``, ``min_tokens``, ``min_p``, ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, with the chat template's ``chat_template_kwargs``, and structured
output: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and its older ``guided_*`` fields, at most
one of them, read by grammars.py);
:func:`row_params` checks them once and gives a :class:`RowParams`, a field absent or null taking the
job's value. The ranges are vLLM's (``logit_bias`` values are clamped to [-100, 100] as vLLM does). A
bad value raises :class:`ParamError`, which the reader turns into an error row.

``logprobs`` is a count of top tokens (0..20) in a params column, in a ``/v1/completions`` body and in
vLLM's ``prompt_logprobs``; a ``/v1/chat/completions`` body asks with ``logprobs: true`` and
``top_logprobs: K``, as OpenAI's chat API does.

An OpenAI body may hold more than sampling fields. :func:`body_params` accepts the few that do not
change the text (``model``, which is echoed, ``user``, ``metadata`` ...) and fields that spin-batch
cannot honour only at the value that changes nothing (``best_of: 1``, ``echo: false``
...); any other field or value is an error, never silently ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from numbers import Integral, Real
from typing import Any

from ..grammars import GUIDED, Structured, StructuredError, from_guided, from_response_format, problem, structured_from
from ..records import MAX_LOGPROBS, MAX_SAMPLES, NO_PARAMS, RowParams

__all__ = ["SAMPLING_FIELDS", "ParamError", "body_params", "column_params", "row_params"]

#: The per-row sampling fields, in an OpenAI body and in a params column alike.
SAMPLING_FIELDS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "logprobs",
                   "prompt_logprobs", "stop_token_ids", "min_tokens", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "chat_template_kwargs",
                   "response_format", "structured_outputs", *GUIDED)

#: Body fields that do not change the text: accepted and ignored (``model`` is echoed).
IGNORED_FIELDS = frozenset({"model", "user", "metadata", "store", "service_tier", "stream_options",
                            "parallel_tool_calls"})

#: Body fields spin-batch cannot honour, accepted only at the value that changes nothing (or null).
NEUTRAL_VALUES: dict[str, Any] = {
    "best_of": 1,
    "stream": False,
    "top_logprobs": 0,  # a /v1/completions body's (a chat body's asks for logprobs: _chat_logprobs)
    "echo": False,
    "suffix": "",
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "function_call": "none",
}

_INT64 = (-(2**63), 2**63 - 1)  # the seed's range (vLLM's, and what a torch generator takes)


class ParamError(ValueError):
    """A field the row cannot have: ``kind`` groups it in validate's summary, the message names it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _show(value: Any) -> str:
    """A value as the user wrote it (JSON), cut short."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(name: str, expected: str, value: Any) -> ParamError:
    return ParamError("bad params", f"{name} must be {expected}, got {_show(value)}")


def _integer(name: str, value: Any, lo: int, hi: int | None = None, expected: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise _bad(name, "an integer", value)
    if value < lo or (hi is not None and value > hi):
        raise _bad(name, expected or f"an integer >= {lo}", value)
    return int(value)


def _number(name: str, value: Any, ok, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise _bad(name, "a number", value)
    if not math.isfinite(value):
        raise _bad(name, "a finite number", value)
    if not ok(value):
        raise _bad(name, f"a number {expected}", value)
    return float(value)


def _stop(name: str, value: Any) -> tuple[str, ...]:
    """A string or a list of strings, each non-empty; an empty list: no stop strings for the row."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise _bad(name, "a string or a list of strings", value)
    for i, item in enumerate(items):
        where = name if isinstance(value, str) else f"{name}[{i}]"
        if not isinstance(item, str) or not item:
            raise _bad(where, "a non-empty string", item)
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise ParamError("bad params", f"{where} holds a lone surrogate, which is not valid Unicode text") from None
    return tuple(items)


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """A list of token ids (integers >= 0); an empty list: none."""
    if not isinstance(value, (list, tuple)):
        raise _bad(name, "a list of token ids (integers >= 0)", value)
    return tuple(_integer(f"{name}[{i}]", x, 0, expected="a token id (an integer >= 0)") for i, x in enumerate(value))


def _logit_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    """An object of token id (an integer, or a string of one, as JSON keys are) -> bias, clamped to
    [-100, 100] as vLLM does; sorted by token id."""
    if not isinstance(value, Mapping):
        raise _bad(name, "an object of token id -> bias", value)
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        if isinstance(key, str):
            try:
                token = int(key.strip())
            except ValueError:
                raise _bad(f"{name} key", "a token id (an integer)", key) from None
        token = _integer(f"{name} key", token, 0, expected="a token id (an integer >= 0)")
        out[token] = min(max(_number(f"{name}[{_show(key)}]", bias, lambda x: True, ""), -100.0), 100.0)
    return tuple(sorted(out.items()))


def _template_kwargs(name: str, value: Any) -> dict[str, Any]:
    """An object of the chat template's extra arguments (``{"enable_thinking": false}``)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _bad(name, "an object (the chat template's extra arguments)", value)
    return dict(value)


def _top_k(name: str, value: Any) -> int:
    """-1 or 0: off (vLLM's spellings; as sampling.top_k), else >= 1."""
    return max(_integer(name, value, -1, expected="-1 or 0 (off) or an integer >= 1"), 0)


def _max_tokens(fields: Mapping[str, Any], where: str) -> int | None:
    """``max_completion_tokens`` (OpenAI's name now) or ``max_tokens``; both given must agree."""
    given = {key: _integer(f"{where}{key}", fields[key], 0) for key in ("max_tokens", "max_completion_tokens")
             if fields.get(key) is not None}
    if len(set(given.values())) > 1:
        raise ParamError("bad params", f"{where}max_tokens ({given['max_tokens']}) and {where}max_completion_tokens "
                                       f"({given['max_completion_tokens']}) differ; give one of them")
    return given.get("max_completion_tokens", given.get("max_tokens"))


def row_params(fields: Mapping[str, Any], where: str = "") -> RowParams:
    """The settings the sampling fields of ``fields`` ask for; an absent or null field is the job's.

    ``where`` prefixes field names in messages (``"body."``). Raises ParamError for a wrong type,
    a value out of range (temperature < 0, top_p outside (0, 1], max_tokens < 0, logprobs > 20 ...), NaN or inf.
    """

    def get(key: str, check) -> Any:
        value = fields.get(key)
        return None if value is None else check(f"{where}{key}", value)

    return RowParams(
        max_tokens=_max_tokens(fields, where),
        temperature=get("temperature", lambda n, v: _number(n, v, lambda x: x >= 0, ">= 0")),
        top_p=get("top_p", lambda n, v: _number(n, v, lambda x: 0 < x <= 1, "in (0, 1]")),
        top_k=get("top_k", _top_k),
        stop=get("stop", _stop),
        seed=get("seed", lambda n, v: _integer(n, v, *_INT64, expected="a 64-bit signed integer")),
        logprobs=get("logprobs", _logprobs),
        prompt_logprobs=get("prompt_logprobs", _logprobs),
        stop_token_ids=get("stop_token_ids", _token_ids),
        min_tokens=get("min_tokens", lambda n, v: _integer(n, v, 0)),
        min_p=get("min_p", lambda n, v: _number(n, v, lambda x: 0 <= x <= 1, "in [0, 1]")),
        presence_penalty=get("presence_penalty", _penalty),
        frequency_penalty=get("frequency_penalty", _penalty),
        repetition_penalty=get("repetition_penalty", lambda n, v: _number(n, v, lambda x: x > 0, "> 0")),
        logit_bias=get("logit_bias", _logit_bias),
        chat_template_kwargs=get("chat_template_kwargs", _template_kwargs),
        n=get("n", lambda n, v: _integer(n, v, 1, MAX_SAMPLES, f"an integer in 1..{MAX_SAMPLES}")),
        structured=_structured(fields, where),
    )


def _structured(fields: Mapping[str, Any], where: str) -> Structured | None:
    """The row's constraint: from response_format, structured_outputs or a guided_* field (one of them),
    checked by the grammar engine (a bad schema, regex or grammar, or no engine: an error row)."""
    try:
        found = {name: s for name, s in (
            ("response_format", from_response_format(fields.get("response_format"), f"{where}response_format")),
            ("structured_outputs", structured_from(fields.get("structured_outputs"), f"{where}structured_outputs")),
            ("guided_*", from_guided(fields, where))) if s is not None}
    except StructuredError as e:
        raise ParamError("structured output", str(e)) from None
    if len(found) > 1:
        raise ParamError("structured output", f"{' and '.join(where + k for k in found)} both constrain the "
                                              f"output; give one of them")
    got = next(iter(found.values()), None)
    why = None if got is None else problem(got)
    if why is not None:
        raise ParamError("structured output", f"{where}{next(iter(found))}: {why}")
    return got


def _penalty(name: str, value: Any) -> float:
    """presence_penalty and frequency_penalty: in [-2, 2] (OpenAI's and vLLM's range)."""
    return _number(name, value, lambda x: -2 <= x <= 2, "in [-2, 2]")


def _logprobs(name: str, value: Any) -> int:
    return _integer(name, value, 0, MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]")


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """A chat body's ask, as OpenAI's chat API takes it: ``logprobs: true`` and ``top_logprobs: K`` (0..20;
    absent: 0); ``top_logprobs`` other than 0 needs ``logprobs: true``."""
    on, top = body.get("logprobs"), body.get("top_logprobs")
    if on is not None and not isinstance(on, bool):
        raise _bad("body.logprobs", "true or false", on)
    k = None if top is None else _logprobs("body.top_logprobs", top)
    if on:
        return k or 0
    if k:
        raise ParamError("bad params", "body.top_logprobs needs body.logprobs: true")
    return None


def column_params(value: Any, column: str) -> RowParams:
    """A plain row's params column: null (the job's settings) or an object of sampling fields."""
    if value is None:
        return NO_PARAMS
    if not isinstance(value, Mapping):
        raise _bad(column, f"an object with sampling fields ({', '.join(SAMPLING_FIELDS)})", value)
    for key in value:
        if key not in SAMPLING_FIELDS:
            raise ParamError("bad params", f"{column}.{key} is not a sampling field; the fields are "
                                           f"{', '.join(SAMPLING_FIELDS)}")
    return row_params(value, f"{column}.")


def _same(value: Any, neutral: Any) -> bool:
    """``value == neutral``, where a bool is not a number (``true`` is not ``1``)."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def body_params(body: Mapping[str, Any], content_field: str) -> RowParams:
    """An OpenAI request body's settings. ``content_field`` is the endpoint's (``messages`` or
    ``prompt``), read by the caller. Raises ParamError for a field spin-batch would have to ignore."""
    chat = content_field == "messages"
    if content_field == "prompt" and body.get("chat_template_kwargs") is not None:
        raise ParamError("unsupported field", "body.chat_template_kwargs is for /v1/chat/completions; a "
                                              "/v1/completions prompt is never put in the chat template")
    for key, value in body.items():
        if key == content_field or key in SAMPLING_FIELDS or key in IGNORED_FIELDS or (chat and key == "top_logprobs"):
            continue
        if key in ("messages", "prompt"):
            raise ParamError("unsupported field", f"body.{key} does not belong in this request: its endpoint "
                                                  f"reads body.{content_field}")
        if key in NEUTRAL_VALUES:
            neutral = NEUTRAL_VALUES[key]
            if value is None or _same(value, neutral):
                continue
            raise ParamError("unsupported field", f"body.{key} = {_show(value)} is not supported: it would change "
                                                  f"the output, and spin-batch takes only {_show(neutral)} or null")
        else:
            raise ParamError("unsupported field", f"body.{key} is not supported (spin-batch reads the sampling "
                                                  f"fields {', '.join(SAMPLING_FIELDS)}, and ignores only "
                                                  f"{', '.join(sorted(IGNORED_FIELDS))})")
    if not chat:
        return row_params(body, "body.")
    own = row_params({key: value for key, value in body.items() if key != "logprobs"}, "body.")
    return replace(own, logprobs=_chat_logprobs(body))
