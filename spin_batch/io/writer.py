"""Output: completions and stats written as atomic Parquet parts.

Layout under the output directory::

    outputs/part-{worker}-{run_id}-{seq:05d}.parquet   completions (OUTPUT_SCHEMA)
    stats/stats-{worker}-{run_id}-{seq:05d}.parquet    per-interval stats records

Each part is written under a hidden temporary name in the same directory,
fsynced and renamed with :func:`os.replace`, so a file with a final name is
always complete. A killed run leaves at most some temporary files, which
:func:`spin_batch.io.outputs.cleanup_temp` removes. ``run_id`` is unique per writer, so reruns and
Slurm array workers never overwrite each other's parts.

The rows and their columns: :mod:`spin_batch.io.schema`. Reading a folder back (resume, retries,
merged outputs, stats): :mod:`spin_batch.io.outputs`.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from . import columns
from .schema import OUTPUT_SCHEMA, OutputError, normalize_row

__all__ = [
    "OUTPUTS_DIR",
    "STATS_DIR",
    "TEMP_SUFFIX",
    "OutputWriter",
    "StatsWriter",
    "fsync_dir",
    "make_run_id",
    "write_atomic",
    "write_json_atomic",
    "write_parquet_atomic",
]

OUTPUTS_DIR = "outputs"
STATS_DIR = "stats"
TEMP_SUFFIX = ".tmp"
_WORKER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*$")


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


def fsync_dir(directory: Path) -> None:
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


def write_atomic(final: Path, write: Callable[[Any], None]) -> None:
    """Write ``final`` via a hidden temp file in the same directory, fsync and rename."""
    temp = final.with_name(f".{final.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)


def write_parquet_atomic(final: Path, table: pa.Table) -> None:
    """Write a Parquet file atomically, with page checksums (readers verify them: a flipped byte is
    found, not read as other data)."""
    write_atomic(final, lambda handle: pq.write_table(table, handle, write_page_checksum=True))


# --------------------------------------------------------------------------
# Output parts
# --------------------------------------------------------------------------


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
        self.add_many([row])

    def add_many(self, rows: list[Mapping[str, Any]]) -> None:
        """Buffer rows that go into one part together (a request's n samples), then maybe write a part."""
        if self._closed:
            raise RuntimeError("OutputWriter is closed")
        self._buffer.extend(normalize_row(row) for row in rows)
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
        write_parquet_atomic(path, _rows_to_table(self._buffer))
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
        write_parquet_atomic(path, table)
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
    write_atomic(final, lambda handle: handle.write(text.encode("utf-8")))
