"""Input shards: finding the files, their formats, and which rows each worker reads.

Input shards are JSONL files (one JSON object per line) or Parquet files. :func:`list_shards`
resolves files, glob patterns and directories into a sorted list of absolute paths; a file's
format comes from its suffix, and ``input.format`` may restrict it.

Each row has a ``source``, ``"<absolute shard path>#<row index>"``, saying where it was read (a
resume finds a row's output by its id and content instead, io/identity.py, so a moved or renamed
shard keeps its rows done). A JSONL row's index is its 0-based line
number: blank lines (empty or only whitespace) give no row but still count in the line numbers,
so a row's source names its real line. A JSONL line longer than ``max_line_bytes``
(``input.max_line_bytes``) is never held whole: it is skipped in chunks (the reader makes it an
error row).

A worker's part of the input (:func:`assign`) is whole files, or every ``num_shards``-th row
when the files are fewer than the workers or too uneven; the index and count default to the
Slurm job array's (:func:`resolve_workers`, :func:`shard_defaults_from_env`). :func:`count_rows` and
:func:`worker_sources` find a shard's rows and a worker's sources without parsing a row.
"""

from __future__ import annotations

import glob
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "DEFAULT_MAX_LINE_BYTES",
    "FORMATS",
    "InputError",
    "Wanted",
    "assign",
    "count_rows",
    "dealt",
    "file_format",
    "jsonl_lines",
    "list_shards",
    "open_binary",
    "open_parquet_file",
    "resolve_workers",
    "row_lines",
    "shard_defaults_from_env",
    "worker_sources",
]


FORMATS = ("auto", "jsonl", "parquet", "openai")

# Suffixes accepted for explicitly named files and glob matches.
_SUFFIX_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# Suffixes picked up when a directory is given (".json" is left out because
# directories often hold JSON metadata files next to the data).
_DIR_SUFFIXES = {".jsonl", ".ndjson", ".parquet"}

#: Longest JSONL line read (bytes, newline excluded) unless the job says otherwise (input.max_line_bytes).
DEFAULT_MAX_LINE_BYTES = 64 * 1024 * 1024
# The rest of an over-long line is skipped in chunks of this size.
_SKIP_CHUNK = 1 << 20


class InputError(ValueError):
    """A file-level input problem (no files matched, unreadable file, missing column, ...)."""


# --------------------------------------------------------------------------
# Shard discovery
# --------------------------------------------------------------------------


def file_format(path: Path) -> str | None:
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
    kind = file_format(path)
    return kind is not None and _fits(kind, fmt)


def _describe(fmt: str) -> str:
    return "input" if fmt == "auto" else fmt


def _explicit_file(entry: str, path: Path, fmt: str) -> list[Path]:
    """Validate a file named explicitly (not through a glob or directory)."""
    kind = file_format(path)
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
    parquet = sorted(p for p in found if file_format(p) == "parquet")
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
    if count == 1 and task_id != 0:
        raise InputError(
            f"SLURM_ARRAY_TASK_ID={task_id} in an array of one task (as `sbatch --array={task_id}` makes to redo "
            "one task): the array does not say how many workers share the input. Pass --num-shards N (the "
            "array's full size; the task id is then the shard index), as examples/slurm/spin_batch_array.sbatch "
            "does"
        )
    offset = task_id - task_min
    index = offset // step
    if offset < 0 or offset % step or index >= count:
        raise InputError(
            f"SLURM_ARRAY_TASK_ID={task_id} does not fit an array of {count} tasks starting at "
            f"{task_min} with step {step}; use a contiguous --array range or pass the shard "
            "index and count explicitly"
        )
    return index, count


def resolve_workers(shard_index: int | None, num_shards: int | None,
                    env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(shard_index, num_shards)`` from the flags where given, else from the environment.

    Neither given: :func:`shard_defaults_from_env`. Only the count given: inside a Slurm array the
    index is ``SLURM_ARRAY_TASK_ID`` itself (tasks numbered from 0, so that ``sbatch --array=2``
    redoes worker 2 of N), outside one 0. Only the index given: the count from the environment.

    Raises:
        InputError: the environment does not describe a worker (see shard_defaults_from_env), or
            the task id is not below the count given.
    """
    if shard_index is not None and num_shards is not None:
        return shard_index, num_shards
    if num_shards is None:
        env_index, num_shards = shard_defaults_from_env(env)
        return (env_index if shard_index is None else shard_index), num_shards
    task_id = _env_int(env, "SLURM_ARRAY_TASK_ID")
    if task_id is None:
        return 0, num_shards
    if not 0 <= task_id < num_shards:
        raise InputError(f"SLURM_ARRAY_TASK_ID={task_id} is not a shard index of --num-shards {num_shards}: number "
                         f"the array's tasks 0 to {num_shards - 1} (sbatch --array=0-{num_shards - 1}), or pass "
                         "--shard-index too")
    return task_id, num_shards


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
        if file_format(path) == "parquet":
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
    so workers' row counts differ by at most one. Every worker decides alike.
    Files keep their order when their folder moves, so each row keeps its
    worker; a rename that reorders them may hand a row to another worker,
    which finds it done (resume reads every worker's parts).

    Raises:
        InputError: ``shard_index`` is not in ``[0, num_shards)``.
    """
    _check_shard_args(shard_index, num_shards)
    shards = list(shards)
    if _deal_files(shards, num_shards):
        return shards[shard_index::num_shards], None
    return shards, num_shards


# Called once per row, in order, when rows are dealt: whether this worker takes the row.
Wanted = Callable[[], bool]


def dealt(shard_index: int, row_modulo: int | None) -> Wanted | None:
    """The rows this worker takes when rows are dealt (None: all rows of its files)."""
    if row_modulo is None:
        return None
    rows = itertools.count()
    return lambda: next(rows) % row_modulo == shard_index


# --------------------------------------------------------------------------
# A shard's rows, unparsed
# --------------------------------------------------------------------------


def open_binary(path: Path):
    """A shard opened for reading bytes; InputError when it cannot be opened."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open: {exc.strerror or exc}") from exc


def jsonl_lines(path: Path, handle, max_line_bytes: int) -> Iterator[tuple[int, bytes | int]]:
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


def row_lines(path: Path, handle, max_line_bytes: int) -> Iterator[tuple[int, bytes | int]]:
    """The lines of a JSONL shard that are rows: the non-blank ones, and those over max_line_bytes."""
    for lineno, raw in jsonl_lines(path, handle, max_line_bytes):
        if isinstance(raw, int) or raw.strip():
            yield lineno, raw


def open_parquet_file(path: Path) -> pq.ParquetFile:
    """A Parquet shard opened (its metadata read); InputError when it cannot be read."""
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: cannot read Parquet file: {exc}") from exc


def _row_indices(path: Path, max_line_bytes: int) -> Iterator[int]:
    """The row indices (the part of a source after '#') of a shard's rows, in order, unparsed."""
    if file_format(path) == "parquet":
        yield from range(open_parquet_file(path).metadata.num_rows)
        return
    with open_binary(path) as handle:
        for lineno, _ in row_lines(path, handle, max_line_bytes):
            yield lineno


def count_rows(path: str | os.PathLike, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> int:
    """How many rows a shard gives: a Parquet file's from its metadata, a JSONL file's lines read
    but not parsed. Raises InputError for a file that cannot be read."""
    path = Path(path).resolve()
    if file_format(path) == "parquet":
        return open_parquet_file(path).metadata.num_rows
    return sum(1 for _ in _row_indices(path, max_line_bytes))


def worker_sources(shards: list[Path], shard_index: int, num_shards: int,
                   max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Iterator[str]:
    """The sources of this worker's rows, in order: those :func:`spin_batch.io.reader.iter_requests` yields it (before
    resume skipping), found without parsing a row. Raises InputError for a file that cannot be read."""
    files, row_modulo = assign(list(shards), shard_index, num_shards)
    wanted = dealt(shard_index, row_modulo)
    for p in files:
        path = Path(p).resolve()
        for i in _row_indices(path, max_line_bytes):
            if wanted is None or wanted():
                yield f"{path}#{i}"
