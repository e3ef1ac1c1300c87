"""A row's identity across runs (its resume key): its id, and a digest of what decides its text.

A rerun finds a row's output by the row's id and content, never by where the row was read from, so
moving, renaming, symlinking or re-globbing a shard keeps its rows done. As a worker reads its rows:

- the first row with an id is keyed by that id;
- a row with no usable id (a line that is not JSON, a missing id ...) or with an id an earlier row
  used (a "duplicate id" error row) is keyed by its id (or none), its digest and ``input_key``:
  how many rows with this id and digest the worker read before it (``"0"``, ``"1"`` ...; a row
  with no id also names the worker where the input is split: ``"0/w0002"``).

The digest (:func:`digest`, stored as ``input_digest``) covers what decides the row's text: a plain
row's prompt, messages and params values, an OpenAI line's method, url and body, the bytes of a line
that is no row. Kept columns are not part of it. A row is done when the outputs hold a row with its
id, digest and copy number (``input_key``, "0" for the first); the latest row of each key counts, so
a row whose input changed under its id is redone and its new row replaces the old one.

Output rows written before rows had a digest (``input_digest`` null) are keyed by their id, and by
their ``source`` when they have no id or are a duplicate id error row; such a row counts as done for
an input row with the same key only when its source is the input row's source (the old key), so an
old output is never given to another row.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from ..records import Request

__all__ = ["Key", "digest", "duplicate_message", "line_digest", "request_key", "row_key"]

# ("id", id) | ("at", id or None, digest, input_key) | ("src", source): see the module docstring
Key = tuple


def _plain(value: Any) -> Any:
    """``value`` as plain JSON data: a mapping's null entries and NaN values left out, so a field that
    is absent, null or NaN (pandas' missing value) digests alike; bytes and other objects by name."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if v is not None and not _is_nan(v)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if _is_nan(value):
        return None
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    return {type(value).__name__: repr(value)}


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _hex(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def digest(values: Mapping[str, Any]) -> str:
    """32 hex digits over ``values`` (the fields that decide a row's text), canonical JSON."""
    text = json.dumps(_plain(values), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return _hex(text.encode("utf-8", "surrogatepass"))


def line_digest(raw: bytes | int) -> str:
    """The digest of a JSONL line that is no row: its bytes, or its length for a line too long to hold."""
    if isinstance(raw, int):
        return digest({"line_bytes": raw})
    return _hex(b"line:" + raw.rstrip(b"\r\n"))


def duplicate_message(row_id: str) -> str:
    """The error of a row whose id an earlier row used."""
    return f"duplicate id {row_id!r}"


def row_key(row_id: str | None, source: str, digest: str | None, input_key: str | None, status: str,
            error: str | None) -> Key:
    """The key of an output row (or of a request, from the same fields)."""
    if input_key is not None:
        return ("at", row_id, digest, input_key)
    if row_id is None or (digest is None and status == "error" and error == duplicate_message(row_id)):
        return ("src", source)
    return ("id", row_id)


def request_key(request: Request) -> Key:
    """The key an input row's output row is written under."""
    return row_key(request.id, request.source, request.digest, request.input_key,
                   "ok" if request.ok else "error", request.error)
