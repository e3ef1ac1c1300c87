"""Output: completions and stats written as atomic Parquet parts.

Layout under the output directory::

    outputs/part-{worker}-{run_id}-{seq:05d}.parquet   completions (OUTPUT_SCHEMA)
    stats/stats-{worker}-{run_id}-{seq:05d}.parquet    per-interval stats records

Each part is written under a hidden temporary name in the same directory,
fsynced and renamed with :func:`os.replace`, so a file with a final name is
always complete. A killed run leaves at most some temporary files, which
:func:`cleanup_temp` removes. ``run_id`` is unique per writer, so reruns and
Slurm array workers never overwrite each other's parts.

A part that cannot be read all the same (a disk that lost its end, a file
truncated or emptied by hand) is moved aside by :func:`read_done` to
``part-....parquet.corrupt-<UTC time>`` (kept, never deleted), with one line on
stderr; its rows count as not done, so the run redoes them.

A row holds OUTPUT_SCHEMA's columns, then the input columns it carries (``output.keep_columns``;
their names and Arrow types: :mod:`spin_batch.io.columns`). A part written before a column was
added to OUTPUT_SCHEMA reads with that column null.

Each input row (``source``) has one row in the outputs. A rerun with
``--retry-errors`` writes a new row for a source whose row was an error; the
latest row of a source (by run id, then part number) is the one that counts:
:func:`read_outputs` keeps only it, and :func:`read_done` (``tidy=True``) and
:func:`drop_superseded` rewrite the older parts without the rows a later one
replaced, so the files themselves hold each source once again.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..records import Completion
from . import columns

if TYPE_CHECKING:
    import polars

__all__ = [
    "OUTPUT_SCHEMA",
    "OutputError",
    "OutputWriter",
    "StatsWriter",
    "cleanup_temp",
    "drop_superseded",
    "completion_row",
    "error_row",
    "read_output_table",
    "make_run_id",
    "normalize_row",
    "read_done",
    "read_outputs",
    "read_stats",
    "write_json_atomic",
]

OUTPUTS_DIR = "outputs"
STATS_DIR = "stats"
_TEMP_SUFFIX = ".tmp"

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
    ]
)

_INT_COLUMNS = frozenset(f.name for f in OUTPUT_SCHEMA if pa.types.is_int32(f.type))
_FLOAT_COLUMNS = frozenset(f.name for f in OUTPUT_SCHEMA if pa.types.is_float64(f.type))
_STATUSES = frozenset({"ok", "error"})
_FINISH_REASONS = frozenset({None, "stop", "length", "error"})
_ENDPOINTS = frozenset({None, "chat", "completion"})
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_WORKER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*$")


class OutputError(RuntimeError):
    """An output file cannot be read or a row does not fit the output schema."""


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def make_run_id() -> str:
    """A unique, time-sortable id for one writer instance, e.g. ``20250101T120000123456_3fa9c2``."""
    now = datetime.now(timezone.utc)
    return f"{now:%Y%m%dT%H%M%S%f}_{secrets.token_hex(3)}"


def _check_worker(worker: str) -> str:
    if not isinstance(worker, str) or not _WORKER_RE.match(worker):
        raise ValueError(f"worker must be letters, digits, '_' or '.', got {worker!r}")
    return worker


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _WORKER_RE.match(run_id):
        raise ValueError(f"run_id must be letters, digits, '_' or '.', got {run_id!r}")
    return run_id


def _fsync_dir(directory: Path) -> None:
    """Best-effort fsync of a directory so a rename survives a crash."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(final: Path, write: Callable[[Any], None]) -> None:
    """Write ``final`` via a hidden temp file in the same directory, fsync and rename."""
    temp = final.with_name(f".{final.name}.{secrets.token_hex(4)}{_TEMP_SUFFIX}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def _write_parquet_atomic(final: Path, table: pa.Table) -> None:
    _write_atomic(final, lambda handle: pq.write_table(table, handle))


def _part_files(directory: Path, prefix: str) -> list[Path]:
    """Complete part files (``{prefix}-*.parquet``), sorted by name; temp files never match."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{prefix}-*.parquet") if p.is_file())


def _read_table(path: Path, columns: list[str] | None = None) -> pa.Table:
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(f"{path}: cannot read output part: {exc}") from exc


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _part_order(path: Path) -> tuple[str, str, str]:
    """Order of the parts in time: ``part-{worker}-{run_id}-{seq}`` sorts by run id (which starts
    with its UTC start time), then part number, then worker."""
    pieces = path.name.removesuffix(".parquet").split("-")
    if len(pieces) == 4:
        return pieces[2], pieces[3], pieces[1]
    return "", path.name, ""


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _move_aside(path: Path, why: str, warn: Callable[[str], None]) -> None:
    """Rename an unreadable part to ``<name>.corrupt-<UTC time>`` (kept for a post-mortem) and say so."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    dest = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    try:
        os.rename(path, dest)
    except FileNotFoundError:
        return  # another worker moved it first
    except OSError as exc:
        raise OutputError(f"{path}: cannot be read ({why}) nor moved aside ({exc.strerror or exc}); "
                          "move or delete it by hand, then rerun") from None
    _fsync_dir(path.parent)
    warn(f"spin-batch: {path} cannot be read ({why}); moved aside to {dest.name}; its rows will be redone")


# --------------------------------------------------------------------------
# Output rows
# --------------------------------------------------------------------------


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
    for name in ("id", "text", "error", "model"):
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
    }


def completion_row(c: Completion, *, model: str | None = None, prefix: str = "input_",
                   created: int | None = None) -> dict[str, Any]:
    """The output row of one Completion: OUTPUT_SCHEMA's columns, then the input columns the
    request carries (``Request.keep``, as output.keep_columns picked them; one named like an output
    column gets ``prefix``, see :mod:`spin_batch.io.columns`).

    ``endpoint`` is the request's OpenAI endpoint, else "chat" for a row with messages and
    "completion" for a prompt; ``model`` the request's own, else ``model`` (the job's target);
    ``created`` now, in Unix seconds, unless given.
    """
    req = c.request
    row = _answer(c) if c.error is None else error_row(req.source, req.id, c.error, c.prompt_tokens)
    row["endpoint"] = req.endpoint or ("chat" if req.messages is not None else "completion")
    row["model"] = req.model or model
    row["created"] = int(time.time()) if created is None else created
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
    }


def _rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Build a part from normalized rows: OUTPUT_SCHEMA's columns, then the kept input columns (the
    union of the rows' other keys, first seen first; a row without one is null there)."""
    table = pa.table({name: [row[name] for row in rows] for name in OUTPUT_SCHEMA.names}, schema=OUTPUT_SCHEMA)
    kept = dict.fromkeys(key for row in rows for key in row if key not in table.column_names)
    for name in kept:
        table = table.append_column(*columns.part_column(name, [row.get(name) for row in rows]))
    return table


class OutputWriter:
    """Buffers output rows and writes them as atomic Parquet parts under ``out_dir/outputs``.

    A part is written when ``rows_per_part`` rows are buffered or, on the next
    :meth:`add`/:meth:`maybe_flush`, when ``flush_interval_s`` seconds have
    passed since the last flush. Use as a context manager or call :meth:`close`.
    ``run_id`` defaults to a fresh :func:`make_run_id`; reusing one run_id for
    two live writers with the same worker name would make their parts collide.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        worker: str = "w0000",
        rows_per_part: int = 256,
        flush_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        run_id: str | None = None,
    ) -> None:
        if isinstance(rows_per_part, bool) or not isinstance(rows_per_part, int) or rows_per_part < 1:
            raise ValueError(f"rows_per_part must be an integer >= 1, got {rows_per_part!r}")
        if not isinstance(flush_interval_s, (int, float)) or math.isnan(flush_interval_s):
            raise ValueError(f"flush_interval_s must be a number, got {flush_interval_s!r}")
        self.worker = _check_worker(worker)
        self.run_id = _check_run_id(run_id) if run_id is not None else make_run_id()
        self.directory = Path(out_dir) / OUTPUTS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rows_per_part = rows_per_part
        self.flush_interval_s = float(flush_interval_s)
        self._clock = clock
        self._last_flush = clock()
        self._buffer: list[dict[str, Any]] = []
        self._seq = 0
        self._rows_written = 0
        self._parts: list[Path] = []
        self._closed = False

    @property
    def rows_written(self) -> int:
        """Rows already written to complete part files (buffered rows not included)."""
        return self._rows_written

    @property
    def rows_buffered(self) -> int:
        """Rows added but not yet written."""
        return len(self._buffer)

    @property
    def parts(self) -> list[Path]:
        """Paths of the parts written by this writer, in order."""
        return list(self._parts)

    def add(self, row: Mapping[str, Any]) -> None:
        """Buffer one output row; may write a part (see class docstring).

        Raises:
            OutputError: the row does not fit OUTPUT_SCHEMA.
            RuntimeError: the writer is closed.
        """
        if self._closed:
            raise RuntimeError("OutputWriter is closed")
        self._buffer.append(normalize_row(row))
        if len(self._buffer) >= self.rows_per_part:
            self.flush()
        else:
            self.maybe_flush()

    def maybe_flush(self) -> bool:
        """Flush if ``flush_interval_s`` has passed since the last flush; returns whether it did."""
        if self._buffer and self._clock() - self._last_flush >= self.flush_interval_s:
            self.flush()
            return True
        return False

    def _next_part_path(self) -> Path:
        name = f"part-{self.worker}-{self.run_id}-{self._seq:05d}.parquet"
        self._seq += 1
        return self.directory / name

    def flush(self) -> None:
        """Write all buffered rows as one part (nothing if the buffer is empty)."""
        self._last_flush = self._clock()
        if not self._buffer:
            return
        path = self._next_part_path()
        _write_parquet_atomic(path, _rows_to_table(self._buffer))
        self._rows_written += len(self._buffer)
        self._parts.append(path)
        self._buffer = []

    def close(self) -> None:
        """Flush remaining rows; later calls do nothing."""
        if self._closed:
            return
        self.flush()
        self._closed = True

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Scan:
    """Every readable output part, oldest first, with its ``source``, ``id`` and ``status`` columns."""

    def __init__(self, out_dir: str | Path, warn: Callable[[str], None]) -> None:
        self.parts: list[tuple[Path, pa.Table]] = []
        for path in sorted(_part_files(Path(out_dir) / OUTPUTS_DIR, "part"), key=_part_order):
            try:
                table = pq.read_table(path, columns=["source", "id", "status"])
            except FileNotFoundError:
                continue  # moved aside or rewritten away by another worker meanwhile
            except (OSError, pa.ArrowException) as exc:
                _move_aside(path, _short(exc), warn)
                continue
            self.parts.append((path, table))

    def latest(self) -> tuple[dict[str, tuple[str | None, bool]], dict[int, list[int]]]:
        """``{source: (id, ok)}`` of each source's latest row, and ``{part index: [row indices]}`` of
        the rows a later row of the same source replaced."""
        latest: dict[str, tuple[int, int, str | None, bool]] = {}
        superseded: dict[int, list[int]] = {}
        for k, (_, table) in enumerate(self.parts):
            columns = (table.column(c).to_pylist() for c in ("source", "id", "status"))
            for row, (source, row_id, status) in enumerate(zip(*columns)):
                before = latest.get(source)
                if before is not None:
                    superseded.setdefault(before[0], []).append(before[1])
                latest[source] = (k, row, row_id, status == "ok")
        return {s: (i, ok) for s, (_, _, i, ok) in latest.items()}, superseded


def _drop_rows(scan: _Scan, superseded: dict[int, list[int]], warn: Callable[[str], None]) -> int:
    """Rewrite each part that holds superseded rows without them (atomically; a part left with no
    rows is deleted). Returns how many rows were dropped."""
    dropped = 0
    for k, rows in superseded.items():
        path = scan.parts[k][0]
        try:
            table = pq.read_table(path)
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowException) as exc:
            _move_aside(path, _short(exc), warn)
            continue
        drop = set(rows)
        keep = pa.array([i not in drop for i in range(table.num_rows)])
        kept = table.filter(keep)
        try:
            if kept.num_rows:
                _write_parquet_atomic(path, kept)
            else:
                path.unlink(missing_ok=True)
                _fsync_dir(path.parent)
        except OSError as exc:  # a full disk, or another worker's cleanup took the temp file: try next run
            warn(f"spin-batch: warning: cannot rewrite {path} without the rows later ones replaced "
                 f"({exc.strerror or exc}); left as it is, readers take each source's latest row")
            continue
        dropped += table.num_rows - kept.num_rows
    return dropped


def drop_superseded(out_dir: str | Path, *, warn: Callable[[str], None] = _warn) -> int:
    """Rewrite the output parts so that each source keeps only its latest row (see the module
    docstring); returns how many older rows were dropped. Safe beside running workers: only rows
    that a complete, later part replaces are ever dropped."""
    scan = _Scan(out_dir, warn)
    return _drop_rows(scan, scan.latest()[1], warn)


def read_done(out_dir: str | Path, *, retry_errors: bool = False, tidy: bool = False,
              warn: Callable[[str], None] = _warn) -> tuple[set[str], set[str]]:
    """``(done_sources, done_ids)`` over all complete output parts.

    Reads only the ``source``, ``id`` and ``status`` columns; temp files are ignored. A part that
    cannot be read is moved aside (see the module docstring) and its rows are not done.
    ``done_ids`` holds the non-null ids of the done rows. A source is done when it has a row, or
    with ``retry_errors`` when its latest row is ok (so a rerun redoes the error rows). With
    ``tidy`` the parts are first rewritten without rows a later row replaced (:func:`drop_superseded`).
    """
    scan = _Scan(out_dir, warn)
    latest, superseded = scan.latest()
    if tidy and superseded and _drop_rows(scan, superseded, warn):
        scan = _Scan(out_dir, warn)
        latest, _ = scan.latest()
    done = {s: i for s, (i, ok) in latest.items() if ok or not retry_errors}
    return set(done), {i for i in done.values() if i is not None}


def _conform(table: pa.Table) -> pa.Table:
    """A part's table with OUTPUT_SCHEMA's columns first, cast to their types (a nullable column the
    part predates is null), then its kept input columns as they are."""
    own = []
    for f in OUTPUT_SCHEMA:
        if f.name in table.column_names:
            own.append(table.column(f.name).cast(f.type))
        elif f.nullable:
            own.append(pa.nulls(table.num_rows, f.type))
        else:
            raise ValueError(f"no {f.name!r} column")
    kept = [f for f in table.schema if f.name not in OUTPUT_SCHEMA.names]
    return pa.Table.from_arrays(own + [table.column(f.name) for f in kept],
                                schema=pa.schema(list(OUTPUT_SCHEMA) + kept))


def read_output_table(out_dir: str | Path, *, warn: Callable[[str], None] = _warn) -> pa.Table:
    """All complete output parts merged, each source's latest row only, as an Arrow table:
    OUTPUT_SCHEMA's columns, then every kept input column any part has (see
    :mod:`spin_batch.io.columns` for how their types merge); the empty schema if none. A part
    that cannot be read is left out, with a line through ``warn``."""
    tables = []
    for path in sorted(_part_files(Path(out_dir) / OUTPUTS_DIR, "part"), key=_part_order):
        try:
            tables.append(_conform(pq.read_table(path)))
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowException, ValueError) as exc:
            warn(f"spin-batch: {path} cannot be read ({_short(exc)}); left out (a rerun moves it aside and "
                 "redoes its rows)")
    if not tables:
        return OUTPUT_SCHEMA.empty_table()
    table = columns.merge_parts(tables, OUTPUT_SCHEMA.names)
    sources = table.column("source").to_pylist()
    latest = {source: i for i, source in enumerate(sources)}
    if len(latest) < len(sources):  # a retried row and the row it replaced
        table = table.take(pa.array(sorted(latest.values()), type=pa.int64()))
    return table


def read_outputs(out_dir: str | Path, *, warn: Callable[[str], None] = _warn) -> polars.DataFrame:
    """:func:`read_output_table` as a polars DataFrame."""
    import polars as pl

    return pl.from_arrow(read_output_table(out_dir, warn=warn))


def cleanup_temp(out_dir: str | Path, *, worker: str | None = None) -> int:
    """Remove temporary files left by a killed run; returns how many were removed.

    Looks in ``outputs/``, ``stats/`` and ``out_dir`` itself. With ``worker``
    set, only that worker's part/stats temp files are removed, which is safe
    while other Slurm workers are still writing to the same directory.
    """
    root = Path(out_dir)
    removed = 0
    for directory in (root / OUTPUTS_DIR, root / STATS_DIR, root):
        if not directory.is_dir():
            continue
        for path in directory.glob(f".*{_TEMP_SUFFIX}"):
            if worker is not None and not _temp_of_worker(path.name, worker):
                continue
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _temp_of_worker(name: str, worker: str) -> bool:
    return name.startswith((f".part-{worker}-", f".stats-{worker}-"))


# --------------------------------------------------------------------------
# Stats
# --------------------------------------------------------------------------


def _records_to_table(records: list[Mapping[str, Any]]) -> pa.Table:
    """Table over the union of the records' keys (first-seen order); absent keys are null."""
    names = list(dict.fromkeys(key for record in records for key in record))
    columns = {}
    for name in names:
        values = [record.get(name) for record in records]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError) as exc:
            raise OutputError(f"stats key {name!r} has values of incompatible types: {exc}") from exc
    return pa.table(columns)


class StatsWriter:
    """Buffers per-interval stats records and writes them as atomic parts under ``out_dir/stats``.

    Records are flat dicts of scalars; keys may differ between records (a part
    gets the union of its records' keys, with nulls where a record lacks one).
    Pass the OutputWriter's ``run_id`` to tie stats and outputs of one run together.
    """

    def __init__(self, out_dir: str | Path, *, worker: str = "w0000", run_id: str | None = None) -> None:
        self.worker = _check_worker(worker)
        self.run_id = _check_run_id(run_id) if run_id is not None else make_run_id()
        self.directory = Path(out_dir) / STATS_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        self._records: list[dict[str, Any]] = []
        self._seq = 0
        self._closed = False

    def add(self, record: Mapping[str, Any]) -> None:
        """Buffer one record (a flat mapping of column name to scalar)."""
        if self._closed:
            raise RuntimeError("StatsWriter is closed")
        if not isinstance(record, Mapping) or not all(isinstance(k, str) for k in record):
            raise OutputError(f"stats record must be a dict with string keys, got {record!r}")
        self._records.append(dict(record))

    def flush(self) -> None:
        """Write buffered records as a new part (nothing if none are buffered)."""
        if not self._records:
            return
        table = _records_to_table(self._records)
        path = self.directory / f"stats-{self.worker}-{self.run_id}-{self._seq:05d}.parquet"
        _write_parquet_atomic(path, table)
        self._seq += 1
        self._records = []

    def close(self) -> None:
        """Flush remaining records; later calls do nothing."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> StatsWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_stats(out_dir: str | Path, *, warn: Callable[[str], None] = _warn,
               parts: bool = False) -> polars.DataFrame:
    """All stats parts concatenated diagonally (missing columns are null; empty frame if none). A part
    that cannot be read is left out, with a line through ``warn`` (nothing reruns a stats interval).
    With ``parts``, each row also gets its part's ``worker`` and ``run_id`` (from the file name)."""
    import polars as pl

    frames = []
    for path in _part_files(Path(out_dir) / STATS_DIR, "stats"):
        try:
            frame = pl.from_arrow(pq.read_table(path))
            if parts:
                pieces = path.name.removesuffix(".parquet").split("-")
                worker, run_id = (pieces[1], pieces[2]) if len(pieces) == 4 else ("", "")
                frame = frame.with_columns(worker=pl.lit(worker), run_id=pl.lit(run_id))
            frames.append(frame)
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowException) as exc:
            warn(f"spin-batch: {path} cannot be read ({_short(exc)}); left out")
    if not frames:
        return pl.DataFrame()
    return pl.concat(frames, how="diagonal_relaxed")


# --------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    """Serialize paths and sets, which json cannot handle by itself."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"object of type {type(value).__name__} is not JSON serializable")


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON (indent 2, sorted keys) via a temp file and os.replace."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(final, lambda handle: handle.write(text.encode("utf-8")))
