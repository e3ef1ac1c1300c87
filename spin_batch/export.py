"""`spin-batch export OUTPUT_DIR --to FILE`: every worker's output parts as one file, in input order.

The rows are those :func:`spin_batch.io.outputs.read_output_table` gives (each key's latest row: a
retried or redone row replaces the row it redid, so one row per id, or n rows with ``index`` 0 .. n - 1 for
a row decoded as n samples; the input columns the rows carry beside spin-batch's), ordered by input
position, then index; a part that cannot be read whole fails the export,
naming it. A row's ``source`` is ``"<shard path>#<row index>"``; the job reads its
shards in sorted path order (``list_shards``), so rows are ordered by shard path, then by row index as
a number. The file is written under a temporary name in the same folder and renamed into place, so a
reader never sees half a file.

Formats: ``parquet`` (the rows), ``jsonl`` (one row a line), ``openai`` (one OpenAI batch response line
a row: :mod:`spin_batch.io.openai_batch`). :func:`write_results` writes the files ``output.format``
asks for at the end of a run: ``results.jsonl`` (openai, both) and ``results.parquet`` (both).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .io.openai_batch import response_lines
from .io.outputs import read_output_table
from .io.schema import OutputError
from .io.writer import OUTPUTS_DIR, write_atomic

EXTENSIONS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
FORMATS = ("auto", "parquet", "jsonl", "openai")  # auto: by the destination's extension
RESULTS_JSONL = "results.jsonl"
RESULTS_PARQUET = "results.parquet"
UNKNOWN_MODEL = "spin-batch"  # an OpenAI line's model where neither the row nor the folder names one


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
    """The job's output rows (latest row per key) in input order; without ``errors``, the ok rows only.
    ExportError when a part cannot be read whole."""
    out = Path(out_dir)
    if not out.is_dir():
        raise ExportError(f"{out}: no such output folder")
    if not any((out / OUTPUTS_DIR).glob("part-*.parquet")):
        raise ExportError(f"{out}: no output parts (nothing under {out / OUTPUTS_DIR}/part-*.parquet); "
                          "is this a job's output.dir, and has a run written rows yet?")
    try:
        table = read_output_table(out)
    except OutputError as e:  # a part that does not read whole: named, never left out
        raise ExportError(str(e)) from None
    return _in_order(table, errors)


def _in_order(table: pa.Table, errors: bool = True) -> pa.Table:
    if not errors:
        table = table.filter(pc.not_equal(table.column("status"), "error"))
    sources, indices = table.column("source").to_pylist(), table.column("index").to_pylist()
    order = sorted(range(table.num_rows), key=lambda i: (_position(sources[i]), indices[i] or 0))
    return table.take(pa.array(order, type=pa.int64()))


def _lines_bytes(lines) -> bytes:
    lines = list(lines)
    return ("\n".join(lines) + "\n").encode("utf-8") if lines else b""


def _jsonl_lines(table: pa.Table):
    for batch in table.to_batches(max_chunksize=4096):
        for row in batch.to_pylist():
            row["drafter_pulls"] = dict(row["drafter_pulls"] or [])
            yield json.dumps(row, ensure_ascii=False, default=str)  # a kept date or decimal as text


def job_model(out_dir: str | Path) -> str:
    """The target model of the job that wrote ``out_dir``, as its summary.json records it (the model an
    OpenAI line names where its row has none: rows written before rows carried it)."""
    for path in sorted(Path(out_dir).glob("summary*.json")):
        try:
            return str(json.loads(path.read_text())["job"]["target"]["model"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return UNKNOWN_MODEL


def _format(dest: Path, fmt: str) -> str:
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    if dest.suffix.lower() not in EXTENSIONS:
        raise ExportError(f"{dest}: unknown extension {dest.suffix or '(none)'!r}; use .parquet or .jsonl "
                          "(or name the format)")
    return EXTENSIONS[dest.suffix.lower()]


def _write(table: pa.Table, dest: Path, fmt: str, model: str) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if fmt == "parquet":
            write_atomic(dest, lambda handle: pq.write_table(table, handle))
            return
        data = _lines_bytes(response_lines(table, model) if fmt == "openai" else _jsonl_lines(table))
        write_atomic(dest, lambda handle: handle.write(data))
    except OSError as e:
        raise ExportError(f"cannot write {dest}: {e.strerror or e}") from None


def export(out_dir: str | Path, dest: str | Path, *, errors: bool = True, fmt: str = "auto",
           model: str | None = None) -> int:
    """Write the job's rows in input order to ``dest``; returns how many rows were written.

    ``fmt``: parquet, jsonl (one JSON object a line), openai (one OpenAI batch response line a row)
    or auto (by ``dest``'s extension: .parquet, .jsonl or .ndjson). ``model``: the model an OpenAI
    line names where its row has none (default: the job's target, from the folder's summary.json).
    """
    dest = Path(dest)
    fmt = _format(dest, fmt)
    if dest.is_dir():
        raise ExportError(f"{dest} is a directory")
    table = ordered_table(out_dir, errors=errors)
    _write(table, dest, fmt, model or job_model(out_dir))
    return table.num_rows


def write_results(out_dir: str | Path, output_format: str, model: str) -> list[Path]:
    """The merged files ``output.format`` asks for (see the module doc), of every worker's rows present
    now (empty files where there are none); returns their paths (none for parquet, whose parts are
    the output)."""
    wanted = {"parquet": [], "openai": [(RESULTS_JSONL, "openai")],
              "both": [(RESULTS_JSONL, "openai"), (RESULTS_PARQUET, "parquet")]}[output_format]
    if not wanted:
        return []
    table = _in_order(read_output_table(out_dir))
    paths = []
    for name, fmt in wanted:
        _write(table, Path(out_dir) / name, fmt, model)
        paths.append(Path(out_dir) / name)
    return paths
