"""Validate-time checks of the input, before a run or instead of one.

:func:`check_columns` checks the configured columns before a run starts (Parquet from each
shard's metadata, JSONL from the first rows of the first plain JSONL shard), so a typo in a
column name fails at once rather than making every row an error row. :func:`check_input` scans
every row and describes the input's problems: unreadable files, duplicate ids with both
places, and per kind of bad row the count and the first example (a JSONL row with its line
number).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..records import Request
from .reader import check_positive, iter_shard, open_parquet, reads_openai
from .rows import Row, Spec, column_problems
from .shards import DEFAULT_MAX_LINE_BYTES, InputError, file_format, jsonl_lines, open_binary

__all__ = ["check_columns", "check_input"]


# Report at most this many duplicate ids one by one in check_input().
_MAX_DUPLICATES_LISTED = 20


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

    def add_row(self, row: Row) -> None:
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
    if file_format(Path(path)) == "jsonl" and index.isdigit():
        return f"{source} (line {int(index) + 1})"
    return source


def _jsonl_fields(path: Path, rows: int, max_line_bytes: int) -> tuple[set[str], int]:
    """The field names of the JSON objects among a JSONL shard's first ``rows`` non-blank lines,
    and how many objects there were (lines that are no JSON object are passed over)."""
    names: set[str] = set()
    seen = 0
    with open_binary(path) as handle:
        for lineno, raw in jsonl_lines(path, handle, max_line_bytes):
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


def check_columns(shards: list[Path], spec: Spec = Spec(), *, jsonl_rows: int = 100,
                  max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
    """Check the columns before a run starts rather than at the file: every Parquet shard's from its
    metadata (no rows read; the params column and the kept columns named must be there too), and
    for JSONL, which has no schema, the fields of the first ``jsonl_rows`` rows of the first plain
    JSONL shard (a configured column that none of them has, say a typo in input.prompt_column,
    would make every row an error row). OpenAI batch shards have no columns to check (validate
    reports their bad lines). spec: how rows are read (rows.Spec). Raises InputError."""
    first_jsonl = True
    for path in shards:
        path = Path(path).resolve()
        if file_format(path) == "parquet":
            open_parquet(path, spec)
        elif first_jsonl and jsonl_rows > 0 and not reads_openai(path, spec, max_line_bytes):
            first_jsonl = False
            names, objects = _jsonl_fields(path, jsonl_rows, max_line_bytes)
            problems = column_problems(sorted(names), id_column=spec.id, prompt_column=spec.prompt,
                                       messages_column=spec.messages)
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
    spec: Spec = Spec(),
    *,
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
    empty list means the input is OK. spec: how rows are read, as for :func:`iter_requests`.

    Args:
        max_rows_scanned: stop after this many rows in total (None: scan everything).
    """
    check_positive("max_rows_scanned", max_rows_scanned, allow_none=True, minimum=0)
    if not shards:
        return ["no input files"]
    report = _InputReport()
    scanned = 0
    for path in shards:
        if max_rows_scanned is not None and scanned >= max_rows_scanned:
            break
        try:
            for row in iter_shard(path, spec, batch_rows, max_line_bytes):
                report.add_row(row)
                scanned += 1
                if max_rows_scanned is not None and scanned >= max_rows_scanned:
                    break
        except InputError as exc:
            report.problems.append(str(exc))
    return report.finish()
