"""Job configuration: YAML -> frozen dataclasses, validated before any model loads.

A job file is parsed with PyYAML's safe loader (:mod:`.safe_yaml`: a key given twice, or anchors and
aliases that expand past a bound, are refused), optional ``--set KEY=VALUE`` overrides are applied, and the result is checked field by field. Every problem
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

The package: ``parsing`` (errors, value checks, the section reader, ``~``/``$VAR`` expansion),
``sections`` (input, output, target, spin, batch, sampling), ``drafters`` (the drafter kinds and
the ``drafters`` list), ``overrides`` (``--set``); this module holds the job and its cross-section
checks, and imports the others (never the other way).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from .drafters import (
    COMPOSITE_KINDS,
    DRAFTER_KINDS,
    CascadeDrafterConfig,
    DrafterConfig,
    EarlyExitDrafterConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    VoteDrafterConfig,
    _parse_drafters,
)
from .overrides import _apply_overrides, apply_overrides
from .parsing import DTYPE_ALIASES, ConfigError, _describe, _Errors, _Invalid, _optional, _Section, _text
from .safe_yaml import YamlRefused, load_yaml
from .sections import (
    SELECTOR_GRAMMAR,
    BatchConfig,
    InputConfig,
    OutputConfig,
    SamplingConfig,
    SpinConfig,
    TargetConfig,
    _resolve_selector,
)

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
    "COMPOSITE_KINDS",
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
        raw = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid job {source}: YAML syntax error", [str(exc)]) from exc
    except YamlRefused as exc:
        raise ConfigError(f"invalid job {source}:", [str(exc)]) from None
    except RecursionError:
        raise ConfigError(f"invalid job {source}:", ["lists or mappings nested too deeply"]) from None
    return parse_job({} if raw is None else raw, overrides, source=source)


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
