"""Reading an output folder back, finished or partial: what is done, the merged rows, the stats.

A part is read whole (every column, its page checksums where it has them, its strings' UTF-8).
One that cannot be read so (a disk that lost its end, a file truncated, emptied or garbled by hand)
is moved aside by :func:`read_written` (which a run calls) to ``part-....parquet.corrupt-<UTC time>``
(kept, never deleted), with one line on stderr; its rows count as not done, so the run redoes them.
:func:`read_output_table` (export, report) names such a part and fails rather than leave its rows out.

Each input row has one row in the outputs, found by its key (io/identity.py: its id, and a digest
of what decides its text; ``source`` only says where it was read). A rerun with ``--retry-errors``
writes a new row for a key whose row was an error, and any rerun one for a key whose input changed
(another digest); the latest row of a key (by run id, then part number) is the one that counts:
:func:`read_outputs` keeps only it, and :func:`read_written` (``tidy=True``) and
:func:`drop_superseded` rewrite the older parts without the rows a later one replaced, so the files
themselves hold each key once again.

The folder's layout and how parts are written: :mod:`spin_batch.io.writer`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from ..records import Request
from . import columns
from .identity import Key, request_key, row_key
from .schema import OUTPUT_SCHEMA, OutputError
from .writer import OUTPUTS_DIR, STATS_DIR, TEMP_SUFFIX, fsync_dir, write_parquet_atomic

if TYPE_CHECKING:
    import polars

__all__ = [
    "Done",
    "Written",
    "cleanup_temp",
    "drop_superseded",
    "read_done",
    "read_output_table",
    "read_outputs",
    "read_stats",
    "read_written",
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


def _read_part(path: Path) -> pa.Table:
    """A part read whole and checked (OSError, ArrowException or ValueError when it fails): every
    column decodes, its pages match their checksums (parts written with them), its strings are
    UTF-8, and it has OUTPUT_SCHEMA's columns (conformed, :func:`_conform`)."""
    table = pq.read_table(path, page_checksum_verification=True)
    table.validate(full=True)
    return _conform(table)


_KEY_COLUMNS = ("id", "source", "input_digest", "input_key", "status", "error")


def _keys(table: pa.Table) -> list[Key]:
    """Each row's key (io/identity.py), from a conformed table."""
    return [row_key(*values) for values in zip(*(table.column(c).to_pylist() for c in _KEY_COLUMNS))]


def _indices(table: pa.Table) -> list[int]:
    """Each row's sample index (null, in parts older than the column: 0)."""
    return [i or 0 for i in table.column("index").to_pylist()]


def _latest(keys: list[Key], sources: list[str], digests: list[str | None], indices: list[int]) -> dict[Key, int]:
    """Each key's latest row, of rows given oldest first. A row with a digest also replaces an older
    row written before rows had one and keyed by its place there (``("src", its source)``).

    A request's samples (n > 1) are written together, sample 0 first: sample i > 0 is kept under its key
    plus i, and a later sample 0 of the key replaces the whole earlier group."""
    latest: dict[Key, int] = {}
    samples: dict[Key, list[Key]] = {}
    for i, key in enumerate(keys):
        if digests[i] is not None and key[0] != "src":
            latest.pop(("src", sources[i]), None)
        if indices[i]:
            samples.setdefault(key, []).append(key + (indices[i],))
            latest[key + (indices[i],)] = i
            continue
        for older in samples.pop(key, ()):
            latest.pop(older, None)
        latest[key] = i
    return latest


@dataclass(frozen=True)
class Written:
    """The latest output row of a key, as resume sees it."""

    id: str | None
    source: str
    digest: str | None  # None: written before rows had a digest
    ok: bool
    input_key: str | None = None

    @property
    def content(self) -> tuple[str | None, str | None, str]:
        """What finds the row for an input row: its id, digest and which copy of them it is."""
        return self.id, self.digest, self.input_key or "0"


class Done:
    """What earlier runs wrote, by row key (io/identity.py). Called with a request (its ``input_key``
    set by the reader): whether the rerun skips it, because a row with its id, digest and copy number
    is there (of a row written before rows had a digest: its key's, with the same source), ok or with
    ``retry_errors`` off. (By content rather than by key: which of two rows with one id comes first
    may change with the files' order.) :meth:`replaces`: whether the row the rerun writes for it
    replaces one made from other input.

    ``sources`` and ``ids``: the sources and ids of the rows that count as done (the progress bar's
    count; read_done)."""

    def __init__(self, latest: Mapping[Key, Written], retry_errors: bool = False) -> None:
        self.latest = latest
        self.retry_errors = retry_errors
        self.content = {w.content: w for w in latest.values() if w.digest is not None}
        counted = [w for w in latest.values() if w.ok or not retry_errors]
        self.sources = {w.source for w in counted}
        self.ids = {w.id for w in counted if w.id is not None}

    def _written(self, request: Request) -> Written | None:
        key = request_key(request)
        found = self.latest.get(key)
        if found is None and key[0] == "at":  # a row with no usable id, written before rows had a digest
            found = self.latest.get(("src", request.source))
        return found

    def __call__(self, request: Request) -> bool:
        written = self.content.get((request.id, request.digest, request.input_key or "0"))
        if written is None:
            written = self._written(request)
            if written is None or written.digest is not None or written.source != request.source:
                return False
        return written.ok or not self.retry_errors

    def replaces(self, request: Request) -> bool:
        """Whether the key's latest row was made from other input (another digest; written before rows
        had one: read from another source), so that the row written now replaces it."""
        written = self._written(request)
        if written is None:
            return False
        if written.digest is None:
            return written.source != request.source
        return written.digest != request.digest


class _Scan:
    """Every output part that reads whole, oldest first, with its rows' keys; a part that does not is
    moved aside."""

    def __init__(self, out_dir: str | Path, warn: Callable[[str], None]) -> None:
        self.parts: list[Path] = []
        self.rows: list[tuple[int, int]] = []  # (part, row in it)
        self.keys: list[Key] = []
        self.indices: list[int] = []
        self.written: list[Written] = []
        for path in sorted(_part_files(Path(out_dir) / OUTPUTS_DIR, "part"), key=_part_order):
            try:
                table = _read_part(path)
            except FileNotFoundError:
                continue  # moved aside or rewritten away by another worker meanwhile
            except (OSError, pa.ArrowException, ValueError) as exc:
                _move_aside(path, _short(exc), warn)
                continue
            self.rows += [(len(self.parts), row) for row in range(table.num_rows)]
            self.parts.append(path)
            self.keys += _keys(table)
            self.indices += _indices(table)
            columns = (table.column(c).to_pylist() for c in ("id", "source", "input_digest", "status", "input_key"))
            self.written += [Written(i, s, d, status == "ok", k) for i, s, d, status, k in zip(*columns)]

    def latest(self) -> tuple[dict[Key, Written], dict[int, list[int]]]:
        """``{key: its latest row}``, and ``{part index: [row indices]}`` of the rows a later row of the
        same key replaced."""
        latest = _latest(self.keys, [w.source for w in self.written], [w.digest for w in self.written], self.indices)
        winners = set(latest.values())
        superseded: dict[int, list[int]] = {}
        for i, (part, row) in enumerate(self.rows):
            if i not in winners:
                superseded.setdefault(part, []).append(row)
        return {key: self.written[i] for key, i in latest.items()}, superseded


def _drop_rows(scan: _Scan, superseded: dict[int, list[int]], warn: Callable[[str], None]) -> int:
    """Rewrite each part that holds superseded rows without them (atomically; a part left with no
    rows is deleted). Returns how many rows were dropped."""
    dropped = 0
    for k, rows in superseded.items():
        path = scan.parts[k]
        try:
            table = pq.read_table(path, page_checksum_verification=True)
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
                 f"({exc.strerror or exc}); left as it is, readers take each key's latest row")
            continue
        dropped += table.num_rows - kept.num_rows
    return dropped


def drop_superseded(out_dir: str | Path, *, warn: Callable[[str], None] = _warn) -> int:
    """Rewrite the output parts so that each key keeps only its latest row (see the module
    docstring); returns how many older rows were dropped. Safe beside running workers: only rows
    that a complete, later part replaces are ever dropped."""
    scan = _Scan(out_dir, warn)
    return _drop_rows(scan, scan.latest()[1], warn)


def read_written(out_dir: str | Path, *, retry_errors: bool = False, tidy: bool = False,
                 warn: Callable[[str], None] = _warn) -> Done:
    """What the complete output parts hold, as a :class:`Done` (which rows a rerun skips).

    Every part is read whole; temp files are ignored. A part that cannot be read is moved aside
    (see the module docstring) and its rows are not done. With ``retry_errors`` a row whose latest
    row is an error is not done. With ``tidy`` the parts are first rewritten without rows a later
    row replaced (:func:`drop_superseded`).
    """
    scan = _Scan(out_dir, warn)
    latest, superseded = scan.latest()
    if tidy and superseded and _drop_rows(scan, superseded, warn):
        latest, _ = _Scan(out_dir, warn).latest()
    return Done(latest, retry_errors)


def read_done(out_dir: str | Path, *, retry_errors: bool = False, tidy: bool = False,
              warn: Callable[[str], None] = _warn) -> tuple[set[str], set[str]]:
    """``(sources, ids)`` of the rows :func:`read_written` counts as done (ids: the non-null ones)."""
    done = read_written(out_dir, retry_errors=retry_errors, tidy=tidy, warn=warn)
    return done.sources, done.ids


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


def read_output_table(out_dir: str | Path) -> pa.Table:
    """All complete output parts merged, each key's latest row only, as an Arrow table:
    OUTPUT_SCHEMA's columns, then every kept input column any part has (see
    :mod:`spin_batch.io.columns` for how their types merge); the empty schema if none.

    Raises:
        OutputError: a part cannot be read whole; it is named, and nothing is left out silently
            (a run moves such a part aside and redoes its rows).
    """
    tables = []
    for path in sorted(_part_files(Path(out_dir) / OUTPUTS_DIR, "part"), key=_part_order):
        try:
            tables.append(_read_part(path))
        except FileNotFoundError:
            continue
        except (OSError, pa.ArrowException, ValueError) as exc:
            raise OutputError(f"{path} cannot be read ({_short(exc)}), so its rows would be missing; run the "
                              "job again (the same `spin-batch run` command: it moves the part aside and redoes "
                              "its rows), then read the outputs again") from None
    if not tables:
        return OUTPUT_SCHEMA.empty_table()
    table = columns.merge_parts(tables, OUTPUT_SCHEMA.names)
    latest = _latest(_keys(table), table.column("source").to_pylist(), table.column("input_digest").to_pylist(),
                     _indices(table))
    if len(latest) < table.num_rows:  # a retried or redone row and the row it replaced
        table = table.take(pa.array(sorted(latest.values()), type=pa.int64()))
    return table


def read_outputs(out_dir: str | Path) -> polars.DataFrame:
    """:func:`read_output_table` as a polars DataFrame."""
    import polars as pl

    return pl.from_arrow(read_output_table(out_dir))


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
