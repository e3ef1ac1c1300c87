"""One input row -> a :class:`Request`: its id, its prompt or messages, its params, the columns it keeps.

Every row becomes a Request. A row that cannot be decoded (missing id, empty prompt, ...) becomes
a request with ``error`` set, so the job writes an error row for it instead of stopping; a
:class:`Row` carries a short kind of the problem for validate's summary.

A plain row has an id, a prompt or messages, and maybe a params column of per-row sampling
settings (checked by io/params.py). A row with both a prompt and messages (both non-null) is an
error row: which one to decode would be a guess. A message's role must be one of OpenAI's chat roles
(:data:`CHAT_ROLES`).

A row's other columns can ride along to its output row (``keep_columns``: all of them, or those
named; never an OpenAI line's body, which is the request).

A :class:`Spec` says how rows are read (the column names, the params column, the kept columns,
``input.format``); :func:`column_problems` says what a table's columns lack to be read so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..records import NO_PARAMS, Request, RowParams
from .identity import digest
from .params import ParamError, column_params
from .shards import FORMATS, InputError

__all__ = [
    "CHAT_ROLES",
    "BadRow",
    "NotUtf8",
    "Row",
    "Spec",
    "bad_row",
    "build_row",
    "column_problems",
    "kept_columns",
    "parse_messages",
    "input_spec",
    "row_spec",
    "type_name",
    "unicode_text",
]


@dataclass(frozen=True)
class Spec:
    """How rows are read: the input's column names, the params column, the columns kept, the format."""

    id: str = "id"
    prompt: str = "prompt"
    messages: str = "messages"
    params: str | None = None  # a column holding a row's own sampling settings (an object), if any
    keep: bool | tuple[str, ...] = False  # True: every other column; a tuple: those columns
    format: str = "auto"  # input.format: "auto" detects OpenAI batch JSONL per file

    @property
    def read(self) -> tuple[str, ...]:
        """The columns a plain row is made from (not kept: they are the request)."""
        return tuple(c for c in (self.id, self.prompt, self.messages, self.params) if c is not None)


def _keep_spec(keep_columns: bool | str | Sequence[str] | None) -> bool | tuple[str, ...]:
    """``output.keep_columns`` as the reader takes it: "all" or True (every column that is not the
    request's), "none", False, None or an empty list (none), or a list of column names."""
    if keep_columns is None or isinstance(keep_columns, bool):
        return bool(keep_columns)
    if keep_columns in ("all", "none"):
        return keep_columns == "all"
    if isinstance(keep_columns, str) or not all(isinstance(c, str) and c for c in keep_columns):
        raise ValueError(f"keep_columns must be 'all', 'none' or a list of column names, got {keep_columns!r}")
    return tuple(keep_columns) or False


def row_spec(id_column: str = "id", prompt_column: str = "prompt", messages_column: str = "messages",
             params_column: str | None = None, keep_columns: bool | str | Sequence[str] | None = False,
             fmt: str = "auto") -> Spec:
    """The reader's options as a Spec; InputError for an unknown format, ValueError for bad keep_columns."""
    if fmt not in FORMATS:
        raise InputError(f"unknown input format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return Spec(id_column, prompt_column, messages_column, params_column, _keep_spec(keep_columns), fmt)


def input_spec(input_section, keep_columns: bool | str | Sequence[str] | None = False) -> Spec:
    """A job's input section (config's InputConfig: id_column, prompt_column, messages_column,
    params_column, format) with its output.keep_columns, as the one Spec every reader and check takes."""
    return row_spec(input_section.id_column, input_section.prompt_column, input_section.messages_column,
                    input_section.params_column, keep_columns, input_section.format)


def column_problems(names: Sequence[str], *, id_column: str = "id", prompt_column: str = "prompt",
                    messages_column: str = "messages", params_column: str | None = None,
                    keep_columns: Sequence[str] = ()) -> list[str]:
    """What a table with these columns lacks to be read as input (a Parquet shard, a Ray Dataset)."""
    problems = []
    if id_column not in names:
        problems.append(f"missing id column {id_column!r}")
    if prompt_column not in names and messages_column not in names:
        problems.append(f"needs a prompt column {prompt_column!r} or a messages column {messages_column!r}")
    if params_column is not None and params_column not in names:
        problems.append(f"missing params column {params_column!r} (input.params_column)")
    problems += [f"missing column {c!r} named in output.keep_columns" for c in keep_columns if c not in names]
    return problems


@dataclass(frozen=True)
class Row:
    """A parsed row plus a short error kind (None when ok), used for reporting."""

    request: Request
    kind: str | None = None


class BadRow(Exception):
    """Raised by the field parsers; carries a kind (for summaries) and a message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def bad_row(source: str, kind: str, message: str, line_digest: str | None = None) -> Row:
    """An error row with no id (a line that is no row at all: not JSON, too long, ...); ``line_digest``
    the line's (io/identity.py)."""
    return Row(Request(source, None, None, None, message, digest=line_digest), kind)


def type_name(value: Any) -> str:
    return type(value).__name__


def unicode_text(text: str, what: str) -> str:
    """`text`, if it is valid Unicode: JSON's \\ud800-style escapes can spell a lone surrogate, which
    no tokenizer or Parquet file takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRow("invalid unicode", f"{what} holds a lone surrogate ({text[exc.start]!a} at character "
                                        f"{exc.start}), which is not valid Unicode text") from None
    return text


def _parse_id(value: Any) -> str:
    """Return the id as a string; ints are converted, bools are rejected."""
    if value is None:
        raise BadRow("missing id", "missing id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRow("bad id type", f"id must be a string or integer, got {type_name(value)}")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise BadRow("empty id", "empty id")
    return unicode_text(text, "id")


# The roles of OpenAI's chat messages, which chat templates are written for; any other role is an error
# row (a template may render it as it stands, or drop it, or fail: a guess either way)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _parse_message(index: int, item: Any, name: str = "messages") -> dict:
    """Validate one chat message; keeps role, content and any non-null extra keys."""
    where = f"{name}[{index}]"
    if not isinstance(item, Mapping):
        raise BadRow("bad messages", f"{where} must be an object with 'role' and 'content', got {type_name(item)}")
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or not role.strip():
        raise BadRow("bad messages", f"{where}.role must be a non-empty string, got {role!r}")
    if role not in CHAT_ROLES:
        raise BadRow("bad messages", f"{where}.role {role!r} is not a chat role ({', '.join(CHAT_ROLES)})")
    content = _text_parts(content, f"{where}.content") if isinstance(content, (list, tuple)) else content
    if not isinstance(content, str):
        raise BadRow("bad messages", f"{where}.content must be a string or a list of text parts, got "
                                     f"{type_name(content)}")
    unicode_text(role, f"{where}.role")
    unicode_text(content, f"{where}.content")
    return {**{key: value for key, value in item.items() if value is not None}, "content": content}


def _text_parts(parts: Sequence[Any], where: str) -> str:
    """Content given as OpenAI's list of parts: the ``{"type": "text", "text": ...}`` parts' texts joined
    with newlines, as vLLM joins them for a template that takes string content. Any other part
    (an image, audio, a file) is an error: spin-batch reads text only."""
    texts = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text":
            got = f"type {kind!r}" if isinstance(part, Mapping) else type_name(part)
            raise BadRow("bad messages", f"{where}[{i}] must be a text part ({{\"type\": \"text\", \"text\": ...}}), "
                                         f"got {got}; spin-batch reads text only")
        if not isinstance(part.get("text"), str):
            raise BadRow("bad messages", f"{where}[{i}].text must be a string, got {type_name(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(value: Any, name: str = "messages") -> tuple[dict, ...]:
    """Validate a non-empty list of ``{"role": str, "content": str or text parts}`` dicts (parts joined)."""
    if not isinstance(value, (list, tuple)):
        raise BadRow("bad messages", f"{name} must be a list of messages, got {type_name(value)}")
    if not value:
        raise BadRow("bad messages", f"{name} must not be empty")
    return tuple(_parse_message(i, item, name) for i, item in enumerate(value))


def _parse_prompt(value: Any) -> str:
    """Validate a plain-text prompt."""
    if value is None:
        raise BadRow("missing prompt", "missing prompt")
    if not isinstance(value, str):
        raise BadRow("bad prompt type", f"prompt must be a string, got {type_name(value)}")
    if not value.strip():
        raise BadRow("empty prompt", "empty prompt")
    return unicode_text(value, "prompt")


def _value(values: Mapping[str, Any], key: str) -> Any:
    """A field's value; a float NaN (how pandas, and Ray Data merging files with other columns,
    spell a missing value) counts as missing."""
    v = values.get(key)
    return None if isinstance(v, float) and math.isnan(v) else v


class NotUtf8:
    """A Parquet string value whose bytes are not UTF-8 (pyarrow cannot turn it into a str)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __repr__(self) -> str:
        return f"NotUtf8({self.at})"


def _check_utf8(values: Mapping[str, Any], keys: Iterable[str]) -> None:
    """A Parquet value of these columns whose bytes are not UTF-8 makes the row an error row."""
    for key in keys:
        if isinstance(v := values.get(key), NotUtf8):
            raise BadRow("invalid UTF-8", f"invalid UTF-8 in column {key!r} at byte {v.at}")


def _check_text(value: Any, what: str) -> None:
    """Every string in a kept value (its keys too) is valid Unicode (the output is Parquet)."""
    if isinstance(value, str):
        unicode_text(value, what)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_text(key, what)
            _check_text(item, what)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item, what)


def _column_name(name: Any) -> str:
    """A kept column's name: a non-empty string (an output column needs one; JSON allows ``"": 1``)."""
    if not isinstance(name, str):
        raise BadRow("bad column name", f"column name {name!r} is not a string ({type_name(name)}); it cannot "
                                        "be an output column (output.keep_columns: name the columns to keep)")
    if not name:
        raise BadRow("bad column name", "column name '' is empty; it cannot be an output column "
                                        "(output.keep_columns: name the columns to keep)")
    return unicode_text(name, "a column name")


def kept_columns(values: Mapping[str, Any], spec: Spec) -> dict[str, Any] | None:
    """The row's columns carried to its output row: every column but the request's, or those named
    (a named column the row lacks is None). A column name that is empty or not a string makes the row
    an error row: the output could not store it."""
    if spec.keep is False:
        return None
    names = [_column_name(k) for k in values if k not in spec.read] if spec.keep is True else list(spec.keep)
    _check_utf8(values, names)
    kept = {name: values.get(name) for name in names}
    for name, value in kept.items():
        _check_text(value, f"column {name!r}")
    return kept


def _params(values: Mapping[str, Any], spec: Spec) -> RowParams:
    if spec.params is None:
        return NO_PARAMS
    try:
        return column_params(_value(values, spec.params), spec.params)
    except ParamError as bad:
        raise BadRow(bad.kind, bad.message) from None


def row_digest(values: Mapping[str, Any], spec: Spec) -> str:
    """The digest of what decides a plain row's text: its prompt, messages and params values."""
    return digest({"prompt": _value(values, spec.prompt), "messages": _value(values, spec.messages),
                   "params": None if spec.params is None else _value(values, spec.params)})


def build_row(source: str, values: Mapping[str, Any], spec: Spec) -> Row:
    """Turn a plain row's field values into a Request; problems become an error request."""
    row_id = keep = None
    text_digest = row_digest(values, spec)
    try:
        _check_utf8(values, [spec.id])
        row_id = _parse_id(_value(values, spec.id))
        keep = kept_columns(values, spec)
        _check_utf8(values, spec.read)
        messages = _value(values, spec.messages)
        if messages is not None and _value(values, spec.prompt) is not None:
            raise BadRow("prompt and messages",
                         f"row has both {spec.prompt!r} and {spec.messages!r}; give one of them (the other null "
                          "or absent)")
        if messages is not None:
            prompt, messages = None, parse_messages(messages)
        else:
            prompt = _parse_prompt(_value(values, spec.prompt))
        return Row(Request(source, row_id, prompt, messages, params=_params(values, spec), keep=keep,
                           digest=text_digest))
    except BadRow as bad:
        return Row(Request(source, row_id, None, None, bad.message, keep=keep, digest=text_digest), bad.kind)
