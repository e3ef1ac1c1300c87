"""Streaming input: shard discovery, worker assignment and row validation.

Input shards are JSONL files (one JSON object per line) or Parquet files.
Every row becomes a :class:`Request`. Rows that cannot be decoded (bad JSON,
missing id, empty prompt, ...) become requests with ``error`` set, so the job
writes an error row for them instead of stopping.

A JSONL shard is either plain rows (an id, a prompt or messages, and maybe a
params column of per-row sampling settings) or an OpenAI batch file (what
``vllm run-batch -i`` and the OpenAI Batch API take): one request a line,
``{"custom_id", "method": "POST", "url", "body"}``. With format "auto" a file
is read as OpenAI batch when its first JSON object line has a ``custom_id``
and a ``url`` or ``body``; format "openai" reads every file so.

Memory stays bounded: JSONL is read one line at a time and Parquet one record
batch at a time, reading only the columns that are needed. A JSONL line longer
than ``max_line_bytes`` (``input.max_line_bytes``) is never held whole: it is
skipped in chunks and becomes an error row.

JSONL: blank lines (empty or only whitespace) are skipped without a row; they
still count in the line numbers, so a row's source names its real line.

A row with both a prompt and messages (both non-null) is an error row: which
one to decode would be a guess.

A row's other columns can ride along to its output row (``keep_columns``:
all of them, or those named; never an OpenAI line's body, which is the
request). Parquet then reads those columns too.

Each row has a ``source`` key, ``"<absolute shard path>#<row index>"``, which
stays the same across reruns and is used to resume an interrupted job.
"""

from __future__ import annotations

import glob
import itertools
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..records import NO_PARAMS, Request, RowParams
from .params import ParamError, body_params, column_params

__all__ = [
    "FORMATS",
    "InputError",
    "Request",
    "assign",
    "check_input",
    "count_rows",
    "iter_requests",
    "list_shards",
    "requests_from_rows",
    "shard_defaults_from_env",
    "worker_sources",
]

FORMATS = ("auto", "jsonl", "parquet", "openai")

# Suffixes accepted for explicitly named files and glob matches.
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# Suffixes picked up when a directory is given (".json" is left out because
# directories often hold JSON metadata files next to the data).
_DIR_SUFFIXES = {".jsonl", ".ndjson", ".parquet"}

# Report at most this many duplicate ids one by one in check_input().
_MAX_DUPLICATES_LISTED = 20

#: Longest JSONL line read (bytes, newline excluded) unless the job says otherwise (input.max_line_bytes).
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
# The rest of an over-long line is skipped in chunks of this size.
_SKIP_CHUNK = 1 << 20


class InputError(ValueError):
    """A file-level input problem (no files matched, unreadable file, missing column, ...)."""


# --------------------------------------------------------------------------
# Shard discovery
# --------------------------------------------------------------------------


def _file_format(path: Path) -> str | None:
    """Return "jsonl" or "parquet" from the file suffix, or None if unsupported."""
    return _SUFFIX_FORMATS.get(path.suffix.lower())


def _fits(kind: str, fmt: str) -> bool:
    """Whether a file of this kind is read under ``input.format`` (format "openai" takes Parquet files
    too, so that list_shards can reject them rather than pass them over)."""
    return fmt in ("auto", "openai") or kind == fmt


def _wanted(path: Path, fmt: str, *, in_directory: bool) -> bool:
    """Whether a file found by a glob or a directory listing should be read."""
    if in_directory and (path.name.startswith(".") or path.suffix.lower() not in _DIR_SUFFIXES):
        return False
    kind = _file_format(path)
    return kind is not None and _fits(kind, fmt)


def _describe(fmt: str) -> str:
    return "input" if fmt == "auto" else fmt


def _explicit_file(entry: str, path: Path, fmt: str) -> list[Path]:
    """Validate a file named explicitly (not through a glob or directory)."""
    kind = _file_format(path)
    if kind is None:
        raise InputError(f"{entry}: unsupported file type (expected .jsonl, .ndjson, .json or .parquet)")
    if not _fits(kind, fmt):
        raise InputError(f"{entry}: is a {kind} file but the input format is {fmt}")
    return [path]


def _directory_files(entry: str, path: Path, fmt: str) -> list[Path]:
    """Data files directly inside a directory (non-recursive)."""
    files = [p for p in path.iterdir() if p.is_file() and _wanted(p, fmt, in_directory=True)]
    if not files:
        raise InputError(f"{entry}: directory contains no {_describe(fmt)} files (*.jsonl, *.parquet)")
    return files


def _glob_files(entry: str, pattern: str, fmt: str) -> list[Path]:
    """Data files matching a glob pattern (``**`` is recursive)."""
    matches = (Path(p) for p in glob.glob(pattern, recursive=True))
    files = [p for p in matches if p.is_file() and _wanted(p, fmt, in_directory=False)]
    if not files:
        raise InputError(f"{entry}: no {_describe(fmt)} files match this pattern")
    return files


def _expand_entry(entry: str, fmt: str) -> list[Path]:
    """Expand one path, directory or glob into the data files it names."""
    expanded = os.path.expanduser(entry)
    path = Path(expanded)
    if path.is_dir():
        return _directory_files(entry, path, fmt)
    if path.is_file():
        return _explicit_file(entry, path, fmt)
    if glob.has_magic(expanded):
        return _glob_files(entry, expanded, fmt)
    raise InputError(f"{entry}: no such file or directory")


def list_shards(paths: Sequence[str | os.PathLike], fmt: str = "auto") -> list[Path]:
    """Resolve input paths into a sorted, de-duplicated list of absolute shard paths.

    Args:
        paths: files, glob patterns (``**`` allowed) or directories. A directory
            contributes its ``*.jsonl``/``*.ndjson``/``*.parquet`` files
            (non-recursive, hidden files skipped).
        fmt: "auto" picks the format from each file's suffix (.jsonl/.ndjson/.json
            are JSON lines, .parquet is Parquet); "jsonl" or "parquet" restricts
            the input to that format; "openai" (OpenAI batch files) takes JSON
            lines only.

    Raises:
        InputError: an entry matches no file, ``fmt`` is unknown, or an
            "openai" input names a Parquet file.
    """
    if fmt not in FORMATS:
        raise InputError(f"unknown input format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise InputError("no input paths given")
    found: set[Path] = set()
    for entry in paths:
        found.update(p.resolve() for p in _expand_entry(os.fspath(entry), fmt))
    parquet = sorted(p for p in found if _file_format(p) == "parquet")
    if fmt == "openai" and parquet:
        raise InputError(f"{parquet[0]}: is a Parquet file, but input.format openai reads OpenAI batch files, "
                         "which are JSON lines")
    return sorted(found)


# --------------------------------------------------------------------------
# Worker assignment
# --------------------------------------------------------------------------


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    """Read an integer environment variable; empty or unset gives ``default``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InputError(f"environment variable {name}={raw!r} is not an integer") from None


def _slurm_task_count(env: Mapping[str, str], task_min: int, step: int) -> int:
    """Number of array tasks, from SLURM_ARRAY_TASK_COUNT or MIN/MAX/STEP."""
    count = _env_int(env, "SLURM_ARRAY_TASK_COUNT")
    if count is None:
        task_max = _env_int(env, "SLURM_ARRAY_TASK_MAX")
        if task_max is None:
            raise InputError("SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not")
        count = (task_max - task_min) // step + 1
    if count < 1:
        raise InputError(f"SLURM array task count must be >= 1, got {count}")
    return count


def shard_defaults_from_env(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """Default ``(shard_index, num_shards)`` for this process.

    Inside a Slurm job array the index is ``(SLURM_ARRAY_TASK_ID -
    SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP`` and the count is
    ``SLURM_ARRAY_TASK_COUNT``. Outside an array this returns ``(0, 1)``.

    Raises:
        InputError: the variables are not integers or do not describe a
            contiguous array (e.g. ``--array=1,5,9``).
    """
    task_id = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task_id is None:
        return 0, 1
    task_min = _env_int(env, "SLURM_ARRAY_TASK_MIN", 0)
    step = _env_int(env, "SLURM_ARRAY_TASK_STEP", 1) or 1
    if step < 1:
        raise InputError(f"SLURM_ARRAY_TASK_STEP must be >= 1, got {step}")
    count = _slurm_task_count(env, task_min, step)
    offset = task_id - task_min
    index = offset // step
    if offset < 0 or offset % step or index >= count:
        raise InputError(
            f"SLURM_ARRAY_TASK_ID={task_id} does not fit an array of {count} tasks starting at "
            f"{task_min} with step {step}; use a contiguous --array range or pass the shard "
            "index and count explicitly"
        )
    return index, count


def _check_shard_args(shard_index: int, num_shards: int) -> None:
    for name, value in (("shard_index", shard_index), ("num_shards", num_shards)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{name} must be an integer, got {value!r}")
    if num_shards < 1:
        raise InputError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise InputError(f"shard_index must be in [0, {num_shards}), got {shard_index}")


#: Files are dealt whole while every worker's share stays within this factor of an even share.
_FILE_DEAL_SLACK = 2.0
# A JSONL file's rows are counted in its first this many bytes (and scaled by its size past them).
_WEIGHT_SAMPLE = 64 * 1024


def _estimated_rows(path: Path) -> float:
    """About how many rows a shard holds: a Parquet file's from its metadata, a JSONL file's
    counted in its first 64 KiB (exact for a smaller file). 0 for a file that cannot be read
    (the reader reports it when it gets there)."""
    try:
        if _file_format(path) == "parquet":
            return pq.ParquetFile(path).metadata.num_rows
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            head = handle.read(_WEIGHT_SAMPLE)
    except (OSError, pa.ArrowException):
        return 0
    rows = sum(1 for line in head.split(b"\n") if line.strip())
    return rows * size / len(head) if head else 0


def _deal_files(shards: list[Path], num_shards: int) -> bool:
    """Whether dealing whole files (``shards[i::num_shards]`` to worker i) keeps every worker within
    :data:`_FILE_DEAL_SLACK` of an even share of the rows; else rows are dealt."""
    if num_shards == 1:
        return True
    if len(shards) < num_shards:
        return False
    rows = [_estimated_rows(p) for p in shards]
    fair = sum(rows) / num_shards
    loads = (sum(rows[i::num_shards]) for i in range(num_shards))
    return all(fair / _FILE_DEAL_SLACK <= load <= fair * _FILE_DEAL_SLACK for load in loads)


def assign(shards: list[Path], shard_index: int, num_shards: int) -> tuple[list[Path], int | None]:
    """Decide which part of the input this worker reads.

    Whole files, while that is even enough: the worker reads
    ``shards[shard_index::num_shards]`` and the row modulo is None. With fewer
    files than workers, or files so uneven that a worker would get under half
    or over twice an even share of the rows (estimated: Parquet metadata, the
    first 64 KiB of a JSONL file), rows are dealt: the worker reads all files
    and keeps the rows whose running row number satisfies
    ``row % num_shards == shard_index`` (the returned modulo is ``num_shards``),
    so workers' row counts differ by at most one. Either way a row's source
    (its resume key) is the same, and every worker decides alike.

    Raises:
        InputError: ``shard_index`` is not in ``[0, num_shards)``.
    """
    _check_shard_args(shard_index, num_shards)
    shards = list(shards)
    if _deal_files(shards, num_shards):
        return shards[shard_index::num_shards], None
    return shards, num_shards


# --------------------------------------------------------------------------
# Row validation
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
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


def _spec(id_column: str, prompt_column: str, messages_column: str, params_column: str | None = None,
          keep_columns: bool | str | Sequence[str] | None = False, fmt: str = "auto") -> _Spec:
    if fmt not in FORMATS:
        raise InputError(f"unknown input format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return _Spec(id_column, prompt_column, messages_column, params_column, _keep_spec(keep_columns), fmt)


@dataclass(frozen=True)
class _Row:
    """A parsed row plus a short error kind (None when ok), used for reporting."""

    request: Request
    kind: str | None = None


class _BadRow(Exception):
    """Raised by the field parsers; carries a kind (for summaries) and a message."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def _type_name(value: Any) -> str:
    return type(value).__name__


def _unicode(text: str, what: str) -> str:
    """`text`, if it is valid Unicode: JSON's \\ud800-style escapes can spell a lone surrogate, which
    no tokenizer or Parquet file takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _BadRow("invalid unicode", f"{what} holds a lone surrogate ({text[exc.start]!a} at character "
                                         f"{exc.start}), which is not valid Unicode text") from None
    return text


def _parse_id(value: Any) -> str:
    """Return the id as a string; ints are converted, bools are rejected."""
    if value is None:
        raise _BadRow("missing id", "missing id")
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise _BadRow("bad id type", f"id must be a string or integer, got {_type_name(value)}")
    text = value if isinstance(value, str) else str(value)
    if not text.strip():
        raise _BadRow("empty id", "empty id")
    return _unicode(text, "id")


def _parse_message(index: int, item: Any, name: str = "messages") -> dict:
    """Validate one chat message; keeps role, content and any non-null extra keys."""
    where = f"{name}[{index}]"
    if not isinstance(item, Mapping):
        raise _BadRow("bad messages", f"{where} must be an object with 'role' and 'content', got {_type_name(item)}")
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or not role.strip():
        raise _BadRow("bad messages", f"{where}.role must be a non-empty string, got {role!r}")
    if not isinstance(content, str):
        raise _BadRow("bad messages", f"{where}.content must be a string, got {_type_name(content)}")
    _unicode(role, f"{where}.role")
    _unicode(content, f"{where}.content")
    return {key: value for key, value in item.items() if value is not None}


def _parse_messages(value: Any, name: str = "messages") -> tuple[dict, ...]:
    """Validate a non-empty list of ``{"role": str, "content": str}`` dicts."""
    if not isinstance(value, (list, tuple)):
        raise _BadRow("bad messages", f"{name} must be a list of messages, got {_type_name(value)}")
    if not value:
        raise _BadRow("bad messages", f"{name} must not be empty")
    return tuple(_parse_message(i, item, name) for i, item in enumerate(value))


def _parse_prompt(value: Any) -> str:
    """Validate a plain-text prompt."""
    if value is None:
        raise _BadRow("missing prompt", "missing prompt")
    if not isinstance(value, str):
        raise _BadRow("bad prompt type", f"prompt must be a string, got {_type_name(value)}")
    if not value.strip():
        raise _BadRow("empty prompt", "empty prompt")
    return _unicode(value, "prompt")


def _value(values: Mapping[str, Any], key: str) -> Any:
    """A field's value; a float NaN (how pandas, and Ray Data merging files with other columns,
    spell a missing value) counts as missing."""
    v = values.get(key)
    return None if isinstance(v, float) and math.isnan(v) else v


class _NotUtf8:
    """A Parquet string value whose bytes are not UTF-8 (pyarrow cannot turn it into a str)."""

    def __init__(self, at: int) -> None:
        self.at = at


def _check_utf8(values: Mapping[str, Any], keys: Iterable[str]) -> None:
    """A Parquet value of these columns whose bytes are not UTF-8 makes the row an error row."""
    for key in keys:
        if isinstance(v := values.get(key), _NotUtf8):
            raise _BadRow("invalid UTF-8", f"invalid UTF-8 in column {key!r} at byte {v.at}")


def _check_text(value: Any, what: str) -> None:
    """Every string in a kept value (its keys too) is valid Unicode (the output is Parquet)."""
    if isinstance(value, str):
        _unicode(value, what)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_text(key, what)
            _check_text(item, what)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item, what)


def _kept(values: Mapping[str, Any], spec: _Spec) -> dict[str, Any] | None:
    """The row's columns carried to its output row: every column but the request's, or those named
    (a named column the row lacks is None)."""
    if spec.keep is False:
        return None
    names = [k for k in values if k not in spec.read] if spec.keep is True else list(spec.keep)
    _check_utf8(values, names)
    kept = {name: values.get(name) for name in names}
    for name, value in kept.items():
        _check_text(value, f"column {name!r}")
    return kept


def _params(values: Mapping[str, Any], spec: _Spec) -> RowParams:
    if spec.params is None:
        return NO_PARAMS
    try:
        return column_params(_value(values, spec.params), spec.params)
    except ParamError as bad:
        raise _BadRow(bad.kind, bad.message) from None


def _build_row(source: str, values: Mapping[str, Any], spec: _Spec) -> _Row:
    """Turn a plain row's field values into a Request; problems become an error request."""
    row_id = keep = None
    try:
        _check_utf8(values, [spec.id])
        row_id = _parse_id(_value(values, spec.id))
        keep = _kept(values, spec)
        _check_utf8(values, spec.read)
        messages = _value(values, spec.messages)
        if messages is not None and _value(values, spec.prompt) is not None:
            raise _BadRow("prompt and messages",
                          f"row has both {spec.prompt!r} and {spec.messages!r}; give one of them (the other null "
                          "or absent)")
        if messages is not None:
            prompt, messages = None, _parse_messages(messages)
        else:
            prompt = _parse_prompt(_value(values, spec.prompt))
        return _Row(Request(source, row_id, prompt, messages, params=_params(values, spec), keep=keep))
    except _BadRow as bad:
        return _Row(Request(source, row_id, None, None, bad.message, keep=keep), bad.kind)


# OpenAI batch lines: url -> (Request.endpoint, the body field holding the prompt)
_OPENAI_URLS = {"/v1/chat/completions": ("chat", "messages"), "/v1/completions": ("completion", "prompt")}


def _openai_id(value: Any) -> str:
    """custom_id: a non-empty string (OpenAI's type; an integer is not converted)."""
    if value is None:
        raise _BadRow("missing custom_id", "missing custom_id")
    if not isinstance(value, str):
        raise _BadRow("bad custom_id", f"custom_id must be a string, got {_type_name(value)}")
    if not value.strip():
        raise _BadRow("bad custom_id", "empty custom_id")
    return _unicode(value, "custom_id")


def _openai_endpoint(line: Mapping[str, Any]) -> tuple[str, str]:
    """The line's (endpoint, body field with the prompt) from its method and url."""
    method, url = line.get("method"), line.get("url")
    if method != "POST":
        raise _BadRow("bad method", 'missing method (it must be "POST")' if method is None else
                      f'method must be "POST", got {json.dumps(method)}')
    if url not in _OPENAI_URLS:
        served = " and ".join(_OPENAI_URLS)
        raise _BadRow("bad url", f"missing url ({served} are served)" if url is None else
                      f"url {json.dumps(url)} is not supported; spin-batch serves {served}")
    return _OPENAI_URLS[url]


def _openai_prompt(value: Any) -> str:
    """A /v1/completions body's prompt: one string (not a list of prompts or token ids)."""
    if value is None:
        raise _BadRow("missing prompt", "body.prompt is missing; /v1/completions needs it")
    if isinstance(value, (list, tuple)):
        raise _BadRow("bad prompt type", "body.prompt must be one string; a list of prompts or of token ids is "
                                         "not supported")
    if not isinstance(value, str):
        raise _BadRow("bad prompt type", f"body.prompt must be a string, got {_type_name(value)}")
    if not value.strip():
        raise _BadRow("empty prompt", "body.prompt is empty")
    return _unicode(value, "body.prompt")


def _openai_row(source: str, line: Mapping[str, Any], spec: _Spec) -> _Row:
    """Turn one OpenAI batch line into a Request; problems (named by field) become an error request."""
    row_id = endpoint = model = keep = None
    try:
        row_id = _openai_id(line.get("custom_id"))
        keep = _kept(line, spec) if isinstance(spec.keep, tuple) else None  # the body is the request
        endpoint, content = _openai_endpoint(line)
        body = line.get("body")
        if not isinstance(body, Mapping):
            raise _BadRow("bad body", "missing body" if body is None else
                          f"body must be an object, got {_type_name(body)}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _BadRow("bad body", f"body.model must be a string, got {_type_name(model)}")
        params = body_params(body, content)
        if endpoint == "chat":
            if body.get("messages") is None:
                raise _BadRow("bad messages", "body.messages is missing; /v1/chat/completions needs it")
            prompt, messages = None, _parse_messages(body["messages"], "body.messages")
        else:
            prompt, messages = _openai_prompt(body.get("prompt")), None
        return _Row(Request(source, row_id, prompt, messages, params=params, endpoint=endpoint, model=model,
                            keep=keep))
    except ParamError as bad:
        return _Row(Request(source, row_id, None, None, bad.message, endpoint=endpoint, model=model, keep=keep),
                    bad.kind)
    except _BadRow as bad:
        return _Row(Request(source, row_id, None, None, bad.message, endpoint=endpoint, model=model, keep=keep),
                    bad.kind)


def _bad_row(source: str, kind: str, message: str) -> _Row:
    return _Row(Request(source, None, None, None, message), kind)


# --------------------------------------------------------------------------
# Shard readers
# --------------------------------------------------------------------------


def _line_object(raw: bytes, first_line: bool) -> dict:
    """A non-blank JSONL line's JSON object; raises _BadRow."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _BadRow("invalid UTF-8", f"invalid UTF-8 at byte {exc.start}") from None
    if first_line:
        text = text.lstrip("\ufeff")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadRow("invalid JSON", f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise _BadRow("invalid JSON", f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise _BadRow("not an object", f"row must be a JSON object, got {_type_name(obj)}")
    return obj


def _jsonl_row(source: str, raw: bytes, first_line: bool, spec: _Spec, openai: bool) -> _Row:
    """Decode and validate one non-blank JSONL line: a plain row or an OpenAI batch line."""
    try:
        obj = _line_object(raw, first_line)
    except _BadRow as bad:
        return _bad_row(source, bad.kind, bad.message)
    return _openai_row(source, obj, spec) if openai else _build_row(source, obj, spec)


def _jsonl_lines(path: Path, handle, max_line_bytes: int) -> Iterator[tuple[int, bytes | int]]:
    """``(line number, line)`` for each line, or ``(line number, its length in bytes)`` for a line
    longer than ``max_line_bytes``, which is skipped without being held whole."""
    lineno = 0
    while True:
        try:
            raw = handle.readline(max_line_bytes + 1)
            if not raw:
                return
            if len(raw) <= max_line_bytes or raw.endswith(b"\n"):
                yield lineno, raw
            else:
                size = len(raw)
                while not raw.endswith(b"\n"):
                    raw = handle.readline(_SKIP_CHUNK)
                    if not raw:
                        break
                    size += len(raw)
                yield lineno, size - raw.endswith(b"\n")
        except OSError as exc:
            raise InputError(f"{path}: read error: {exc.strerror or exc}") from exc
        lineno += 1


def _open_binary(path: Path):
    try:
        return open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror or exc}") from exc


def _row_lines(path: Path, handle, max_line_bytes: int) -> Iterator[tuple[int, bytes | int]]:
    """The lines of a JSONL shard that are rows: the non-blank ones, and those over max_line_bytes."""
    for lineno, raw in _jsonl_lines(path, handle, max_line_bytes):
        if isinstance(raw, int) or raw.strip():
            yield lineno, raw


# OpenAI batch detection (format "auto") looks at most this many lines for the first JSON object.
_DETECT_LINES = 100


def _is_openai_batch(path: Path, max_line_bytes: int) -> bool:
    """Whether a JSONL shard's first JSON object line (within its first 100 rows) is an OpenAI
    batch request: it has a ``custom_id`` and a ``url`` or ``body``."""
    with _open_binary(path) as handle:
        lines = _row_lines(path, handle, max_line_bytes)
        for lineno, raw in itertools.islice(lines, _DETECT_LINES):
            try:
                obj = None if isinstance(raw, int) else _line_object(raw, lineno == 0)
            except _BadRow:
                continue
            if obj is not None:
                return "custom_id" in obj and ("url" in obj or "body" in obj)
    return False


def _reads_openai(path: Path, spec: _Spec, max_line_bytes: int) -> bool:
    """Whether this JSONL shard's lines are OpenAI batch requests (input.format, or detected)."""
    return spec.format == "openai" or (spec.format == "auto" and _is_openai_batch(path, max_line_bytes))


# Called once per row, in order, when rows are dealt: whether this worker takes the row.
Wanted = Callable[[], bool]


def _iter_jsonl(path: Path, spec: _Spec, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                wanted: Wanted | None = None) -> Iterator[_Row]:
    """Yield one row per non-blank line; the row index is the 0-based line number (blank lines
    are skipped, but counted). A line over ``max_line_bytes`` becomes an error row. A line that is
    not ``wanted`` is passed over unparsed."""
    openai = _reads_openai(path, spec, max_line_bytes)
    with _open_binary(path) as handle:
        for lineno, raw in _row_lines(path, handle, max_line_bytes):
            if wanted is not None and not wanted():
                continue
            if isinstance(raw, int):
                yield _bad_row(f"{path}#{lineno}", "line too long",
                               f"line is {raw} bytes, more than input.max_line_bytes ({max_line_bytes}); not read")
            else:
                yield _jsonl_row(f"{path}#{lineno}", raw, lineno == 0, spec, openai)


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


def _parquet_file(path: Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read Parquet file: {exc}") from exc


def _open_parquet(path: Path, spec: _Spec) -> tuple[pq.ParquetFile, list[str]]:
    """Open a Parquet shard and pick the columns to read (all of them when every other column is
    kept); checks the schema."""
    parquet_file = _parquet_file(path)
    names = parquet_file.schema_arrow.names
    listed = spec.keep if isinstance(spec.keep, tuple) else ()
    problems = column_problems(names, id_column=spec.id, prompt_column=spec.prompt, messages_column=spec.messages,
                               params_column=spec.params, keep_columns=listed)
    if problems:
        raise InputError(f"{path}: {problems[0]} (columns: {', '.join(names)})")
    wanted = names if spec.keep is True else [c for c in (*spec.read, *listed) if c in names]
    return parquet_file, list(dict.fromkeys(wanted))


def _parquet_batches(path: Path, parquet_file: pq.ParquetFile, columns: list[str], batch_rows: int) -> Iterator[dict[str, list]]:
    """Yield ``{column: values}`` for each record batch, converting read errors to InputError."""
    batches = parquet_file.iter_batches(batch_size=batch_rows, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"{path}: error while reading Parquet data: {exc}") from exc
        yield {name: _column_values(batch.column(name)) for name in columns}


def _column_values(column: pa.Array) -> list:
    """A column's values; a value with bytes that are not UTF-8 becomes _NotUtf8 (its row an error row)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    values = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except UnicodeDecodeError as exc:
            values.append(_NotUtf8(exc.start))
    return values


def _iter_parquet(path: Path, spec: _Spec, batch_rows: int, wanted: Wanted | None = None) -> Iterator[_Row]:
    """Yield the rows of a Parquet shard, one record batch in memory at a time."""
    parquet_file, columns = _open_parquet(path, spec)
    row_index = 0
    for data in _parquet_batches(path, parquet_file, columns, batch_rows):
        for values in zip(*(data[name] for name in columns)):
            if wanted is None or wanted():
                yield _build_row(f"{path}#{row_index}", dict(zip(columns, values)), spec)
            row_index += 1


def _iter_shard(path: Path, spec: _Spec, batch_rows: int, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                wanted: Wanted | None = None) -> Iterator[_Row]:
    """Yield the (wanted) rows of one shard of either format."""
    path = Path(path).resolve()
    if _file_format(path) == "parquet":
        return _iter_parquet(path, spec, batch_rows, wanted)
    return _iter_jsonl(path, spec, max_line_bytes, wanted)


def _dealt(shard_index: int, row_modulo: int | None) -> Wanted | None:
    """The rows this worker takes when rows are dealt (None: all rows of its files)."""
    if row_modulo is None:
        return None
    rows = itertools.count()
    return lambda: next(rows) % row_modulo == shard_index


def _iter_worker_rows(
    files: Iterable[Path], spec: _Spec, batch_rows: int, shard_index: int, row_modulo: int | None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[_Row]:
    """Yield the rows that belong to this worker, in file order."""
    wanted = _dealt(shard_index, row_modulo)
    for path in files:
        yield from _iter_shard(path, spec, batch_rows, max_line_bytes, wanted)


def _row_indices(path: Path, max_line_bytes: int) -> Iterator[int]:
    """The row indices (the part of a source after '#') of a shard's rows, in order, unparsed."""
    if _file_format(path) == "parquet":
        yield from range(_parquet_file(path).metadata.num_rows)
        return
    with _open_binary(path) as handle:
        for lineno, _ in _row_lines(path, handle, max_line_bytes):
            yield lineno


def count_rows(path: str | os.PathLike, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
    """How many rows a shard gives: a Parquet file's from its metadata, a JSONL file's lines read
    but not parsed. Raises InputError for a file that cannot be read."""
    path = Path(path).resolve()
    if _file_format(path) == "parquet":
        return _parquet_file(path).metadata.num_rows
    return sum(1 for _ in _row_indices(path, max_line_bytes))


def worker_sources(shards: list[Path], shard_index: int, num_shards: int,
                   max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[str]:
    """The sources of this worker's rows, in order: those :func:`iter_requests` yields it (before
    resume skipping), found without parsing a row. Raises InputError for a file that cannot be read."""
    files, row_modulo = assign(list(shards), shard_index, num_shards)
    wanted = _dealt(shard_index, row_modulo)
    for p in files:
        path = Path(p).resolve()
        for i in _row_indices(path, max_line_bytes):
            if wanted is None or wanted():
                yield f"{path}#{i}"


# --------------------------------------------------------------------------
# Public streaming API
# --------------------------------------------------------------------------


def _mark_duplicate(request: Request, seen_ids: set[str]) -> Request:
    """Record an ok request's id; a repeated id turns the request into an error."""
    if not request.ok:
        return request
    if request.id in seen_ids:
        return replace(request, prompt=None, messages=None, error=f"duplicate id {request.id!r}")
    seen_ids.add(request.id)
    return request


def requests_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    id_column: str = "id",
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    params_column: str | None = None,
    keep_columns: bool | str | Sequence[str] | None = False,
    source_prefix: str = "",
) -> list[Request]:
    """Rows given as mappings (a batch handed over by Ray Data, say) -> requests, one per row.

    The same checks as for a shard's plain rows: a bad row becomes an error request, and a repeated
    id (within these rows) a "duplicate id" error. Row i's source is ``f"{source_prefix}#{i}"``.
    ``params_column`` and ``keep_columns`` as for :func:`iter_requests`.
    """
    spec = _spec(id_column, prompt_column, messages_column, params_column, keep_columns)
    seen: set[str] = set()
    return [_mark_duplicate(_build_row(f"{source_prefix}#{i}", values, spec).request, seen)
            for i, values in enumerate(rows)]


def _check_positive(name: str, value: int | None, *, allow_none: bool, minimum: int) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def iter_requests(
    shards: list[Path],
    *,
    id_column: str = "id",
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    params_column: str | None = None,
    keep_columns: bool | str | Sequence[str] | None = False,
    fmt: str = "auto",
    shard_index: int = 0,
    num_shards: int = 1,
    done_sources: AbstractSet[str] = frozenset(),
    seen_ids: set[str] | None = None,
    limit: int | None = None,
    batch_rows: int = 1024,
    on_skip: Callable[[Request], None] | None = None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[Request]:
    """Stream this worker's requests from the shards.

    Files are opened lazily, in order; only one JSONL line or one Parquet
    batch of ``batch_rows`` rows is held at a time.

    Args:
        shards: shard paths, normally from :func:`list_shards`.
        id_column, prompt_column, messages_column: input field names. A row
            needs a non-null prompt or non-null messages; one with both is an
            error row. Blank JSONL lines give no row. (Not used for OpenAI
            batch lines: custom_id is the id, the body holds the prompt.)
        params_column: a column whose value (an object, or null) holds the
            row's own sampling settings (max_tokens, temperature, top_p, top_k,
            stop, seed); a bad value makes the row an error row.
        keep_columns: the input columns carried to the output row
            (Request.keep; output.keep_columns): "all" (or True) every column
            that is not the request's (for OpenAI lines: none, the body is the
            request), a list those named (for OpenAI lines: top-level fields of
            the line; a row that lacks one has it null), "none" (or False) none.
        fmt: input.format. "auto" reads a JSONL shard as an OpenAI batch file
            when its first JSON object line has a custom_id and a url or body;
            "openai" reads every shard so; "jsonl" and "parquet" never do.
        shard_index, num_shards: this worker's part of the input (see :func:`assign`).
        done_sources: sources already written by an earlier run; these rows are
            skipped. Their ids (when the row is valid) still count as seen, so
            duplicate detection gives the same result as in the first run.
        seen_ids: ids already used; updated in place with every yielded ok id.
            A later row with a seen id becomes a "duplicate id 'x'" error.
        limit: stop after this many of this worker's rows have been considered,
            counting rows skipped by ``done_sources``.
        batch_rows: Parquet record batch size.
        on_skip: called with each row skipped because its source is in ``done_sources``.
        max_line_bytes: a longer JSONL line is an error row, never read whole.

    Raises:
        InputError: a file cannot be read, or a Parquet file lacks required
            columns (raised when that file is reached).
    """
    _check_positive("limit", limit, allow_none=True, minimum=0)
    _check_positive("batch_rows", batch_rows, allow_none=False, minimum=1)
    _check_positive("max_line_bytes", max_line_bytes, allow_none=False, minimum=1)
    files, row_modulo = assign(list(shards), shard_index, num_shards)
    spec = _spec(id_column, prompt_column, messages_column, params_column, keep_columns, fmt)
    seen = seen_ids if seen_ids is not None else set()
    if limit == 0:
        return
    considered = 0
    for row in _iter_worker_rows(files, spec, batch_rows, shard_index, row_modulo, max_line_bytes):
        considered += 1
        request = row.request
        if request.source in done_sources:
            if request.ok:
                seen.add(request.id)
            if on_skip is not None:
                on_skip(request)
        else:
            yield _mark_duplicate(request, seen)
        if limit is not None and considered >= limit:
            return


# --------------------------------------------------------------------------
# Validation report
# --------------------------------------------------------------------------


@dataclass
class _BadKindStats:
    """Count and first example of one kind of bad row."""

    count: int = 0
    first_source: str = ""
    first_message: str = ""


@dataclass
class _InputReport:
    """Accumulates problems found while scanning the input."""

    problems: list[str] = field(default_factory=list)
    first_source_by_id: dict[str, str] = field(default_factory=dict)
    duplicates: int = 0
    bad: dict[str, _BadKindStats] = field(default_factory=dict)

    def add_row(self, row: _Row) -> None:
        request = row.request
        if row.kind is not None:
            self._add_bad(row.kind, request)
            return
        first = self.first_source_by_id.setdefault(request.id, request.source)
        if first != request.source:
            self._add_duplicate(request, first)

    def _add_bad(self, kind: str, request: Request) -> None:
        stats = self.bad.setdefault(kind, _BadKindStats(0, request.source, request.error or ""))
        stats.count += 1

    def _add_duplicate(self, request: Request, first: str) -> None:
        self.duplicates += 1
        if self.duplicates <= _MAX_DUPLICATES_LISTED:
            self.problems.append(f"duplicate id {request.id!r}: {first} and {request.source}")

    def finish(self) -> list[str]:
        problems = list(self.problems)
        if self.duplicates > _MAX_DUPLICATES_LISTED:
            problems.append(f"... {self.duplicates - _MAX_DUPLICATES_LISTED} more duplicate ids not listed")
        for kind, stats in self.bad.items():
            rows = "row" if stats.count == 1 else "rows"
            problems.append(
                f"{stats.count} bad {rows} ({kind}); first at {_where(stats.first_source)}: {stats.first_message}"
            )
        return problems


def _where(source: str) -> str:
    """A source as a person looks it up: a JSONL row's with its 1-based line number."""
    path, _, index = source.rpartition("#")
    if _file_format(Path(path)) == "jsonl" and index.isdigit():
        return f"{source} (line {int(index) + 1})"
    return source


def _jsonl_fields(path: Path, rows: int, max_line_bytes: int) -> tuple[set[str], int]:
    """The field names of the JSON objects among a JSONL shard's first ``rows`` non-blank lines,
    and how many objects there were (lines that are no JSON object are passed over)."""
    names: set[str] = set()
    seen = 0
    with _open_binary(path) as handle:
        for lineno, raw in _jsonl_lines(path, handle, max_line_bytes):
            if isinstance(raw, int) or not raw.strip():
                continue
            rows -= 1
            try:
                obj = json.loads(raw.decode("utf-8").lstrip("\ufeff"))
            except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                obj = None
            if isinstance(obj, dict):
                names.update(obj)
                seen += 1
            if rows <= 0:
                break
    return names, seen


def check_columns(shards: list[Path], *, id_column: str = "id", prompt_column: str = "prompt",
                  messages_column: str = "messages", params_column: str | None = None,
                  keep_columns: bool | str | Sequence[str] | None = False, fmt: str = "auto",
                  jsonl_rows: int = 100, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
    """Check the columns before a run starts rather than at the file: every Parquet shard's from its
    metadata (no rows read; the params column and the kept columns named must be there too), and
    for JSONL, which has no schema, the fields of the first ``jsonl_rows`` rows of the first plain
    JSONL shard (a configured column that none of them has, say a typo in input.prompt_column,
    would make every row an error row). OpenAI batch shards have no columns to check (validate
    reports their bad lines). Raises InputError."""
    spec = _spec(id_column, prompt_column, messages_column, params_column, keep_columns, fmt)
    first_jsonl = True
    for path in shards:
        path = Path(path).resolve()
        if _file_format(path) == "parquet":
            _open_parquet(path, spec)
        elif first_jsonl and jsonl_rows > 0 and not _reads_openai(path, spec, max_line_bytes):
            first_jsonl = False
            names, objects = _jsonl_fields(path, jsonl_rows, max_line_bytes)
            problems = column_problems(sorted(names), id_column=id_column, prompt_column=prompt_column,
                                       messages_column=messages_column)
            if objects and problems:
                shown = sorted(names)
                listed = ", ".join(shown[:20]) + (f", ... ({len(shown)} in all)" if len(shown) > 20 else "")
                hint = (" (an OpenAI batch file? set input.format to openai or auto)" if "custom_id" in names
                        else "")
                raise InputError(f"{path}: {problems[0]}: none of its first {objects} rows has it "
                                 f"(fields: {listed or 'none'}); check input.id_column, input.prompt_column "
                                 f"and input.messages_column{hint}")


def check_input(
    shards: list[Path],
    *,
    id_column: str = "id",
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    params_column: str | None = None,
    keep_columns: bool | str | Sequence[str] | None = False,
    fmt: str = "auto",
    max_rows_scanned: int | None = None,
    batch_rows: int = 1024,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> list[str]:
    """Scan the whole input (all workers' rows) and describe its problems.

    Reports unreadable files, Parquet files with missing columns, duplicate ids
    (with both locations; ids are compared across all files) and, per kind of
    bad row (a bad OpenAI batch line: its custom_id, method, url, body or a
    field of it), the count and the first example, with its line number for
    JSONL. Files are streamed; only the ids seen so far are kept in memory. An
    empty list means the input is OK. The column options as for :func:`iter_requests`.

    Args:
        max_rows_scanned: stop after this many rows in total (None: scan everything).
    """
    _check_positive("max_rows_scanned", max_rows_scanned, allow_none=True, minimum=0)
    if not shards:
        return ["no input files"]
    spec = _spec(id_column, prompt_column, messages_column, params_column, keep_columns, fmt)
    report = _InputReport()
    scanned = 0
    for path in shards:
        if max_rows_scanned is not None and scanned >= max_rows_scanned:
            break
        try:
            for row in _iter_shard(path, spec, batch_rows, max_line_bytes):
                report.add_row(row)
                scanned += 1
                if max_rows_scanned is not None and scanned >= max_rows_scanned:
                    break
        except InputError as exc:
            report.problems.append(str(exc))
    return report.finish()
