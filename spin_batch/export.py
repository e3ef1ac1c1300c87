"""`spin-batch export OUTPUT_DIR --to FILE`: every worker's output parts as one file, in input order.

The rows are those :func:`spin_batch.io.writer.read_outputs` gives (each source's latest row: a retried
row replaces the error row it redid), ordered by input position. A row's ``source`` is
``"<shard path>#<row index>"``; the job reads its shards in sorted path order (``list_shards``), so rows
are ordered by shard path, then by row index as a number. The file is written under a temporary name
in the same folder and renamed into place, so a reader never sees half a file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .io.writer import OUTPUT_SCHEMA, OUTPUTS_DIR, _write_atomic, read_outputs

FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}


class ExportError(ValueError):
    """The output folder has nothing to export, or the destination cannot be written."""


def _position(source: str) -> tuple[str, int, str]:
    """Sort key of a source ``path#index``: the path, then the index as a number (a source that does
    not end in ``#<int>``, e.g. from a Ray dataset with its own prefix, sorts by its text)."""
    path, sep, index = source.rpartition("#")
    if sep and index.isdigit():
        return path, int(index), ""
    return source, -1, source


def ordered_table(out_dir: str | Path, *, errors: bool = True) -> pa.Table:
    """The job's output rows (latest row per source) in input order; without ``errors``, the ok rows only."""
    out = Path(out_dir)
    if not out.is_dir():
        raise ExportError(f"{out}: no such output folder")
    if not any((out / OUTPUTS_DIR).glob("part-*.parquet")):
        raise ExportError(f"{out}: no output parts (nothing under {out / OUTPUTS_DIR}/part-*.parquet); "
                          "is this a job's output.dir, and has a run written rows yet?")
    frame = read_outputs(out)
    table = frame.to_arrow().cast(OUTPUT_SCHEMA)
    if not errors:
        table = table.filter(pc.not_equal(table.column("status"), "error"))
    order = sorted(range(table.num_rows), key=lambda i, s=table.column("source").to_pylist(): _position(s[i]))
    return table.take(pa.array(order, type=pa.int64()))


def _jsonl_bytes(table: pa.Table) -> bytes:
    lines = []
    for batch in table.to_batches(max_chunksize=4096):
        for row in batch.to_pylist():
            row["drafter_pulls"] = dict(row["drafter_pulls"] or [])
            lines.append(json.dumps(row, ensure_ascii=False))
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""


def export(out_dir: str | Path, dest: str | Path, *, errors: bool = True) -> int:
    """Write the job's rows in input order to ``dest`` (.parquet, or .jsonl/.ndjson: one JSON object a
    line); returns how many rows were written."""
    dest = Path(dest)
    fmt = FORMATS.get(dest.suffix.lower())
    if fmt is None:
        raise ExportError(f"{dest}: unknown extension {dest.suffix or '(none)'!r}; use .parquet or .jsonl")
    if dest.is_dir():
        raise ExportError(f"{dest} is a directory")
    table = ordered_table(out_dir, errors=errors)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "parquet":
            _write_atomic(dest, lambda handle: pq.write_table(table, handle))
        else:
            data = _jsonl_bytes(table)
            _write_atomic(dest, lambda handle: handle.write(data))
    except OSError as e:
        raise ExportError(f"cannot write {dest}: {e.strerror or e}") from None
    return table.num_rows
