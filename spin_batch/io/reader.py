"""Streaming input: a worker's shards read row by row into Requests (:func:`iter_requests`), and rows
handed over as mappings (:func:`requests_from_rows`).

Memory stays bounded: JSONL is read one line at a time and Parquet one record batch at a time,
reading only the columns that are needed (the kept columns too).

A JSONL shard is either plain rows (io/rows.py) or an OpenAI batch file (io/openai_request.py).
With format "auto" a file is read as OpenAI batch when its first JSON object line has a
``custom_id`` and a ``url`` or ``body``; format "openai" reads every file so. A JSONL line that
is not UTF-8, not JSON or not an object, or is longer than ``max_line_bytes``, becomes an error
row; a blank line gives no row.

An ok row whose id was seen before becomes a "duplicate id" error row. Each row gets its identity
(its resume key, io/identity.py) as it is read: a rerun skips the rows an earlier run wrote by it.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..records import Request
from .identity import duplicate_message, line_digest
from .openai_request import openai_row
from .rows import BadRow, NotUtf8, Row, Spec, bad_row, build_row, column_problems, type_name
from .shards import (DEFAULT_MAX_LINE_BYTES, InputError, Wanted, assign, dealt, file_format, open_binary,
                     open_parquet_file, row_lines)

__all__ = ["check_positive", "iter_requests", "iter_shard", "open_parquet", "reads_openai", "requests_from_rows"]


# --------------------------------------------------------------------------
# JSONL shards
# --------------------------------------------------------------------------


def _line_object(raw: bytes, first_line: bool) -> dict:
    """A non-blank JSONL line's JSON object; raises BadRow."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRow("invalid UTF-8", f"invalid UTF-8 at byte {exc.start}") from None
    if first_line:
        text = text.lstrip("\ufeff")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRow("invalid JSON", f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:
        raise BadRow("invalid JSON", f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRow("not an object", f"row must be a JSON object, got {type_name(obj)}")
    return obj


def _jsonl_row(source: str, raw: bytes, first_line: bool, spec: Spec, openai: bool) -> Row:
    """Decode and validate one non-blank JSONL line: a plain row or an OpenAI batch line."""
    try:
        obj = _line_object(raw, first_line)
    except BadRow as bad:
        return bad_row(source, bad.kind, bad.message, line_digest(raw))
    return openai_row(source, obj, spec) if openai else build_row(source, obj, spec)


# OpenAI batch detection (format "auto") looks at most this many lines for the first JSON object.
_DETECT_LINES = 100


def _is_openai_batch(path: Path, max_line_bytes: int) -> bool:
    """Whether a JSONL shard's first JSON object line (within its first 100 rows) is an OpenAI
    batch request: it has a ``custom_id`` and a ``url`` or ``body``."""
    with open_binary(path) as handle:
        lines = row_lines(path, handle, max_line_bytes)
        for lineno, raw in itertools.islice(lines, _DETECT_LINES):
            try:
                obj = None if isinstance(raw, int) else _line_object(raw, lineno == 0)
            except BadRow:
                continue
            if obj is not None:
                return "custom_id" in obj and ("url" in obj or "body" in obj)
    return False


def reads_openai(path: Path, spec: Spec, max_line_bytes: int) -> bool:
    """Whether this JSONL shard's lines are OpenAI batch requests (input.format, or detected)."""
    return spec.format == "openai" or (spec.format == "auto" and _is_openai_batch(path, max_line_bytes))


def _iter_jsonl(path: Path, spec: Spec, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                wanted: Wanted | None = None) -> Iterator[Row]:
    """Yield one row per non-blank line; the row index is the 0-based line number (blank lines
    are skipped, but counted). A line over ``max_line_bytes`` becomes an error row. A line that is
    not ``wanted`` is passed over unparsed."""
    openai = reads_openai(path, spec, max_line_bytes)
    with open_binary(path) as handle:
        for lineno, raw in row_lines(path, handle, max_line_bytes):
            if wanted is not None and not wanted():
                continue
            if isinstance(raw, int):
                yield bad_row(f"{path}#{lineno}", "line too long",
                              f"line is {raw} bytes, more than input.max_line_bytes ({max_line_bytes}); not read",
                              line_digest(raw))
            else:
                yield _jsonl_row(f"{path}#{lineno}", raw, lineno == 0, spec, openai)


# --------------------------------------------------------------------------
# Parquet shards
# --------------------------------------------------------------------------


def open_parquet(path: Path, spec: Spec) -> tuple[pq.ParquetFile, list[str]]:
    """Open a Parquet shard and pick the columns to read (all of them when every other column is
    kept); checks the schema."""
    parquet_file = open_parquet_file(path)
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
    """A column's values; a value with bytes that are not UTF-8 becomes NotUtf8 (its row an error row)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        pass
    values = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except UnicodeDecodeError as exc:
            values.append(NotUtf8(exc.start))
    return values


def _iter_parquet(path: Path, spec: Spec, batch_rows: int, wanted: Wanted | None = None) -> Iterator[Row]:
    """Yield the rows of a Parquet shard, one record batch in memory at a time."""
    parquet_file, columns = open_parquet(path, spec)
    row_index = 0
    for data in _parquet_batches(path, parquet_file, columns, batch_rows):
        for values in zip(*(data[name] for name in columns)):
            if wanted is None or wanted():
                yield build_row(f"{path}#{row_index}", dict(zip(columns, values)), spec)
            row_index += 1


# --------------------------------------------------------------------------
# A worker's requests
# --------------------------------------------------------------------------


def iter_shard(path: Path, spec: Spec, batch_rows: int, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
               wanted: Wanted | None = None) -> Iterator[Row]:
    """Yield the (wanted) rows of one shard of either format."""
    path = Path(path).resolve()
    if file_format(path) == "parquet":
        return _iter_parquet(path, spec, batch_rows, wanted)
    return _iter_jsonl(path, spec, max_line_bytes, wanted)


def _iter_worker_rows(
    files: Iterable[Path], spec: Spec, batch_rows: int, shard_index: int, row_modulo: int | None,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Iterator[Row]:
    """Yield the rows that belong to this worker, in file order."""
    wanted = dealt(shard_index, row_modulo)
    for path in files:
        yield from iter_shard(path, spec, batch_rows, max_line_bytes, wanted)


class _Keys:
    """Gives each of a worker's rows its identity (io/identity.py): the first row with an id is keyed
    by it; a row with no id, or with an id an earlier row has, by its place (``input_key``: how many
    rows with its id and digest came before; for a row with no id, also the worker where the input
    is split)."""

    def __init__(self, shard_index: int, num_shards: int) -> None:
        self.ids: set[str] = set()
        self.copies: Counter[tuple[str | None, str | None]] = Counter()
        self.tag = "" if num_shards == 1 else f"/w{shard_index:04d}"

    def __call__(self, request: Request) -> Request:
        copy = (request.id, request.digest)
        n = self.copies[copy]  # 0 for the first row with an id
        self.copies[copy] += 1
        if request.id is not None and request.id not in self.ids:
            self.ids.add(request.id)
            return request
        return replace(request, input_key=f"{n}{self.tag if request.id is None else ''}")


def _mark_duplicate(request: Request, seen_ids: set[str]) -> Request:
    """Record an ok request's id; a repeated id turns the request into an error."""
    if not request.ok:
        return request
    if request.id in seen_ids:
        return replace(request, prompt=None, messages=None, error=duplicate_message(request.id))
    seen_ids.add(request.id)
    return request


def requests_from_rows(rows: Iterable[Mapping[str, Any]], spec: Spec = Spec(), *,
                       source_prefix: str = "") -> list[Request]:
    """Rows given as mappings (a batch handed over by Ray Data, say) -> requests, one per row.

    The same checks as for a shard's plain rows: a bad row becomes an error request, and a repeated
    id (within these rows) a "duplicate id" error. Row i's source is ``f"{source_prefix}#{i}"``.
    ``spec`` as for :func:`iter_requests` (its format is not read: these are plain rows).
    """
    seen: set[str] = set()
    return [_mark_duplicate(build_row(f"{source_prefix}#{i}", values, spec).request, seen)
            for i, values in enumerate(rows)]


def check_positive(name: str, value: int | None, *, allow_none: bool, minimum: int) -> None:
    """An argument that must be an integer >= ``minimum`` (or None, where allowed); ValueError if not."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def iter_requests(
    shards: list[Path],
    spec: Spec = Spec(),
    *,
    shard_index: int = 0,
    num_shards: int = 1,
    done_sources: AbstractSet[str] = frozenset(),
    is_done: Callable[[Request], bool] | None = None,
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
        spec: how rows are read (rows.Spec: row_spec(), or input_spec() of a job):
            id, prompt, messages: input field names. A row needs a non-null
            prompt or non-null messages; one with both is an error row. Blank
            JSONL lines give no row. (Not used for OpenAI batch lines: custom_id
            is the id, the body holds the prompt.)
            params: a column whose value (an object, or null) holds the row's
            own sampling settings (max_tokens, temperature, top_p, top_k, stop,
            seed); a bad value makes the row an error row.
            keep: the input columns carried to the output row (Request.keep;
            output.keep_columns): every column that is not the request's (for
            OpenAI lines: none, the body is the request), those named (for
            OpenAI lines: top-level fields of the line; a row that lacks one
            has it null), or none.
            format: input.format. "auto" reads a JSONL shard as an OpenAI batch
            file when its first JSON object line has a custom_id and a url or
            body; "openai" reads every shard so; "jsonl" and "parquet" never do.
        shard_index, num_shards: this worker's part of the input (see :func:`assign`).
        done_sources: sources already written by an earlier run; these rows are
            skipped. Their ids (when the row is valid) still count as seen, so
            duplicate detection gives the same result as in the first run.
        is_done: whether an earlier run wrote this row (by its key and digest,
            io/identity.py; the request has its ``input_key`` set): skipped too.
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
    check_positive("limit", limit, allow_none=True, minimum=0)
    check_positive("batch_rows", batch_rows, allow_none=False, minimum=1)
    check_positive("max_line_bytes", max_line_bytes, allow_none=False, minimum=1)
    files, row_modulo = assign(list(shards), shard_index, num_shards)
    seen = seen_ids if seen_ids is not None else set()
    if limit == 0:
        return
    considered = 0
    keys = _Keys(shard_index, num_shards)
    for row in _iter_worker_rows(files, spec, batch_rows, shard_index, row_modulo, max_line_bytes):
        considered += 1
        request = keys(row.request)
        if request.source in done_sources or (is_done is not None and is_done(request)):
            if request.ok:
                seen.add(request.id)
            if on_skip is not None:
                on_skip(request)
        else:
            yield _mark_duplicate(request, seen)
        if limit is not None and considered >= limit:
            return
