"""``--set KEY=VALUE`` overrides: applied to the raw job mapping before it is checked."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import yaml

from .parsing import ConfigError, _describe, _Invalid
from .safe_yaml import YamlRefused, load_yaml

_INDEX = re.compile(r"[0-9]+")


def _index(node: list, part: str, where: str, text: str) -> int:
    """Validate list index ``part`` for ``node`` (reached at key path ``where``)."""
    if not _INDEX.fullmatch(part):
        raise _Invalid(f"bad override {text!r}: {where!r} is a list; expected an index, got {part!r}")
    index = int(part)
    if index >= len(node):
        raise _Invalid(
            f"bad override {text!r}: index {index} out of range for {where!r} (length {len(node)})"
        )
    return index


def _slot(node: Any, part: str, where: str, text: str) -> tuple[Any, Any]:
    """Return ``(container, key)`` addressing ``part`` inside ``node``."""
    if isinstance(node, MutableMapping):
        return node, part
    if isinstance(node, list):
        return node, _index(node, part, where, text)
    raise _Invalid(
        f"bad override {text!r}: {where!r} is not a mapping or list (got {_describe(node)})"
    )


def _apply_one(raw: dict, text: str) -> None:
    """Apply one ``a.b.c=value`` override to ``raw`` in place."""
    key, sep, value_text = text.partition("=")
    if not sep:
        raise _Invalid(f"bad override {text!r}: expected KEY=VALUE")
    parts = key.strip().split(".")
    if not all(parts):
        raise _Invalid(f"bad override {text!r}: empty component in key {key.strip()!r}")
    try:
        value = load_yaml(value_text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise _Invalid(f"bad override {text!r}: invalid value ({problem})") from exc
    except YamlRefused as exc:
        raise _Invalid(f"bad override {text!r}: {exc}") from None
    except RecursionError:
        raise _Invalid(f"bad override {text!r}: lists or mappings nested too deeply") from None
    node: Any = raw
    for depth, part in enumerate(parts[:-1]):
        container, slot = _slot(node, part, ".".join(parts[:depth]), text)
        if isinstance(container, MutableMapping) and container.get(slot) is None:
            # Create the missing level: a list if it is about to be indexed.
            container[slot] = [] if _INDEX.fullmatch(parts[depth + 1]) else {}
        node = container[slot]
    container, slot = _slot(node, parts[-1], ".".join(parts[:-1]), text)
    container[slot] = value


def _apply_overrides(raw: Mapping, overrides: Sequence[str]) -> tuple[dict, list[str]]:
    """Apply all overrides to a deep copy; returns the copy and the problems."""
    result = copy.deepcopy(dict(raw))
    problems: list[str] = []
    for text in overrides:
        try:
            _apply_one(result, text)
        except _Invalid as exc:
            problems.append(str(exc))
    return result, problems


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Return a deep copy of ``raw`` with ``--set KEY=VALUE`` overrides applied.

    ``KEY`` is a dotted path (``batch.slots``); missing mappings are created and
    numeric components index into lists (``drafters.0.layers``). ``VALUE`` is
    parsed as YAML (:func:`.safe_yaml.load_yaml`). Raises :class:`ConfigError` listing every
    bad override.
    """
    result, problems = _apply_overrides(raw, overrides)
    if problems:
        raise ConfigError("invalid overrides:", problems)
    return result
