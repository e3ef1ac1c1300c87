"""`spin-batch validate`, and the checks every run makes first: the job, its input, its output folder and
its models (config, tokenizer, checkpoint headers, backend, kernels), all before any weights load."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import EarlyExitDrafterConfig, JobConfig, ModelDrafterConfig
from .drafters.early_exit import check_layers
from .io.checks import check_columns, check_input
from .io.rows import input_spec
from .io.shards import InputError, list_shards
from .models import capacity, cpu_decoder, loader
from .models.distilled import check_pairing, draft_meta
from .models.hf_arch import read_config_json
from .models.spec import window_problem


# -- checks that need no weights -------------------------------------------------------


def dir_problem(path: Path) -> list[str]:
    """Why `path` cannot be made a directory to write in (it, or a folder above it, is a file; it, or
    the folder it would be made in, is not writable), if it cannot."""
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                return [f"{p} exists and is not a directory"]
            if not os.access(p, os.W_OK | os.X_OK):
                return [f"{p} is not writable" if p == path else f"cannot create {path}: {p} is not writable"]
            return []
    return []


def check_output(job: JobConfig) -> list[str]:
    """Whether output.dir can be a directory this process writes in."""
    return [f"output.dir: {p}" for p in dir_problem(Path(job.output.dir))]


def quantize_problems(job: JobConfig, backend: str, device: torch.device) -> list[str]:
    """Why target.quantize cannot run here: it needs the native backend on CPU with the C kernels, a float32 or
    bfloat16 checkpoint to quantize, and no drafter that is the target's int8 copy (the target already is)."""
    t = job.target
    problems = []
    if backend != loader.NATIVE or device.type != "cpu" or t.kernels not in ("auto", "c"):
        problems.append(f"target.quantize: {t.quantize} runs on the C int8 GEMM: the native backend on CPU with "
                        f"target.kernels auto or c (here: backend {backend}, device {device.type}, kernels {t.kernels})")
    elif loader.resolve_execution(t.kernels, device).cpu == "torch" or cpu_decoder.library() is None:
        problems.append(f"target.quantize: {t.quantize} runs on the C int8 GEMM, and the C kernels do not run here "
                        f"({loader.ENV_CPU}=off, or no C compiler: `spin-batch env` says which)")
    if t.dtype != "auto" and loader.DTYPES[t.dtype] not in (torch.float32, torch.bfloat16):
        problems.append(f"target.quantize: {t.quantize} quantizes float32 or bfloat16 weights; target.dtype is {t.dtype}")
    problems += [f"drafters.{d.name}: quantize: {d.quantize} is the target's own int8 copy, and with target.quantize: "
                 f"{t.quantize} the target already is that copy: drop this drafter (an early_exit drafter with layers "
                 "drafts with the int8 target's first layers)"
                 for d in job.drafters if isinstance(d, EarlyExitDrafterConfig) and d.quantize != "none"]
    return problems


def check_models(job: JobConfig) -> list[str]:
    """Model-level problems of a job, without loading weights: the device, missing or unreadable model
    folders, checkpoints whose tensors do not fit their config.json (safetensors headers only), missing
    or empty tokenizers, a context past the model's positions, its sliding window or the memory its KV
    cache needs, early-exit depth, tokenizer mismatch, draft pairing."""
    try:
        device = loader.resolve_device(job.target.device)
    except RuntimeError as e:
        return [f"target.device: {e}"]
    try:  # the kernels target.kernels asks for (and the environment's overrides) can run here
        loader.resolve_execution(job.target.kernels, device)
    except loader.ExecutionError as e:
        return [str(e)]
    target = job.target
    problems = loader.check_model_ref(target.model, target.backend, target.trust_remote_code,
                                      job.batch.max_model_len)
    if problems:
        return problems
    target_dir = loader.resolve_model_dir(job.target.model)
    if draft_meta(target_dir) is not None:
        return [f"target.model: {job.target.model} is a distilled draft; it runs only as a `kind: model` drafter "
                "next to the target it was distilled for"]
    problems += context_problems(job, target_dir, device)
    backend = loader.resolve_backend(target.backend, target_dir)
    if backend == loader.TRANSFORMERS and target.kernels == "c":
        problems.append("target.kernels: c is the native decoder's C path; the transformers backend runs "
                        "transformers' own layers (use auto or torch)")
    if backend == loader.NATIVE:
        spec = loader.read_spec(target_dir)
        window = window_problem(spec, job.batch.max_model_len)
        if window:
            problems.append(f"target.model: {window}; set batch.max_model_len to {spec.sliding_window} or less, "
                            "or target.backend: transformers")
    if target.quantize != "none":
        problems += quantize_problems(job, backend, device)
    try:
        target_vocab = loader.load_tokenizer(target_dir, target.trust_remote_code).get_vocab()
    except loader.TokenizerError as e:
        problems.append(f"target.model: {e}")
        target_vocab = None
    for d in job.drafters:
        if isinstance(d, EarlyExitDrafterConfig):
            p = None if d.layers is None else check_layers(
                d.layers, loader.model_layers(target_dir, backend, target.trust_remote_code))
            if p:
                problems.append(f"drafters.{d.name}: {p}")
            if d.quantize != "none" and backend != loader.NATIVE:
                problems.append(f"drafters.{d.name}: quantize: {d.quantize} copies a native target's weights "
                                "(target.backend: auto or native)")
            elif d.quantize != "none" and device.type == "cuda":
                problems.append(f"drafters.{d.name}: quantize: {d.quantize} has no int8 kernel on CUDA (it would "
                                "round in float, costing more than the target): drop this drafter on a GPU")
            elif d.quantize != "none" and device.type == "cpu" and loader.DTYPES[target.dtype] not in (
                    torch.float32, torch.bfloat16):
                problems.append(f"drafters.{d.name}: quantize: {d.quantize} runs on the C int8 GEMM with a float32 "
                                f"or bfloat16 target only; with target.dtype {target.dtype} on CPU its weights would "
                                "be widened every step, slower than the target itself (use float32 or bfloat16, or "
                                "drop this drafter)")
        elif isinstance(d, ModelDrafterConfig):
            refs = loader.check_model_ref(d.model, d.backend, d.trust_remote_code, job.batch.max_model_len)
            if refs:
                problems.extend(f"drafters.{d.name}: {r}" for r in refs)
                continue
            draft_dir = loader.resolve_model_dir(d.model)
            if draft_meta(draft_dir) is None:  # a plain model: its own context limit (a draft's is its target's)
                problems += [f"drafters.{d.name}: {p}" for p in context_problems(job, draft_dir, None)]
            if loader.resolve_backend(d.backend, draft_dir) == loader.NATIVE:
                window = window_problem(loader.read_spec(draft_dir), job.batch.max_model_len)
                if window:
                    problems.append(f"drafters.{d.name}: {window}")
            if draft_meta(draft_dir) is not None and backend != loader.NATIVE:
                problems.append(f"drafters.{d.name}: a distilled draft reads the target's embeddings and runs next "
                                "to a native target only (target.backend: auto or native)")
                continue
            if draft_meta(draft_dir) is None:  # a plain model: its token ids must mean the target's tokens
                try:
                    draft_vocab = loader.load_tokenizer(draft_dir, d.trust_remote_code).get_vocab()
                except loader.TokenizerError as e:
                    problems.append(f"drafters.{d.name}: {e} (needed to check it against the target's)")
                    continue
                if target_vocab is not None and draft_vocab != target_vocab:
                    problems.append(f"drafters.{d.name}: tokenizer of {d.model} does not match the target's tokenizer")
                continue
            # a distilled draft reads the target's tokens and embeddings: the fingerprint pairs them
            try:
                why = check_pairing(draft_dir, target_dir)
            except ValueError as e:  # the target has no embeddings a draft can pair with
                why = str(e)
            if why is not None:
                problems.append(f"drafters.{d.name}: {why}")
    return problems


def resolve_dtype(job: JobConfig, say=None) -> JobConfig:
    """The job with target.dtype auto replaced by what it means here (loader.auto_dtype); `say` gets one line saying
    which and why. Any other dtype: the job as it is."""
    if job.target.dtype != "auto":
        return job
    from dataclasses import replace

    dtype, why = loader.auto_dtype(loader.resolve_device(job.target.device), job.target.c_kernels_allowed)
    if say is not None:
        say(f"spin-batch: target.dtype auto -> {dtype}: {why}")
    return replace(job, target=replace(job.target, dtype=dtype))


def fit_context(job: JobConfig) -> JobConfig:
    """The job with batch.max_model_len lowered to the target's position limit where the job left it at
    its default and the model takes fewer positions (vLLM, too, takes the model's own length unless
    told). A value the job sets past the limit stays, for context_problems to refuse."""
    from dataclasses import replace

    from .config.sections import BatchConfig

    if job.batch.max_model_len != BatchConfig.max_model_len:
        return job
    try:
        cfg = read_config_json(loader.resolve_model_dir(job.target.model))
    except Exception:  # check_models names a missing or unreadable model folder
        return job
    limit = capacity.position_limit(cfg) if isinstance(cfg, dict) else None
    if limit is None or limit[0] >= job.batch.max_model_len:
        return job
    return replace(job, batch=replace(job.batch, max_model_len=limit[0]))


def context_problems(job: JobConfig, model_dir: Path, device: torch.device | None) -> list[str]:
    """batch.max_model_len against a model folder's config.json (models/capacity.py): no more positions than
    the model takes, and on ``device`` (None: not checked) a KV cache for batch.slots that fits in memory
    beside the weights."""
    try:
        cfg = read_config_json(model_dir)
    except (OSError, ValueError):  # check_model_ref reports an unreadable config.json
        return []
    if not isinstance(cfg, dict):
        return []
    free = capacity.available_memory(device) if device is not None else None
    problem = capacity.context_problem(cfg, model_dir, job.batch.max_model_len, job.batch.slots,
                                       loader.DTYPES[job.target.dtype], free)
    return [f"batch.max_model_len: {problem}"] if problem else []


def validate_job(job: JobConfig, check_models_too: bool = True) -> list[str]:
    """Everything `spin-batch validate` checks: input files and rows, then models."""
    try:
        shards = list_shards(job.input.paths, job.input.format)
    except ValueError as e:
        return [str(e)]
    spec = input_spec(job.input, job.output.keep_columns)
    problems = check_input(shards, spec, max_line_bytes=job.input.max_line_bytes)
    try:  # a column that none of the first rows of the first JSONL shard has (check_input counts bad rows)
        check_columns([p for p in shards if p.suffix != ".parquet"], spec, max_line_bytes=job.input.max_line_bytes)
    except InputError as e:
        problems.append(str(e))
    problems += check_output(job)
    if check_models_too:
        problems += check_models(job)
    return problems


def model_backends(job: JobConfig) -> dict[str, str]:
    """The backend each model of a job will run on (validate says it), for a job check_models passed."""
    out = {"target": loader.resolve_backend(job.target.backend, loader.resolve_model_dir(job.target.model))}
    for d in job.drafters:
        if isinstance(d, ModelDrafterConfig):
            out[d.name] = loader.resolve_backend(d.backend, loader.resolve_model_dir(d.model))
    return out


