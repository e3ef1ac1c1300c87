"""Input columns carried to the output rows (``output.keep_columns``), and their Arrow types.

Which columns: all of a row's input columns, none, or a named list (a named column that a row
lacks is null there). An input column named like an output column comes back as
``prefix + name`` (again, until the name is free), on the job path and on the Ray path alike:
spin-batch's own columns always keep their names.

Types: output parts are written one flush at a time, so a kept column is stored in each part
with the Arrow type pyarrow infers from that part's values. Where a part's values have no common
type (a number in one row, a string in the next) the column is stored in that part as JSON
text, marked in the field's metadata. Readers merge the parts with pyarrow's permissive
promotion (a column missing from a part is null there; int64 and double make double); a
column whose types still differ between parts (int64 in one, string in another) is read as
JSON text in every part, so no row's value is lost or coerced.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

KeepColumns = str | Sequence[str]  # "all", "none" or column names

JSON_KEY = b"spin_batch.encoding"  # field metadata of a kept column stored as JSON text
JSON_VALUE = b"json"


def output_names(names: Iterable[str], taken: Collection[str], prefix: str) -> dict[str, str]:
    """Each input column's name in the output: its own, or ``prefix`` + it (repeated until free)
    where an output column (``taken``) has it."""
    names = list(names)
    used = set(taken) | set(names)
    out: dict[str, str] = {}
    for name in names:
        new = name
        if name in taken:
            new = prefix + name
            while new in used:
                new = prefix + new
            used.add(new)
        out[name] = new
    return out


def selected(names: Iterable[str], keep: KeepColumns) -> list[str]:
    """The columns ``keep`` picks: all of ``names``, none, or the listed ones (listed order)."""
    if keep == "all":
        return list(names)
    if keep == "none":
        return []
    return list(keep)


def kept_values(values: Mapping[str, Any] | None, prefix: str, taken: Collection[str]) -> dict[str, Any]:
    """One row's kept input columns (those the reader picked) under their output names."""
    values = values or {}
    return {new: values[old] for old, new in output_names(values, taken, prefix).items()}


def is_json(f: pa.Field) -> bool:
    return (f.metadata or {}).get(JSON_KEY) == JSON_VALUE


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False, default=str)


def json_column(name: str, values: list) -> tuple[pa.Field, pa.Array]:
    """``values`` as JSON text (nulls stay null), with the field marked as such."""
    return (pa.field(name, pa.string(), metadata={JSON_KEY: JSON_VALUE}),
            pa.array([_json_text(v) for v in values], pa.string()))


def part_column(name: str, values: list) -> tuple[pa.Field, pa.Array]:
    """One part's kept column: the Arrow type pyarrow infers, else JSON text."""
    try:
        array = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return json_column(name, values)
    return pa.field(name, array.type), array


def _unify(fields: list[pa.Field]) -> bool:
    """Whether one column's fields from several parts merge without JSON text."""
    marked = [is_json(f) for f in fields]
    if any(marked):
        return all(marked)
    try:
        pa.unify_schemas([pa.schema([f.remove_metadata()]) for f in fields], promote_options="permissive")
    except (pa.ArrowTypeError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def merge_parts(tables: list[pa.Table], own: Collection[str]) -> pa.Table:
    """Concatenate parts whose kept columns (those not in ``own``) may differ (see the module doc)."""
    kept = dict.fromkeys(n for t in tables for n in t.column_names if n not in own)
    as_json = [n for n in kept if not _unify([t.schema.field(n) for t in tables if n in t.column_names])]
    if as_json:
        tables = [_to_json(t, as_json) for t in tables]
    return pa.concat_tables(tables, promote_options="permissive")


def _to_json(table: pa.Table, names: list[str]) -> pa.Table:
    for name in names:
        if name not in table.column_names or is_json(table.schema.field(name)):
            continue
        i = table.column_names.index(name)
        table = table.set_column(i, *json_column(name, table.column(i).to_pylist()))
    return table
