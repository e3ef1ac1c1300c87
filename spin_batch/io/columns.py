"""Input columns carried to the output rows (``output.keep_columns``), and their Arrow types.

Which columns: all of a row's input columns, none, or a named list (a named column that a row
lacks is null there). An input column named like an output column comes back as
``prefix + name``, and so does one named like that with the prefix before it once or more
(``input_text`` -> ``input_input_text``), on the job path and on the Ray path alike: spin-batch's
own columns always keep their names, and two input columns never share an output name, whichever
rows have them (:func:`output_name`).

Types: output parts are written one flush at a time, so a kept column is stored in each part
with the Arrow type pyarrow infers from that part's values. Where a part's values have no common
type (a number in one row, a string in the next) the column is stored in that part as JSON
text, marked in the field's metadata; so is a value Parquet cannot store (an empty object). Readers merge the parts with pyarrow's permissive
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


def output_name(name: str, taken: Collection[str], prefix: str) -> str:
    """An input column's name in the output, from its name alone (never from the row's other columns, so
    every row of a job maps it alike): ``prefix`` + it where it is an output column's name (``taken``)
    or such a name with ``prefix`` before it once or more, else its own. One-to-one: with prefix
    ``input_``, ``text`` -> ``input_text``, ``input_text`` -> ``input_input_text``, ``topic`` -> ``topic``."""
    base = name
    while prefix and base.startswith(prefix) and base not in taken:
        base = base[len(prefix):]
    return prefix + name if base in taken else name


def output_names(names: Iterable[str], taken: Collection[str], prefix: str) -> dict[str, str]:
    """Each input column's name in the output (:func:`output_name`)."""
    return {name: output_name(name, taken, prefix) for name in names}


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


def parquet_stores(t: pa.DataType) -> bool:
    """Whether Parquet can store this Arrow type: not a struct without fields (what an empty JSON object
    becomes), at any depth."""
    if pa.types.is_struct(t):
        return t.num_fields > 0 and all(parquet_stores(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return parquet_stores(t.value_type)
    if pa.types.is_map(t):
        return parquet_stores(t.key_type) and parquet_stores(t.item_type)
    return True


def part_column(name: str, values: list) -> tuple[pa.Field, pa.Array]:
    """One part's kept column: the Arrow type pyarrow infers where Parquet can store it, else JSON text."""
    try:
        array = pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return json_column(name, values)
    if not parquet_stores(array.type):
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
