"""Reading an output folder back, finished or partial: what is done, the merged rows, the stats.

A part that cannot be read all the same (a disk that lost its end, a file
truncated or emptied by hand) is moved aside by :func:`read_done` to
``part-....parquet.corrupt-<UTC time>`` (kept, never deleted), with one line on
stderr; its rows count as not done, so the run redoes them.

Each input row (``source``) has one row in the outputs. A rerun with
``--retry-errors`` writes a new row for a source whose row was an error; the
latest row of a source (by run id, then part number) is the one that counts:
:func:`read_outputs` keeps only it, and :func:`read_done` (``tidy=True``) and
:func:`drop_superseded` rewrite the older parts without the rows a later one
replaced, so the files themselves hold each source once again.

The folder's layout and how parts are written: :mod:`spin_batch.io.writer`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from . import columns
from .schema import OUTPUT_SCHEMA, OutputError
from .writer import OUTPUTS_DIR, STATS_DIR, TEMP_SUFFIX, fsync_dir, write_parquet_atomic

if TYPE_CHECKING:
    import polars

__all__ = [
    "cleanup_temp",
    "drop_superseded",
    "read_done",
    "read_output_table",
    "read_outputs",
    "read_stats",
]


def _part_files(directory: Path, prefix: str) -> list[Path]:
    """Complete part files (``{prefix}-*.parquet``), sorted by name; temp files never match."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.glob(f"{prefix}-*.parquet") if p.is_file())


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
    fsync_dir(path.parent)
    warn(f"spin-batch: {path} cannot be read ({why}); moved aside to {dest.name}; its rows will be redone")


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
                write_parquet_atomic(path, kept)
            else:
                path.unlink(missing_ok=True)
                fsync_dir(path.parent)
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
        for path in directory.glob(f".*{TEMP_SUFFIX}"):
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
