"""The drafter kinds' configs (early_exit, model, ngram, vote, cascade) and the ``drafters`` list.

Each kind is a frozen dataclass whose ``kind`` is a Literal, with its own checks in its ``_parse``;
:data:`DRAFTER_KINDS` maps a ``kind`` to its class. The list is checked as a whole here too:
unique names, and a vote's or a cascade's members are other, plain, configured drafters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any, Literal

from .parsing import (
    BACKENDS,
    _bool,
    _choice,
    _describe,
    _dtype,
    _Errors,
    _int,
    _Invalid,
    _join,
    _num,
    _optional,
    _path,
    _pattern,
    _Section,
    _take,
    _texts,
)


LOOKAHEAD = 3  # default guessed tokens per draft forward of an early_exit drafter (drafters/model.py)

_drafter_name_text = _pattern(r"[A-Za-z0-9_.-]+", "a name matching [A-Za-z0-9_.-]+")


def _drafter_name(value: Any) -> str:
    """A drafter name: ``[A-Za-z0-9_.-]+`` and not the reserved ``none``."""
    name = _drafter_name_text(value)
    if name == "none":
        raise _Invalid("'none' is reserved and cannot be a drafter name")
    return name


@dataclass(frozen=True, kw_only=True)
class EarlyExitDrafterConfig:
    """Draft with the target's first ``layers`` layers (self-speculation); with ``quantize: int8``, an int8
    copy of them (then ``layers`` defaults to all of them). ``lookahead``: tokens guessed from the text that
    each draft forward checks besides its real one (drafters/model.py); 0 turns it off."""

    name: str
    kind: Literal["early_exit"] = "early_exit"
    layers: int | None = None
    quantize: Literal["none", "int8"] = "none"
    lookahead: int = LOOKAHEAD

    @classmethod
    def _parse(cls, s: _Section, name: str) -> EarlyExitDrafterConfig:
        # The upper bound (the number of target layers) is checked once the model is known.
        layers = s.take("layers", _optional(_int(lo=1)))
        quantize = s.take("quantize", _choice("none", "int8"))
        lookahead = s.take("lookahead", _int(lo=0, hi=8))
        if s.ok("layers", "quantize") and layers is None and quantize == "none":
            s.errs.add(s.key_path("layers"), "missing required key (with quantize: int8 it defaults to all of "
                       "the target's layers)")
        return cls(name=name, layers=layers, quantize=quantize, lookahead=lookahead)


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
