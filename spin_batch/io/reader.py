"""Streaming input: shard discovery, worker assignment and row validation.

Input shards are JSONL files (one JSON object per line) or Parquet files.
Every row becomes a :class:`Request`. Rows that cannot be decoded (bad JSON,
missing id, empty prompt, ...) become requests with ``error`` set, so the job
writes an error row for them instead of stopping.

Memory stays bounded: JSONL is read one line at a time and Parquet one record
batch at a time, reading only the columns that are needed. A JSONL line longer
than ``max_line_bytes`` (``input.max_line_bytes``) is never held whole: it is
skipped in chunks and becomes an error row.

JSONL: blank lines (empty or only whitespace) are skipped without a row; they
still count in the line numbers, so a row's source names its real line.

A row with both a prompt and messages (both non-null) is an error row: which
one to decode would be a guess.

Each row has a ``source`` key, ``"<absolute shard path>#<row index>"``, which
stays the same across reruns and is used to resume an interrupted job.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..records import Request

__all__ = [
    "FORMATS",
    "InputError",
    "Request",
    "assign",
    "check_input",
    "iter_requests",
    "list_shards",
    "shard_defaults_from_env",
]

FORMATS = ("auto", "jsonl", "parquet")

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


def _wanted(path: Path, fmt: str, *, in_directory: bool) -> bool:
    """Whether a file found by a glob or a directory listing should be read."""
    if in_directory and (path.name.startswith(".") or path.suffix.lower() not in _DIR_SUFFIXES):
        return False
    kind = _file_format(path)
    return kind is not None and (fmt == "auto" or kind == fmt)


def _describe(fmt: str) -> str:
    return "input" if fmt == "auto" else fmt


def _explicit_file(entry: str, path: Path, fmt: str) -> list[Path]:
    """Validate a file named explicitly (not through a glob or directory)."""
    kind = _file_format(path)
    if kind is None:
        raise InputError(f"{entry}: unsupported file type (expected .jsonl, .ndjson, .json or .parquet)")
    if fmt != "auto" and kind != fmt:
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
            the input to that format.

    Raises:
        InputError: an entry matches no file, or ``fmt`` is unknown.
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


def assign(shards: list[Path], shard_index: int, num_shards: int) -> tuple[list[Path], int | None]:
    """Decide which part of the input this worker reads.

    With at least as many files as workers, the worker reads whole files
    ``shards[shard_index::num_shards]`` and the row modulo is None. With fewer
    files, it reads all files and keeps global rows whose running row number
    satisfies ``row % num_shards == shard_index`` (the returned modulo is
    ``num_shards``).

    Raises:
        InputError: ``shard_index`` is not in ``[0, num_shards)``.
    """
    _check_shard_args(shard_index, num_shards)
    shards = list(shards)
    if num_shards == 1 or len(shards) >= num_shards:
        return shards[shard_index::num_shards], None
    return shards, num_shards


# --------------------------------------------------------------------------
# Row validation
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Columns:
    """Names of the input columns/fields."""

    id: str = "id"
    prompt: str = "prompt"
    messages: str = "messages"


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


def _parse_message(index: int, item: Any) -> dict:
    """Validate one chat message; keeps role, content and any non-null extra keys."""
    where = f"messages[{index}]"
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


def _parse_messages(value: Any) -> tuple[dict, ...]:
    """Validate a non-empty list of ``{"role": str, "content": str}`` dicts."""
    if not isinstance(value, (list, tuple)):
        raise _BadRow("bad messages", f"messages must be a list of messages, got {_type_name(value)}")
    if not value:
        raise _BadRow("bad messages", "messages must not be empty")
    return tuple(_parse_message(i, item) for i, item in enumerate(value))


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


def _build_row(source: str, values: Mapping[str, Any], cols: _Columns) -> _Row:
    """Turn a row's field values into a Request; problems become an error request."""
    def not_utf8(row_id: str | None, key: str, v: _NotUtf8) -> _Row:
        return _Row(Request(source, row_id, None, None, f"invalid UTF-8 in column {key!r} at byte {v.at}"),
                    "invalid UTF-8")

    raw_id = _value(values, cols.id)
    if isinstance(raw_id, _NotUtf8):
        return not_utf8(None, cols.id, raw_id)
    try:
        row_id = _parse_id(raw_id)
    except _BadRow as bad:
        return _Row(Request(source, None, None, None, bad.message), bad.kind)
    for key in (cols.prompt, cols.messages):
        if isinstance(v := values.get(key), _NotUtf8):
            return not_utf8(row_id, key, v)
    try:
        messages = _value(values, cols.messages)
        if messages is not None and _value(values, cols.prompt) is not None:
            raise _BadRow("prompt and messages",
                          f"row has both {cols.prompt!r} and {cols.messages!r}; give one of them (the other null "
                          "or absent)")
        if messages is not None:
            return _Row(Request(source, row_id, None, _parse_messages(messages)))
        return _Row(Request(source, row_id, _parse_prompt(_value(values, cols.prompt)), None))
    except _BadRow as bad:
        return _Row(Request(source, row_id, None, None, bad.message), bad.kind)


def _bad_row(source: str, kind: str, message: str) -> _Row:
    return _Row(Request(source, None, None, None, message), kind)


# --------------------------------------------------------------------------
# Shard readers
# --------------------------------------------------------------------------


def _jsonl_row(source: str, raw: bytes, first_line: bool, cols: _Columns) -> _Row:
    """Decode and validate one non-blank JSONL line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _bad_row(source, "invalid UTF-8", f"invalid UTF-8 at byte {exc.start}")
    if first_line:
        text = text.lstrip("\ufeff")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return _bad_row(source, "invalid JSON", f"invalid JSON: {exc.msg} (column {exc.colno})")
    except (ValueError, RecursionError) as exc:
        return _bad_row(source, "invalid JSON", f"invalid JSON: {exc}")
    if not isinstance(obj, dict):
        return _bad_row(source, "not an object", f"row must be a JSON object, got {_type_name(obj)}")
    return _build_row(source, obj, cols)


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


def _iter_jsonl(path: Path, cols: _Columns, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[_Row]:
    """Yield one row per non-blank line; the row index is the 0-based line number (blank lines
    are skipped, but counted). A line over ``max_line_bytes`` becomes an error row."""
    with _open_binary(path) as handle:
        for lineno, raw in _jsonl_lines(path, handle, max_line_bytes):
            if isinstance(raw, int):
                yield _bad_row(f"{path}#{lineno}", "line too long",
                               f"line is {raw} bytes, more than input.max_line_bytes ({max_line_bytes}); not read")
            elif raw.strip():
                yield _jsonl_row(f"{path}#{lineno}", raw, lineno == 0, cols)


def column_problems(names: Sequence[str], *, id_column: str = "id", prompt_column: str = "prompt",
                    messages_column: str = "messages") -> list[str]:
    """What a table with these columns lacks to be read as input (a Parquet shard, a Ray Dataset)."""
    problems = []
    if id_column not in names:
        problems.append(f"missing id column {id_column!r}")
    if prompt_column not in names and messages_column not in names:
        problems.append(f"needs a prompt column {prompt_column!r} or a messages column {messages_column!r}")
    return problems


def _open_parquet(path: Path, cols: _Columns) -> tuple[pq.ParquetFile, list[str]]:
    """Open a Parquet shard and pick the columns to read; checks the schema."""
    try:
        parquet_file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read Parquet file: {exc}") from exc
    names = parquet_file.schema_arrow.names
    problems = column_problems(names, id_column=cols.id, prompt_column=cols.prompt, messages_column=cols.messages)
    if problems:
        raise InputError(f"{path}: {problems[0]} (columns: {', '.join(names)})")
    wanted = list(dict.fromkeys(c for c in (cols.id, cols.prompt, cols.messages) if c in names))
    return parquet_file, wanted


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


def _iter_parquet(path: Path, cols: _Columns, batch_rows: int) -> Iterator[_Row]:
    """Yield the rows of a Parquet shard, one record batch in memory at a time."""
    parquet_file, columns = _open_parquet(path, cols)
    row_index = 0
    for data in _parquet_batches(path, parquet_file, columns, batch_rows):
        for values in zip(*(data[name] for name in columns)):
            yield _build_row(f"{path}#{row_index}", dict(zip(columns, values)), cols)
            row_index += 1


def _iter_shard(path: Path, cols: _Columns, batch_rows: int,
                max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[_Row]:
    """Yield the rows of one shard of either format."""
    path = Path(path).resolve()
    if _file_format(path) == "parquet":
        return _iter_parquet(path, cols, batch_rows)
    return _iter_jsonl(path, cols, max_line_bytes)


def _iter_worker_rows(
    files: Iterable[Path], cols: _Columns, batch_rows: int, shard_index: int, row_modulo: int | None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[_Row]:
    """Yield the rows that belong to this worker, in file order."""
    global_row = 0
    for path in files:
        for row in _iter_shard(path, cols, batch_rows, max_line_bytes):
            if row_modulo is None or global_row % row_modulo == shard_index:
                yield row
            global_row += 1


# --------------------------------------------------------------------------
# Public streaming API
# --------------------------------------------------------------------------


def _mark_duplicate(request: Request, seen_ids: set[str]) -> Request:
    """Record an ok request's id; a repeated id turns the request into an error."""
    if not request.ok:
        return request
    if request.id in seen_ids:
        return Request(request.source, request.id, None, None, f"duplicate id {request.id!r}")
    seen_ids.add(request.id)
    return request


def requests_from_rows(
    rows: Iterable[Mapping[str, Any]],
    *,
    id_column: str = "id",
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    source_prefix: str = "",
) -> list[Request]:
    """Rows given as mappings (a batch handed over by Ray Data, say) -> requests, one per row.

    The same checks as for a shard's rows: a bad row becomes an error request, and a repeated
    id (within these rows) a "duplicate id" error. Row i's source is ``f"{source_prefix}#{i}"``.
    """
    cols = _Columns(id_column, prompt_column, messages_column)
    seen: set[str] = set()
    return [_mark_duplicate(_build_row(f"{source_prefix}#{i}", values, cols).request, seen)
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
            error row. Blank JSONL lines give no row.
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
    cols = _Columns(id_column, prompt_column, messages_column)
    seen = seen_ids if seen_ids is not None else set()
    if limit == 0:
        return
    considered = 0
    for row in _iter_worker_rows(files, cols, batch_rows, shard_index, row_modulo, max_line_bytes):
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
                f"{stats.count} bad {rows} ({kind}); first at {stats.first_source}: {stats.first_message}"
            )
        return problems


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
                  messages_column: str = "messages", jsonl_rows: int = 100,
                  max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
    """Check the columns before a run starts rather than at the file: every Parquet shard's from its
    metadata (no rows read), and for JSONL, which has no schema, the fields of the first
    ``jsonl_rows`` rows of the first JSONL shard (a configured column that none of them has, say a
    typo in input.prompt_column, would make every row an error row). Raises InputError."""
    cols = _Columns(id_column, prompt_column, messages_column)
    first_jsonl = True
    for path in shards:
        path = Path(path).resolve()
        if _file_format(path) == "parquet":
            _open_parquet(path, cols)
        elif first_jsonl and jsonl_rows > 0:
            first_jsonl = False
            names, objects = _jsonl_fields(path, jsonl_rows, max_line_bytes)
            problems = column_problems(sorted(names), id_column=id_column, prompt_column=prompt_column,
                                       messages_column=messages_column)
            if objects and problems:
                shown = sorted(names)
                listed = ", ".join(shown[:20]) + (f", ... ({len(shown)} in all)" if len(shown) > 20 else "")
                raise InputError(f"{path}: {problems[0]}: none of its first {objects} rows has it "
                                 f"(fields: {listed or 'none'}); check input.id_column, input.prompt_column "
                                 "and input.messages_column")


def check_input(
    shards: list[Path],
    *,
    id_column: str = "id",
    prompt_column: str = "prompt",
    messages_column: str = "messages",
    max_rows_scanned: int | None = None,
    batch_rows: int = 1024,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> list[str]:
    """Scan the whole input (all workers' rows) and describe its problems.

    Reports unreadable files, Parquet files with missing columns, duplicate ids
    (with both locations; ids are compared across all files) and, per kind of
    bad row, the count and the first example. Files are streamed; only the
    ids seen so far are kept in memory. An empty list means the input is OK.

    Args:
        max_rows_scanned: stop after this many rows in total (None: scan everything).
    """
    _check_positive("max_rows_scanned", max_rows_scanned, allow_none=True, minimum=0)
    if not shards:
        return ["no input files"]
    cols = _Columns(id_column, prompt_column, messages_column)
    report = _InputReport()
    scanned = 0
    for path in shards:
        if max_rows_scanned is not None and scanned >= max_rows_scanned:
            break
        try:
            for row in _iter_shard(path, cols, batch_rows, max_line_bytes):
                report.add_row(row)
                scanned += 1
                if max_rows_scanned is not None and scanned >= max_rows_scanned:
                    break
        except InputError as exc:
            report.problems.append(str(exc))
    return report.finish()
