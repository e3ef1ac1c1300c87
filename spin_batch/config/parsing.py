"""Job-config parsing machinery: the error types, the value checks, the section reader.

Every check takes one raw YAML value and returns it normalised or raises :class:`_Invalid` with a
message that has no key path; :class:`_Section` reads one mapping into a dataclass, prefixes each
message with the key's path (``batch.slots: ...``) and collects it in an :class:`_Errors`, so that
a job's every problem is reported at once in one :class:`ConfigError`. Paths have ``~`` and
``$VAR``/``${VAR}`` expanded here (:func:`_path`, :func:`_paths`).
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any


# --------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """A job configuration is invalid.

    ``str(err)`` is the header followed by one indented line per problem; the
    individual problem lines are also available as ``err.problems``.
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        self.problems: tuple[str, ...] = tuple(problems)
        lines = [message, *(f"  {p}" for p in self.problems)]
        super().__init__("\n".join(lines))


class _Invalid(Exception):
    """Raised by a value check; carries the message without the key path."""


class _Errors:
    """Ordered, de-duplicated collection of ``(key path, message)`` problems."""

    def __init__(self) -> None:
        self._items: list[tuple[str, str]] = []

    def add(self, path: str, message: str) -> None:
        """Record one problem at ``path`` (empty path = the whole document)."""
        if (path, message) not in self._items:
            self._items.append((path, message))

    def has(self, *paths: str) -> bool:
        """True if any problem was recorded at exactly one of ``paths``."""
        return any(p in paths for p, _ in self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def lines(self) -> list[str]:
        """Problems formatted as ``path: message``."""
        return [f"{p}: {m}" if p else m for p, m in self._items]


def _describe(value: Any) -> str:
    """Short ``type repr`` description of a bad value for error messages."""
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _join(path: str, key: str) -> str:
    """Append ``key`` to a dotted key path."""
    return f"{path}.{key}" if path else key


def _yaml_repr(value: Any) -> str:
    """Render an allowed value the way a user would write it in YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# --------------------------------------------------------------------------- value checks

Check = Callable[[Any], Any]


def _int(lo: int | None = None, hi: int | None = None) -> Check:
    """An ``int`` (not ``bool``, not a digit string) within ``[lo, hi]``."""

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"expected an integer, got {_describe(value)}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            if lo is not None and hi is not None:
                bound = f"in [{lo}, {hi}]"
            else:
                bound = f">= {lo}" if lo is not None else f"<= {hi}"
            raise _Invalid(f"must be an integer {bound}, got {value}")
        return value

    return check


def _num(ok: Callable[[float], bool] = lambda x: True, desc: str = "") -> Check:
    """A finite number (``int`` accepted, ``bool`` not) satisfying ``ok``."""

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Invalid(f"expected a number, got {_describe(value)}")
        number = float(value)
        if not math.isfinite(number):
            raise _Invalid(f"must be a finite number, got {value}")
        if not ok(number):
            raise _Invalid(f"must be a number {desc}, got {value}")
        return number

    return check


def _bool(value: Any) -> bool:
    """A YAML boolean (``true``/``false``)."""
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_describe(value)}")
    return value


def _text(nonempty: bool = True) -> Check:
    """A string, optionally required to be non-empty."""

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise _Invalid(f"expected a string, got {_describe(value)}")
        if nonempty and not value:
            raise _Invalid("must be a non-empty string")
        return value

    return check


def _texts(nonempty: bool) -> Check:
    """A string or a list of non-empty strings, returned as a tuple."""

    def check(value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise _Invalid(f"expected a string or a list of strings, got {_describe(value)}")
        if nonempty and not items:
            raise _Invalid("must not be empty")
        for i, item in enumerate(items):
            if not isinstance(item, str) or not item:
                raise _Invalid(f"item [{i}] must be a non-empty string, got {_describe(item)}")
        return tuple(items)

    return check


_ENV_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def _expand_path(text: str) -> str:
    """``~`` and ``$VAR``/``${VAR}`` expanded (``$$`` is a literal ``$``); an unset or empty
    variable is a problem, not a path with a ``$`` in it."""
    missing: list[str] = []

    def var(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        value = os.environ.get(name, "")
        if not value:
            missing.append(name)
        return value

    parts = [_ENV_VAR.sub(var, piece) for piece in text.split("$$")]
    if missing:
        names = ", ".join(f"${n}" for n in dict.fromkeys(missing))
        raise _Invalid(f"environment variable {names} is not set (or empty) in {text!r}")
    return os.path.expanduser("$".join(parts))


def _path(value: Any) -> str:
    """A non-empty path string, with ``~`` and environment variables expanded."""
    return _expand_path(_text()(value))


def _paths(value: Any) -> tuple[str, ...]:
    """A path or a non-empty list of paths, each expanded like :func:`_path`."""
    items = _texts(nonempty=True)(value)
    expanded, problems = [], []
    for item in items:
        try:
            expanded.append(_expand_path(item))
        except _Invalid as exc:
            problems.append(str(exc))
    if problems:
        raise _Invalid("; ".join(problems))
    return tuple(expanded)


def _optional(check: Check) -> Check:
    """Accept ``null`` (-> ``None``) or whatever ``check`` accepts."""
    return lambda value: None if value is None else check(value)


def _choice(*options: Any) -> Check:
    """One of ``options``, compared type-strictly (so ``1`` is not ``True``)."""

    def check(value: Any) -> Any:
        for option in options:
            if type(value) is type(option) and value == option:
                return option
        allowed = ", ".join(_yaml_repr(o) for o in options)
        raise _Invalid(f"must be one of {allowed}, got {_describe(value)}")

    return check


def _switch(value: Any) -> str:
    """auto, on or off. YAML 1.1 reads a bare ``on``/``off`` (and yes/no, true/false) as a bool:
    those mean on and off too."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return _choice("auto", "on", "off")(value)


def _pattern(regex: str, desc: str) -> Check:
    """A string fully matching ``regex``."""
    compiled = re.compile(regex)

    def check(value: Any) -> str:
        text = _text()(value)
        if not compiled.fullmatch(text):
            raise _Invalid(f"must be {desc}, got {text!r}")
        return text

    return check


#: Accepted dtype spellings -> canonical torch dtype name.
DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def _dtype(value: Any) -> str:
    """A dtype name or alias, normalised to its canonical name."""
    if isinstance(value, str) and value in DTYPE_ALIASES:
        return DTYPE_ALIASES[value]
    raise _Invalid(
        "must be one of 'float32', 'bfloat16', 'float16' "
        f"(aliases fp32, bf16, fp16), got {_describe(value)}"
    )


def _target_dtype(value: Any) -> str:
    """target.dtype: a dtype name or alias, or 'auto' (resolved per machine: preflight.resolve_dtype)."""
    if value == "auto":
        return "auto"
    try:
        return _dtype(value)
    except _Invalid:
        raise _Invalid("must be 'auto' or one of 'float32', 'bfloat16', 'float16' "
                       f"(aliases fp32, bf16, fp16), got {_describe(value)}") from None


BACKENDS = ("auto", "native", "transformers")  # target.backend, a model drafter's backend


# --------------------------------------------------------------------------- section reader


def _unknown_key_message(key: str, valid: Sequence[str]) -> str:
    """``unknown key`` with the closest valid key, or the list of valid keys."""
    close = difflib.get_close_matches(key, list(valid), n=1)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return "unknown key; valid keys: " + ", ".join(repr(k) for k in valid)


def _take(
    raw: Mapping, path: str, errs: _Errors, key: str, check: Check, default: Any
) -> Any:
    """Read and check ``raw[key]``; record a problem and fall back on failure.

    ``default`` is ``MISSING`` for required keys. On error the default (or
    ``None`` for required keys) is returned so parsing can continue.
    """
    fallback = None if default is MISSING else default
    if key not in raw:
        if default is MISSING:
            errs.add(_join(path, key), "missing required key")
        return fallback
    try:
        return check(raw[key])
    except _Invalid as exc:
        errs.add(_join(path, key), str(exc))
        return fallback


class _Section:
    """One mapping being parsed into dataclass ``cls``; rejects unknown keys."""

    def __init__(self, cls: type, raw: Mapping, path: str, errs: _Errors) -> None:
        self.raw, self.path, self.errs = raw, path, errs
        self.defaults = {f.name: f.default for f in fields(cls)}
        for key in raw:
            if key not in self.defaults:
                errs.add(_join(path, str(key)), _unknown_key_message(str(key), list(self.defaults)))

    def key_path(self, key: str) -> str:
        """Full key path of ``key`` in this section."""
        return _join(self.path, key)

    def take(self, key: str, check: Check) -> Any:
        """Read field ``key`` with ``check``, using the dataclass default."""
        return _take(self.raw, self.path, self.errs, key, check, self.defaults[key])

    def ok(self, *keys: str) -> bool:
        """True if none of ``keys`` had a problem."""
        return not self.errs.has(*(self.key_path(k) for k in keys))

    def section(self, key: str, cls: type) -> Any:
        """Parse nested mapping ``key`` with ``cls._parse``; null/non-mapping is an error."""
        default = self.defaults[key]
        fallback = None if default is MISSING else default
        if key not in self.raw:
            if default is MISSING:
                self.errs.add(self.key_path(key), "missing required section")
            return fallback
        value = self.raw[key]
        if not isinstance(value, Mapping):
            self.errs.add(self.key_path(key), f"expected a mapping, got {_describe(value)}")
            return fallback
        return cls._parse(_Section(cls, value, self.key_path(key), self.errs))
