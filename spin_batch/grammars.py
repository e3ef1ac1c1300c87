"""Structured output: what a request asks its text to match, read from the fields that ask for it.

A :class:`Structured` is one constraint of five kinds, vLLM's: ``choice`` (the text is one of the
strings), ``regex``, ``json`` (a JSON schema), ``json_object`` (any JSON object) and ``grammar`` (a
Lark grammar, or GBNF as llama.cpp writes it). It is asked for by an OpenAI ``response_format``, by
vLLM's ``structured_outputs`` object (and its older top-level ``guided_*`` fields), by the job's
``sampling.structured`` and by a row's params column; each reader checks it here, so a bad one is an
error row (or a job error), never a traceback.

The grammar engine is llguidance, an optional extra (``structured``): :func:`problem` says what is
wrong with a constraint (the engine missing, with the pip command; a schema, regex or grammar it cannot
compile), checked once per distinct constraint. engine/structured.py masks the target's logits with it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["ENGINE_FIX", "KINDS", "Structured", "StructuredError", "from_guided", "from_response_format",
           "grammar_text", "problem", "structured_from"]

#: The constraint kinds, as vLLM's structured_outputs names them.
KINDS = ("choice", "regex", "json", "json_object", "grammar")
#: vLLM's older top-level fields (removed from vLLM in 0.12, still in older batch files) -> the kind.
GUIDED = {"guided_choice": "choice", "guided_regex": "regex", "guided_json": "json", "guided_grammar": "grammar"}
#: structured_outputs keys that change nothing here (one engine, no fallback to choose).
NEUTRAL_KEYS = frozenset({"disable_fallback"})
#: How JSON is written under a schema: no free whitespace between tokens (vLLM's disable_any_whitespace).
JSON_OPTIONS = {"whitespace_flexible": False}
ENGINE_FIX = "pip install llguidance (or: pip install 'spin-batch[structured]')"


class StructuredError(ValueError):
    """A constraint that cannot be read; the message names the field."""


@dataclass(frozen=True)
class Structured:
    """One constraint. ``spec`` is its canonical text, the key its grammar is compiled under: a JSON
    schema or a choice list as compact JSON (key order kept: a schema's property order is the output's),
    a regex or grammar as given, "" for json_object."""

    kind: str
    spec: str

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(json.loads(self.spec)) if self.kind == "choice" else ()

    @property
    def schema(self) -> dict | None:
        """The JSON schema the text validates against (json_object: any object); None for other kinds."""
        if self.kind == "json":
            return json.loads(self.spec)
        return {"type": "object"} if self.kind == "json_object" else None


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _of_kind(kind: str, value: Any, where: str) -> Structured:
    """One kind's value, checked for shape (the engine checks the rest: problem())."""
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(x, str) for x in value):
            raise StructuredError(f"{where} must be a non-empty list of strings, got {_show(value)}")
        return Structured("choice", _compact(list(value)))
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError as e:
                raise StructuredError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(schema, Mapping):
            raise StructuredError(f"{where} must be a JSON schema (an object), got {_show(value)}")
        return Structured("json", _compact(schema))
    if kind == "json_object":
        if value is not True:
            raise StructuredError(f"{where} must be true, got {_show(value)}")
        return Structured("json_object", "")
    if not isinstance(value, str) or not value:  # regex, grammar
        raise StructuredError(f"{where} must be a non-empty string, got {_show(value)}")
    return Structured(kind, value)


def structured_from(value: Any, where: str = "structured_outputs") -> Structured | None:
    """vLLM's ``structured_outputs`` object (the job's ``sampling.structured`` takes the same): exactly one
    of choice, regex, json, json_object, grammar; null: none."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise StructuredError(f"{where} must be an object with one of {', '.join(KINDS)}, got {_show(value)}")
    for key in value:
        if key == "disable_any_whitespace" and value[key] in (True, None):
            continue  # compact JSON is what spin-batch writes (JSON_OPTIONS)
        if key not in KINDS and key not in NEUTRAL_KEYS:
            raise StructuredError(f"{where}.{key} is not supported (spin-batch takes one of {', '.join(KINDS)})")
    given = [k for k in KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(given) != 1:
        raise StructuredError(f"{where} must set exactly one of {', '.join(KINDS)}, got "
                              f"{', '.join(given) if given else 'none'}")
    return _of_kind(given[0], value[given[0]], f"{where}.{given[0]}")


def from_guided(fields: Mapping[str, Any], where: str = "") -> Structured | None:
    """vLLM's older top-level ``guided_choice`` / ``guided_regex`` / ``guided_json`` / ``guided_grammar``;
    at most one; None when none is given."""
    given = [k for k in GUIDED if fields.get(k) is not None]
    if len(given) > 1:
        raise StructuredError(f"give one of {', '.join(where + k for k in given)}, not several")
    return _of_kind(GUIDED[given[0]], fields[given[0]], where + given[0]) if given else None


def from_response_format(value: Any, where: str = "response_format") -> Structured | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (None), ``{"type": "json_object"}``, or
    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json_object", "")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise StructuredError(f"{where}.json_schema must be an object with a name and a schema, "
                                  f"got {_show(spec)}")
        if spec.get("strict") not in (None, True, False):
            raise StructuredError(f"{where}.json_schema.strict must be true or false, got {_show(spec['strict'])}")
        if spec.get("schema") is None:
            raise StructuredError(f"{where}.json_schema.schema is missing")
        return _of_kind("json", spec["schema"], f"{where}.json_schema.schema")
    raise StructuredError(f"{where} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                          f"{{\"type\": \"json_schema\", \"json_schema\": {{...}}}}, got {_show(value)}")


def engine_missing() -> str | None:
    """Why no constraint can be decoded here (the engine is not installed), or None."""
    if importlib.util.find_spec("llguidance") is None:
        return f"structured output needs the grammar engine llguidance, which is not installed: {ENGINE_FIX}"
    return None


def grammar_text(s: Structured) -> str:
    """The engine's grammar for a constraint (llguidance's grammar text)."""
    from llguidance import LLMatcher, grammar_from

    if s.kind in ("json", "json_object"):  # compact: no whitespace between tokens
        return LLMatcher.grammar_from_json_schema(s.spec or '{"type":"object"}', defaults=JSON_OPTIONS)
    if s.kind == "choice":
        return grammar_from("choice", s.spec)
    if s.kind == "regex":
        return LLMatcher.grammar_from_regex(s.spec)
    return grammar_from("grammar", s.spec)  # Lark, or GBNF converted to Lark


@lru_cache(maxsize=512)
def problem(s: Structured) -> str | None:
    """What keeps a constraint from being decoded (the engine missing, a bad schema, regex or grammar),
    in a message naming its kind; None when it compiles. Cached: each distinct constraint is compiled once."""
    missing = engine_missing()
    if missing is not None:
        return missing
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_text(s))
    except (ValueError, TypeError) as e:
        error = str(e)
    return None if not error else f"the {s.kind} constraint does not compile: {one_line(error)}"


def one_line(error: str, limit: int = 300) -> str:
    """An engine's multi-line error message on one line, cut short."""
    text = " ".join(part.strip() for part in error.strip().splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
