"""Job configuration: YAML -> frozen dataclasses, validated before any model loads.

A job file is parsed with :func:`yaml.safe_load`, optional ``--set KEY=VALUE``
overrides are applied, and the result is checked field by field. Every problem
is collected and reported at once in a single :class:`ConfigError`, each line
prefixed by the key path it concerns (``batch.slots: ...``,
``drafters[1].layers: ...``).

Paths (``input.paths``, ``output.dir``, ``target.model``, a model drafter's ``model``) have
``~`` and ``$VAR``/``${VAR}`` expanded when the job is parsed (``$$`` is a literal ``$``); an
unset or empty variable is a problem naming it.

Public API::

    load_job(path, overrides=()) -> JobConfig
    parse_job(raw, overrides=(), source="<job>") -> JobConfig
    apply_overrides(raw, overrides) -> dict
    job_to_dict(job) -> dict
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import MISSING, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "ConfigError",
    "JobConfig",
    "InputConfig",
    "OutputConfig",
    "TargetConfig",
    "EarlyExitDrafterConfig",
    "ModelDrafterConfig",
    "NgramDrafterConfig",
    "VoteDrafterConfig",
    "CascadeDrafterConfig",
    "DrafterConfig",
    "DRAFTER_KINDS",
    "SpinConfig",
    "SELECTOR_GRAMMAR",
    "BatchConfig",
    "SamplingConfig",
    "DTYPE_ALIASES",
    "load_job",
    "parse_job",
    "apply_overrides",
    "job_to_dict",
]


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


def _top_k(value: Any) -> int:
    """``0`` or ``-1`` (disabled, normalised to 0) or a positive integer."""
    k = _int()(value)
    if k < -1:
        raise _Invalid(f"must be -1 or 0 (disabled) or an integer >= 1, got {k}")
    return max(k, 0)


_drafter_name_text = _pattern(r"[A-Za-z0-9_.-]+", "a name matching [A-Za-z0-9_.-]+")


def _drafter_name(value: Any) -> str:
    """A drafter name: ``[A-Za-z0-9_.-]+`` and not the reserved ``none``."""
    name = _drafter_name_text(value)
    if name == "none":
        raise _Invalid("'none' is reserved and cannot be a drafter name")
    return name


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


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class InputConfig:
    """Where prompts come from and how rows are interpreted."""

    paths: tuple[str, ...]
    # auto: by suffix, and a JSONL file whose first row has custom_id and url/body is an OpenAI batch file
    format: Literal["auto", "jsonl", "parquet", "openai"] = "auto"
    id_column: str = "id"  # the column options are not used for OpenAI batch lines (the body is the request)
    prompt_column: str = "prompt"
    messages_column: str = "messages"
    # a column holding each row's own sampling settings (an object: max_tokens, temperature, top_p,
    # top_k, stop, seed; null or a field left out: the job's value)
    params_column: str | None = None
    chat_template: Literal["auto", True, False] = "auto"
    system_prompt: str | None = None
    # a JSONL line longer than this becomes an error row without being read whole (memory stays bounded)
    max_line_bytes: int = 64 * 1024 * 1024

    @classmethod
    def _parse(cls, s: _Section) -> InputConfig:
        return cls(
            paths=s.take("paths", _paths),
            format=s.take("format", _choice("auto", "jsonl", "parquet", "openai")),
            id_column=s.take("id_column", _text()),
            prompt_column=s.take("prompt_column", _text()),
            messages_column=s.take("messages_column", _text()),
            params_column=s.take("params_column", _optional(_text())),
            chat_template=s.take("chat_template", _choice("auto", True, False)),
            system_prompt=s.take("system_prompt", _optional(_text(nonempty=False))),
            max_line_bytes=s.take("max_line_bytes", _int(lo=1)),
        )


@dataclass(frozen=True)
class OutputConfig:
    """Where results go, in which form, with which input columns, and how often they are flushed.

    The Parquet parts under ``dir/outputs`` are always written (they are the resume log);
    ``format`` openai adds ``dir/results.jsonl`` (OpenAI batch response lines) at the end of a
    run, both adds it and ``dir/results.parquet``. ``keep_columns`` picks the input columns that
    come back beside the output columns; an input column named like an output column comes back
    as ``column_prefix`` + its name.
    """

    dir: str
    rows_per_part: int = 256
    flush_interval_s: float = 60.0
    stats_interval_s: float = 10.0
    format: Literal["parquet", "openai", "both"] = "parquet"
    keep_columns: Literal["all", "none"] | tuple[str, ...] = "all"
    column_prefix: str = "input_"

    @classmethod
    def _parse(cls, s: _Section) -> OutputConfig:
        positive = _num(lambda x: x > 0, "> 0")
        return cls(
            dir=s.take("dir", _path),
            rows_per_part=s.take("rows_per_part", _int(lo=1)),
            flush_interval_s=s.take("flush_interval_s", positive),
            stats_interval_s=s.take("stats_interval_s", positive),
            format=s.take("format", _choice("parquet", "openai", "both")),
            keep_columns=s.take("keep_columns", _keep_columns),
            column_prefix=s.take("column_prefix", _text()),
        )


def _keep_columns(value: Any) -> str | tuple[str, ...]:
    """all, none, or a list of column names (each non-empty, none twice)."""
    if isinstance(value, str):
        return _choice("all", "none")(value)
    if not isinstance(value, (list, tuple)):
        raise _Invalid(f"expected all, none or a list of column names, got {_describe(value)}")
    names = _texts(nonempty=False)(value)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _Invalid(f"names a column more than once: {', '.join(twice)}")
    return names


BACKENDS = ("auto", "native", "transformers")  # target.backend, a model drafter's backend


@dataclass(frozen=True)
class TargetConfig:
    """The model whose outputs are produced (and verified against)."""

    model: str = "builtin:smollm2-135m"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    # the kernels every model of the job runs on (spin_batch/models/execution.py): auto (CPU: measured per
    # model; CUDA: Triton with CUDA graphs where Triton imports) | c (the C decoder, CPU only) | torch |
    # triton (CPU only under TRITON_INTERPRET=1). Whether they can run here is checked by validate.
    kernels: Literal["auto", "c", "torch", "triton"] = "auto"
    # which code runs the model (docs/backends.md): auto (native where the architecture is ours: Llama,
    # Mistral, Qwen2; else transformers) | native | transformers (transformers' modelling code, our attention)
    backend: Literal["auto", "native", "transformers"] = "auto"
    trust_remote_code: bool = False  # the transformers backend may run modelling code shipped in the folder

    @classmethod
    def _parse(cls, s: _Section) -> TargetConfig:
        device = _pattern(r"auto|cpu|cuda(:[0-9]+)?", "auto, cpu, cuda or cuda:<index>")
        target = cls(
            model=s.take("model", _path),
            dtype=s.take("dtype", _dtype),
            device=s.take("device", device),
            kernels=s.take("kernels", _choice("auto", "c", "torch", "triton")),
            backend=s.take("backend", _choice(*BACKENDS)),
            trust_remote_code=s.take("trust_remote_code", _bool),
        )
        if s.ok("device", "kernels") and target.kernels == "c" and target.device.startswith("cuda"):
            s.errs.add(s.key_path("kernels"), f"c is the C decoder on CPU; target.device is {target.device}")
        return target


# --------------------------------------------------------------------------- drafters


@dataclass(frozen=True, kw_only=True)
class EarlyExitDrafterConfig:
    """Draft with the target's first ``layers`` layers (self-speculation)."""

    name: str
    kind: Literal["early_exit"] = "early_exit"
    layers: int

    @classmethod
    def _parse(cls, s: _Section, name: str) -> EarlyExitDrafterConfig:
        # The upper bound (< number of target layers) is checked once the model is known.
        return cls(name=name, layers=s.take("layers", _int(lo=1)))


@dataclass(frozen=True, kw_only=True)
class ModelDrafterConfig:
    """Draft with a separate (smaller) model sharing the target's tokenizer."""

    name: str
    kind: Literal["model"] = "model"
    model: str
    dtype: str | None = None
    backend: Literal["auto", "native", "transformers"] = "auto"  # as target.backend
    trust_remote_code: bool = False

    @classmethod
    def _parse(cls, s: _Section, name: str) -> ModelDrafterConfig:
        return cls(
            name=name,
            model=s.take("model", _path),
            dtype=s.take("dtype", _optional(_dtype)),
            backend=s.take("backend", _choice(*BACKENDS)),
            trust_remote_code=s.take("trust_remote_code", _bool),
        )


@dataclass(frozen=True, kw_only=True)
class NgramDrafterConfig:
    """Draft by n-gram lookup in the prompt and generated text (no model)."""

    name: str
    kind: Literal["ngram"] = "ngram"
    min_ngram: int = 1
    max_ngram: int = 3

    @classmethod
    def _parse(cls, s: _Section, name: str) -> NgramDrafterConfig:
        lo = s.take("min_ngram", _int(lo=1, hi=16))
        hi = s.take("max_ngram", _int(lo=1, hi=16))
        if s.ok("min_ngram", "max_ngram") and lo > hi:
            s.errs.add(s.key_path("min_ngram"), f"must be <= max_ngram ({hi}), got {lo}")
        return cls(name=name, min_ngram=lo, max_ngram=hi)


def _members(s: _Section) -> tuple[str, ...]:
    """A composite drafter's `members`: at least 2 drafter names, none twice (which ones exist is
    checked once every drafter is parsed, in _check_members)."""
    members = s.take("members", _texts(nonempty=True))
    if s.ok("members") and (len(set(members)) != len(members) or len(members) < 2):
        s.errs.add(s.key_path("members"), f"needs at least 2 distinct drafters, got {list(members)}")
    return members


@dataclass(frozen=True, kw_only=True)
class VoteDrafterConfig:
    """Collective drafting: a weighted majority vote over other drafters' proposals."""

    name: str
    kind: Literal["vote"] = "vote"
    members: tuple[str, ...]
    beta: float = 0.5

    @classmethod
    def _parse(cls, s: _Section, name: str) -> VoteDrafterConfig:
        members = _members(s)
        beta = s.take("beta", _num(lambda x: 0 < x < 1, "in (0, 1)"))
        return cls(name=name, members=members, beta=beta)


@dataclass(frozen=True, kw_only=True)
class CascadeDrafterConfig:
    """Per slot and step, the first of the members whose gated proposal has at least min_tokens tokens."""

    name: str
    kind: Literal["cascade"] = "cascade"
    members: tuple[str, ...]
    min_tokens: int = 2

    @classmethod
    def _parse(cls, s: _Section, name: str) -> CascadeDrafterConfig:
        members = _members(s)
        min_tokens = s.take("min_tokens", _int(lo=1, hi=32))
        return cls(name=name, members=members, min_tokens=min_tokens)


DrafterConfig = (EarlyExitDrafterConfig | ModelDrafterConfig | NgramDrafterConfig | VoteDrafterConfig
                 | CascadeDrafterConfig)

#: Drafter ``kind`` -> its config class. Add new drafter kinds here.
DRAFTER_KINDS: dict[str, type] = {
    "early_exit": EarlyExitDrafterConfig,
    "model": ModelDrafterConfig,
    "ngram": NgramDrafterConfig,
    "vote": VoteDrafterConfig,
    "cascade": CascadeDrafterConfig,
}

#: Drafter kinds made of other configured drafters (their ``members``).
COMPOSITE_KINDS = ("vote", "cascade")


def _drafter_class(item: Mapping, path: str, errs: _Errors) -> type | None:
    """Look up the config class for ``item['kind']``, recording a problem if invalid."""
    valid = ", ".join(repr(k) for k in DRAFTER_KINDS)
    kind = item.get("kind", MISSING)
    if kind is MISSING:
        errs.add(_join(path, "kind"), f"missing required key; valid kinds: {valid}")
        return None
    if not isinstance(kind, str) or kind not in DRAFTER_KINDS:
        errs.add(_join(path, "kind"), f"unknown drafter kind {_describe(kind)}; valid kinds: {valid}")
        return None
    return DRAFTER_KINDS[kind]


def _parse_drafter(item: Any, path: str, errs: _Errors) -> tuple[str | None, Any]:
    """Parse one drafter entry; returns ``(valid name or None, config or None)``."""
    if not isinstance(item, Mapping):
        errs.add(path, f"expected a mapping, got {_describe(item)}")
        return None, None
    name = _take(item, path, errs, "name", _drafter_name, MISSING)
    cls = _drafter_class(item, path, errs)
    if cls is None:
        return name, None
    return name, cls._parse(_Section(cls, item, path, errs), name)


def _parse_drafters(root: _Section) -> tuple[tuple[Any, ...], list[str]]:
    """Parse the ``drafters`` list; returns the configs and the valid, unique names."""
    path = root.key_path("drafters")
    value = root.raw.get("drafters", [])
    if not isinstance(value, (list, tuple)):
        root.errs.add(path, f"expected a list of drafters, got {_describe(value)}")
        return (), []
    configs: list[Any] = []
    seen: dict[str, str] = {}
    for i, item in enumerate(value):
        item_path = f"{path}[{i}]"
        name, config = _parse_drafter(item, item_path, root.errs)
        if name is not None and name in seen:
            root.errs.add(
                f"{item_path}.name", f"duplicate drafter name {name!r} (also {seen[name]})"
            )
        elif name is not None:
            seen[name] = item_path
        if config is not None:
            configs.append(config)
    _check_members(configs, path, root.errs)
    return tuple(configs), list(seen)


def _check_members(configs: list[Any], path: str, errs: _Errors) -> None:
    """A vote's or a cascade's members must be other configured drafters, and plain ones."""
    kinds = {c.name: c.kind for c in configs}
    for i, c in enumerate(configs):
        if c.kind not in COMPOSITE_KINDS:
            continue
        for m in c.members:
            if m not in kinds:
                errs.add(f"{path}[{i}].members", f"unknown drafter {m!r}; configured: {sorted(kinds)}")
            elif kinds[m] in COMPOSITE_KINDS:
                errs.add(f"{path}[{i}].members", f"{m!r} is a {kinds[m]} drafter; members must be plain drafters")


# --------------------------------------------------------------------------- spin / batch / sampling

#: Selector grammar: selector kind -> what its ``:<argument>`` must be
#: (``None`` = takes no argument, ``"drafter"`` = a configured drafter name).
#: ``auto`` is not listed: it is resolved to one of these at parse time.
#: Add new selectors (e.g. ``"ucb": None``) here.
SELECTOR_GRAMMAR: dict[str, str | None] = {
    "none": None,
    "fixed": "drafter",
    "ucb": None,
    "thompson": None,
    "round_robin": None,
}


def _selector_forms() -> str:
    """Human-readable list of accepted selector spellings."""
    forms = ["auto"]
    for kind, arg in SELECTOR_GRAMMAR.items():
        forms.append(kind if arg is None else f"{kind}:<{arg}>")
    return ", ".join(forms)


def _resolve_selector(value: str, names: Sequence[str]) -> str:
    """Validate ``value`` against :data:`SELECTOR_GRAMMAR` and resolve ``auto``."""
    if value == "auto":
        return "ucb" if names else "none"
    kind, sep, arg = value.partition(":")
    if kind not in SELECTOR_GRAMMAR:
        raise _Invalid(f"invalid selector {value!r}; expected one of: {_selector_forms()}")
    arg_type = SELECTOR_GRAMMAR[kind]
    if arg_type is None:
        if sep:
            raise _Invalid(f"selector {kind!r} takes no argument, got {value!r}")
        return value
    if not arg:
        raise _Invalid(f"selector {kind!r} needs an argument: {kind}:<{arg_type}>")
    if arg not in names:
        configured = ", ".join(repr(n) for n in names) or "(none)"
        raise _Invalid(f"unknown drafter {arg!r} in {value!r}; configured drafters: {configured}")
    return value


@dataclass(frozen=True)
class SpinConfig:
    """Speculative decoding: which drafter to use and how far to speculate."""

    selector: str = "auto"
    num_speculative_tokens: int = 4
    pipeline: Literal["auto", "on", "off"] = "auto"  # auto: on for CUDA, off on CPU
    # model drafters stop a chain where their own confidence no longer pays for a verified token
    confidence_gate: bool = True
    # the bandits speculate at a step only while speculating steps measure more goodput than plain ones
    backoff: bool = True

    @classmethod
    def _parse(cls, s: _Section) -> SpinConfig:
        # The selector is resolved against the drafters in _parse_root.
        return cls(
            selector=s.take("selector", _text()),
            num_speculative_tokens=s.take("num_speculative_tokens", _int(lo=1, hi=32)),
            pipeline=s.take("pipeline", _switch),
            confidence_gate=s.take("confidence_gate", _bool),
            backoff=s.take("backoff", _bool),
        )


@dataclass(frozen=True)
class BatchConfig:
    """Continuous-batching capacity and per-step token budget."""

    slots: int = 8
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512

    @classmethod
    def _parse(cls, s: _Section) -> BatchConfig:
        slots = s.take("slots", _int(lo=1))
        budget = s.take("max_num_batched_tokens", _int(lo=1))
        if s.ok("slots", "max_num_batched_tokens") and budget < slots:
            s.errs.add(
                s.key_path("max_num_batched_tokens"),
                f"must be >= batch.slots ({slots}), got {budget}",
            )
        return cls(
            slots=slots,
            max_model_len=s.take("max_model_len", _int(lo=16)),
            max_num_batched_tokens=budget,
        )


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling parameters (shared by all rows of a job)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0

    @classmethod
    def _parse(cls, s: _Section) -> SamplingConfig:
        return cls(
            temperature=s.take("temperature", _num(lambda x: x >= 0, ">= 0")),
            top_p=s.take("top_p", _num(lambda x: 0 < x <= 1, "in (0, 1]")),
            top_k=s.take("top_k", _top_k),
            seed=s.take("seed", _int()),
            max_tokens=s.take("max_tokens", _int(lo=1)),
            stop=s.take("stop", _texts(nonempty=False)),
            ignore_eos=s.take("ignore_eos", _bool),
        )


# --------------------------------------------------------------------------- job


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A complete, validated batch inference job."""

    name: str | None = None
    input: InputConfig
    output: OutputConfig
    target: TargetConfig = TargetConfig()
    drafters: tuple[DrafterConfig, ...] = ()
    spin: SpinConfig = SpinConfig()
    batch: BatchConfig = BatchConfig()
    sampling: SamplingConfig = SamplingConfig()

    def drafter(self, name: str) -> DrafterConfig:
        """The drafter called ``name``; ``KeyError`` if there is none."""
        for drafter in self.drafters:
            if drafter.name == name:
                return drafter
        names = ", ".join(repr(d.name) for d in self.drafters) or "(none)"
        raise KeyError(f"no drafter named {name!r}; configured drafters: {names}")


def _resolve_spin(spin: SpinConfig, names: Sequence[str], errs: _Errors) -> SpinConfig:
    """Resolve/validate ``spin.selector`` against the configured drafter names."""
    if errs.has("spin.selector"):
        return spin
    try:
        return replace(spin, selector=_resolve_selector(spin.selector, names))
    except _Invalid as exc:
        errs.add("spin.selector", str(exc))
        return spin


def _check_max_tokens(batch: BatchConfig, sampling: SamplingConfig, errs: _Errors) -> None:
    """A request must fit: ``sampling.max_tokens < batch.max_model_len``."""
    if errs.has("sampling.max_tokens", "batch.max_model_len"):
        return
    if sampling.max_tokens >= batch.max_model_len:
        errs.add(
            "sampling.max_tokens",
            f"must be < batch.max_model_len ({batch.max_model_len}), got {sampling.max_tokens}",
        )


def _parse_root(raw: Mapping, errs: _Errors) -> JobConfig:
    """Parse the top-level mapping, including cross-section checks."""
    root = _Section(JobConfig, raw, "", errs)
    name = root.take("name", _optional(_text()))
    input_ = root.section("input", InputConfig)
    output = root.section("output", OutputConfig)
    target = root.section("target", TargetConfig)
    drafters, names = _parse_drafters(root)
    spin = _resolve_spin(root.section("spin", SpinConfig), names, errs)
    batch = root.section("batch", BatchConfig)
    sampling = root.section("sampling", SamplingConfig)
    _check_max_tokens(batch, sampling, errs)
    return JobConfig(
        name=name,
        input=input_,
        output=output,
        target=target,
        drafters=drafters,
        spin=spin,
        batch=batch,
        sampling=sampling,
    )


def parse_job(
    raw: Mapping, overrides: Sequence[str] = (), source: str = "<job>"
) -> JobConfig:
    """Validate a raw job mapping (after applying ``overrides``) into a :class:`JobConfig`.

    Raises :class:`ConfigError` listing every problem found.
    """
    header = f"invalid job {source}:"
    if not isinstance(raw, Mapping):
        raise ConfigError(header, [f"expected a mapping at the top level, got {_describe(raw)}"])
    raw, problems = _apply_overrides(dict(raw), overrides)
    if problems:
        raise ConfigError(header, problems)
    errs = _Errors()
    job = _parse_root(raw, errs)
    if errs:
        raise ConfigError(header, errs.lines())
    return job


def load_job(path: str | os.PathLike, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a YAML job file, apply ``--set`` overrides and validate it.

    A missing/unreadable file or a YAML syntax error is a :class:`ConfigError`
    naming the file. An empty file counts as an empty mapping.
    """
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"invalid job {source}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid job {source}: cannot read file ({exc})") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid job {source}: YAML syntax error", [str(exc)]) from exc
    return parse_job({} if raw is None else raw, overrides, source=source)


# --------------------------------------------------------------------------- overrides

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
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise _Invalid(f"bad override {text!r}: invalid value ({problem})") from exc
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
    parsed with ``yaml.safe_load``. Raises :class:`ConfigError` listing every
    bad override.
    """
    result, problems = _apply_overrides(raw, overrides)
    if problems:
        raise ConfigError("invalid overrides:", problems)
    return result


# --------------------------------------------------------------------------- dump


def _plain(value: Any) -> Any:
    """Dataclasses -> dicts and tuples -> lists, recursively."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def job_to_dict(job: JobConfig) -> dict:
    """Plain-data form of ``job`` (YAML/JSON friendly) that :func:`parse_job` accepts."""
    return _plain(job)
