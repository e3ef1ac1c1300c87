"""The output row: OUTPUT_SCHEMA's columns, and the rows a run writes.

A row holds OUTPUT_SCHEMA's columns, then the input columns it carries (``output.keep_columns``;
their names and Arrow types: :mod:`spin_batch.io.columns`). A part written before a column was
added to OUTPUT_SCHEMA reads with that column null (:mod:`spin_batch.io.outputs`).
:func:`normalize_row` checks a row and fills in defaults; :func:`completion_row` and
:func:`error_row` make one from a Completion or a failure. Parts are written by
:mod:`spin_batch.io.writer`.
"""

from __future__ import annotations

import math
import numbers
import operator
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from ..records import Completion, TokenLogprob
from . import columns

__all__ = [
    "LOGPROB_TYPE",
    "OUTPUT_SCHEMA",
    "OutputError",
    "completion_row",
    "error_row",
    "normalize_row",
]

#: One token's entry in the logprobs / prompt_logprobs columns (records.TokenLogprob): the token, its
#: log-probability and rank at its position, and the top tokens there, most likely first.
LOGPROB_TYPE = pa.struct([
    pa.field("token_id", pa.int32()),
    pa.field("token", pa.string()),
    pa.field("logprob", pa.float32()),
    pa.field("rank", pa.int32()),
    pa.field("top_ids", pa.list_(pa.int32())),
    pa.field("top_tokens", pa.list_(pa.string())),
    pa.field("top_logprobs", pa.list_(pa.float32())),
])

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=True),
        pa.field("source", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=True),
        pa.field("finish_reason", pa.string(), nullable=True),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string(), nullable=True),
        pa.field("num_spec_steps", pa.int32(), nullable=False),
        pa.field("num_draft_tokens", pa.int32(), nullable=False),
        pa.field("num_accepted_draft_tokens", pa.int32(), nullable=False),
        pa.field("mean_acceptance_length", pa.float64(), nullable=True),
        pa.field("drafter_pulls", pa.map_(pa.string(), pa.int32()), nullable=False),
        pa.field("decode_time_s", pa.float64(), nullable=False),
        # how the row answers in OpenAI's batch format (output.format openai): "chat" or "completion",
        # the model named in the response, the Unix time the row was made
        pa.field("endpoint", pa.string(), nullable=True),
        pa.field("model", pa.string(), nullable=True),
        pa.field("created", pa.int64(), nullable=True),
        # the row's resume key beside its id (io/identity.py): a digest of what decides its text, and
        # for a row with no usable id or a repeated one, which such row it is
        pa.field("input_digest", pa.string(), nullable=True),
        pa.field("input_key", pa.string(), nullable=True),
        # sampling.logprobs / prompt_logprobs: one entry per generated / prompt token (the first prompt
        # token's null), and the prompt's total and mean log-probability and perplexity (tokens 2..n)
        pa.field("logprobs", pa.list_(LOGPROB_TYPE), nullable=True),
        pa.field("prompt_logprobs", pa.list_(LOGPROB_TYPE), nullable=True),
        pa.field("prompt_logprob_sum", pa.float64(), nullable=True),
        pa.field("prompt_logprob_mean", pa.float64(), nullable=True),
        pa.field("prompt_perplexity", pa.float64(), nullable=True),
        # which sample of its request the row is (n samples per prompt: 0 .. n - 1); null in older parts: 0
        pa.field("index", pa.int32(), nullable=True),
    ]
)

_INT_COLUMNS = frozenset(f.name for f in OUTPUT_SCHEMA if pa.types.is_int32(f.type))
_FLOAT_COLUMNS = frozenset(f.name for f in OUTPUT_SCHEMA if pa.types.is_float64(f.type))
_STATUSES = frozenset({"ok", "error"})
_FINISH_REASONS = frozenset({None, "stop", "length", "error"})
_ENDPOINTS = frozenset({None, "chat", "completion"})
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class OutputError(RuntimeError):
    """An output file cannot be read or a row does not fit the output schema."""


def _int_value(name: str, value: Any) -> int:
    """An int32 value; None becomes 0, integral floats and numpy-style ints are accepted."""
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool):
        raise OutputError(f"output column {name!r} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise OutputError(f"output column {name!r} must be an integer, got {value!r}") from None
    if not _INT32_MIN <= number <= _INT32_MAX:
        raise OutputError(f"output column {name!r} value {number} does not fit in int32")
    return number


def _float_value(name: str, value: Any, nullable: bool) -> float | None:
    """A float64 value; None becomes null (or 0.0 for non-nullable columns)."""
    if value is None:
        return None if nullable else 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OutputError(f"output column {name!r} must be a number, got {value!r}")
    return float(value)


def _pulls_value(value: Any) -> list[tuple[str, int]]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise OutputError(f"output column 'drafter_pulls' must be a dict, got {value!r}")
    return [(str(key), _int_value("drafter_pulls", count)) for key, count in sorted(value.items())]


def _check_strings(row: Mapping[str, Any]) -> None:
    if not isinstance(row.get("source"), str):
        raise OutputError(f"output row needs a string 'source', got {row.get('source')!r}")
    if row["status"] not in _STATUSES:
        raise OutputError(f"output column 'status' must be 'ok' or 'error', got {row['status']!r}")
    if row["finish_reason"] not in _FINISH_REASONS:
        raise OutputError(f"output column 'finish_reason' must be stop/length/error/None, got {row['finish_reason']!r}")
    if row["endpoint"] not in _ENDPOINTS:
        raise OutputError(f"output column 'endpoint' must be chat/completion/None, got {row['endpoint']!r}")
    for name in ("id", "text", "error", "model", "input_digest", "input_key"):
        if row[name] is not None and not isinstance(row[name], str):
            raise OutputError(f"output column {name!r} must be a string or None, got {row[name]!r}")


def _created_value(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise OutputError(f"output column 'created' must be an integer (Unix seconds) or None, got {value!r}")
    return int(value)


def normalize_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Return a complete output row with defaults filled in and values checked.

    Missing keys get defaults: 0 for int columns, None for nullable columns,
    ``{}`` for drafter_pulls, ``0.0`` for decode_time_s, and status "error"
    when an error message is set, "ok" otherwise. ``source`` is required.
    Any other key is an input column the row carries (:func:`completion_row`), kept as it is.

    Raises:
        OutputError: a value of the wrong type, or a key that is not a string.
    """
    bad = [key for key in row if not isinstance(key, str) or not key]
    if bad:
        raise OutputError(f"output column names must be non-empty strings, got {bad!r}")
    out = {name: row.get(name) for name in OUTPUT_SCHEMA.names}
    if out["status"] is None:
        out["status"] = "error" if out["error"] is not None else "ok"
    _check_strings(out)
    for name in _INT_COLUMNS:
        out[name] = _int_value(name, out[name])
    for name in _FLOAT_COLUMNS:
        out[name] = _float_value(name, out[name], OUTPUT_SCHEMA.field(name).nullable)
    out["drafter_pulls"] = _pulls_value(out["drafter_pulls"])
    out["created"] = _created_value(out["created"])
    for name in ("logprobs", "prompt_logprobs"):
        if out[name] is not None and not isinstance(out[name], Sequence):
            raise OutputError(f"output column {name!r} must be a list of token entries or None, got {out[name]!r}")
    out.update((key, value) for key, value in row.items() if key not in out)
    return out


def error_row(source: str, id: str | None, message: str, prompt_tokens: int = 0) -> dict[str, Any]:
    """A complete output row for a request that failed (status and finish_reason "error")."""
    return {
        "id": id,
        "source": source,
        "text": None,
        "finish_reason": "error",
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 0,
        "status": "error",
        "error": message,
        "num_spec_steps": 0,
        "num_draft_tokens": 0,
        "num_accepted_draft_tokens": 0,
        "mean_acceptance_length": None,
        "drafter_pulls": {},
        "decode_time_s": 0.0,
        "endpoint": None,
        "model": None,
        "created": None,
        "input_digest": None,
        "input_key": None,
        "logprobs": None,
        "prompt_logprobs": None,
        "prompt_logprob_sum": None,
        "prompt_logprob_mean": None,
        "prompt_perplexity": None,
        "index": 0,
    }


def completion_row(c: Completion, *, model: str | None = None, prefix: str = "input_",
                   created: int | None = None) -> dict[str, Any]:
    """The output row of one Completion: OUTPUT_SCHEMA's columns, then the input columns the
    request carries (``Request.keep``, as output.keep_columns picked them; one named like an output
    column gets ``prefix``, see :mod:`spin_batch.io.columns`).

    ``endpoint`` is the request's OpenAI endpoint, else "chat" for a row with messages and
    "completion" for a prompt; ``model`` the request's own, else ``model`` (the job's target);
    ``created`` now, in Unix seconds, unless given; ``input_digest`` and ``input_key`` the request's
    identity (io/identity.py).
    """
    req = c.request
    row = _answer(c) if c.error is None else error_row(req.source, req.id, c.error, c.prompt_tokens)
    row["endpoint"] = req.endpoint or ("chat" if req.messages is not None else "completion")
    row["model"] = req.model or model
    row["created"] = int(time.time()) if created is None else created
    row["input_digest"], row["input_key"] = req.digest, req.input_key
    row["index"] = c.index
    row.update(columns.kept_values(req.keep, prefix, OUTPUT_SCHEMA.names))
    return row


def _answer(c: Completion) -> dict[str, Any]:
    return {
        "id": c.request.id,
        "source": c.request.source,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "status": "ok",
        "error": None,
        "num_spec_steps": c.num_spec_steps,
        "num_draft_tokens": c.num_draft_tokens,
        "num_accepted_draft_tokens": c.num_accepted_draft_tokens,
        "mean_acceptance_length": c.mean_acceptance_length,
        "drafter_pulls": dict(c.drafter_pulls),
        "decode_time_s": c.decode_time_s,
        "logprobs": _entries(c.logprobs),
        "prompt_logprobs": _entries(c.prompt_logprobs),
        **_prompt_score(c.prompt_logprobs),
    }


def _entries(tokens: Sequence[TokenLogprob | None] | None) -> list[dict[str, Any] | None] | None:
    if tokens is None:
        return None
    return [None if t is None else {"token_id": t.token_id, "token": t.token, "logprob": t.logprob, "rank": t.rank,
                                    "top_ids": list(t.top_ids), "top_tokens": list(t.top_tokens),
                                    "top_logprobs": list(t.top_logprobs)} for t in tokens]


def _prompt_score(tokens: Sequence[TokenLogprob | None] | None) -> dict[str, float | None]:
    """The prompt's total log-probability over the tokens that have one (all but the first), their mean
    and the perplexity exp(-mean); None without such a token."""
    scored = [t.logprob for t in tokens or () if t is not None]
    if not scored:
        return {"prompt_logprob_sum": None, "prompt_logprob_mean": None, "prompt_perplexity": None}
    total = math.fsum(scored)
    mean = total / len(scored)
    return {"prompt_logprob_sum": total, "prompt_logprob_mean": mean,
            "prompt_perplexity": math.exp(-mean) if mean > -700 else math.inf}
