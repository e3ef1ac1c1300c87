"""A job's engine: the target and drafters loaded on their backends, their caches, the policy and the
BatchLoop; the prompt encoder; what each model runs on (summary.json's `backends`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import (
    COMPOSITE_KINDS,
    CascadeDrafterConfig,
    EarlyExitDrafterConfig,
    JobConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    VoteDrafterConfig,
)
from .drafters.base import Drafter
from .drafters.cascade import CascadeDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.model import FeatureDrafter, ModelDrafter
from .drafters.ngram import NgramDrafter
from .drafters.vote import VoteDrafter
from .engine.logprobs import LogprobAsk
from .grammars import structured_from
from .memory import SelectionMemory, memory_key, recall
from .engine.controls import LogitControls
from .engine.loop import BatchLoop, LoopSettings
from .engine.prefix_cache import PrefixCache
from .models import cpu_plan, loader
from .models.distilled import TargetFeatures, draft_meta, load_draft
from .models.hf_backend import TransformersModel
from .models.llama import LlamaModel
from .records import Request, RowParams
from .sampling import SamplingParams
from .selection.factory import make_policy
from .stats import RunStats


# -- building the engine ---------------------------------------------------------------


@dataclass
class Engine:
    model_dir: Path
    target: LlamaModel
    tokenizer: object
    loop: BatchLoop
    load_time_s: float
    memory: SelectionMemory | None = None  # the selection memory the loop starts from and saves into (memory.py)


def eos_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """The ids that end a completion: the tokenizer's eos token, plus the eos_token_id (an int or a list)
    that transformers' generate stops at: generation_config.json's where the folder has one, else
    config.json's (GenerationConfig.from_pretrained falls back to config.json, as from_model_config does)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_cfg = Path(model_dir) / "generation_config.json"
    source = gen_cfg if gen_cfg.exists() else Path(model_dir) / "config.json"
    e = json.loads(source.read_text()).get("eos_token_id")
    ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return frozenset(ids)


#: generation_config.json keys vLLM takes as the defaults of a request's omitted fields, -> RowParams fields
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty"}


def generation_defaults(model_dir: Path) -> RowParams:
    """What an OpenAI line's omitted sampling fields take, as vLLM's defaults: the model folder's
    generation_config.json values (temperature, top_p, top_k, min_p, repetition_penalty; do_sample is
    not read, as vLLM does not), else temperature 1.0 (vLLM's and OpenAI's default) and the fields off.
    A value out of its range is passed over."""
    path = Path(model_dir) / "generation_config.json"
    try:
        given = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        given = {}
    ok = {"temperature": lambda x: x >= 0, "top_p": lambda x: 0 < x <= 1, "top_k": lambda x: x >= -1,
          "min_p": lambda x: 0 <= x <= 1, "repetition_penalty": lambda x: x > 0}
    found = {}
    for key, name in GENERATION_KEYS.items():
        v = given.get(key) if isinstance(given, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and ok[key](v):
            found[name] = max(int(v), 0) if key == "top_k" else float(v)
    return RowParams(**{"temperature": 1.0, **found})


def make_encoder(tokenizer, job: JobConfig) -> Callable[[Request], list[int]]:
    """Request -> prompt token ids; raises ValueError for a row that cannot be encoded (an OpenAI line
    naming a model the job does not serve among them, with vLLM's words)."""
    icfg = job.input
    served = job.target.served_names
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if icfg.chat_template is True and not has_template:
        raise ValueError("input.chat_template is true but the target tokenizer has no chat template")
    template_prompts = icfg.chat_template is True or (icfg.chat_template == "auto" and has_template)
    # A token covers at most as many characters as its vocabulary string has (a byte-level token's
    # string has one character per byte, an added token's is its text), so a text longer than
    # (max_model_len - 1) x the longest cannot fit. It is turned away before tokenizing, whose time
    # and memory grow with the text (a 20 MB prompt took 40 s and 4 GB to be told it was too long).
    longest = max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)
    max_chars = (job.batch.max_model_len - 1) * longest

    def tokenize(text: str, **kwargs) -> list[int]:
        if len(text) > max_chars:
            raise ValueError(f"prompt has {len(text)} characters, more than max_model_len {job.batch.max_model_len} "
                             f"can hold ({job.batch.max_model_len - 1} tokens of at most {longest} characters, the "
                             "longest in this tokenizer's vocabulary); not tokenized")
        return tokenizer.encode(text, **kwargs)

    def render(messages: list[dict], kwargs: dict | None) -> list[int]:
        if not has_template:
            raise ValueError("row has messages but the target tokenizer has no chat template")
        if icfg.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": icfg.system_prompt}] + messages
        extra = {"add_generation_prompt": True, **(kwargs or {}), "tokenize": False}
        try:
            text = tokenizer.apply_chat_template(messages, **extra)
        except Exception as e:  # a template may raise anything (jinja errors, role checks)
            raise ValueError(f"chat template failed: {e}") from e
        return tokenize(text, add_special_tokens=False)

    def encode(req: Request) -> list[int]:
        if req.endpoint is not None and req.model and req.model not in served:
            raise ValueError(f"The model `{req.model}` does not exist. (spin-batch serves "
                             f"{', '.join(f'`{n}`' for n in served)}: target.served_model_name names them)")
        kwargs = icfg.chat_template_kwargs if req.params.chat_template_kwargs is None else req.params.chat_template_kwargs
        if req.messages is not None:
            ids = render([dict(m) for m in req.messages], kwargs)
        elif template_prompts and req.endpoint != "completion":  # an OpenAI /v1/completions prompt is raw text
            ids = render([{"role": "user", "content": req.prompt}], kwargs)
        else:
            ids = tokenize(req.prompt)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        return ids

    return encode


def distilled_draft_dtype(target_dtype: str, device: torch.device) -> str:
    """A distilled draft's default dtype: bfloat16 where bf16 matmuls are native (GPUs with bf16,
    CPUs with AVX512-BF16/AMX), which halves the weights it streams per draft token; else the
    target's. A draft's precision never changes the output, only how often its tokens are accepted."""
    return "bfloat16" if loader.native_bf16(device) else target_dtype


def build_drafters(job: JobConfig, target: LlamaModel, target_cache, device: torch.device) -> dict[str, Drafter]:
    drafters: dict[str, Drafter] = {}
    features: TargetFeatures | None = None  # shared by the drafters that read the target's features
    embeds: dict[torch.dtype, torch.Tensor] = {}  # the target's embedding per draft dtype, shared by drafts
    for d in job.drafters:
        if isinstance(d, EarlyExitDrafterConfig):
            model = target
            if d.quantize == "int8":
                if not isinstance(target, LlamaModel):
                    raise ValueError(f"drafter {d.name!r}: quantize: int8 copies a native target's weights")
                state = loader.load_state_dict(loader.resolve_model_dir(job.target.model))
                model = target.int8_copy(state, d.layers)
                del state
            drafters[d.name] = EarlyExitDrafter(d.name, target, target_cache, d.layers, model, d.lookahead)
        elif isinstance(d, ModelDrafterConfig):
            draft_dir = loader.resolve_model_dir(d.model)
            meta = draft_meta(draft_dir)
            loop = cpu_plan.workloads(job.batch.slots, 0)  # a draft decodes one token a slot at a time
            if meta is not None and not isinstance(target, LlamaModel):
                raise ValueError(f"drafter {d.name!r}: a distilled draft runs next to a native target only")
            if meta is not None:  # distilled: reads the target's embeddings (and maybe its features)
                dtype = d.dtype or distilled_draft_dtype(job.target.dtype, device)
                model = load_draft(draft_dir, target, loader.DTYPES[dtype], device, embeds, loop)
            else:
                model = loader.load_model(draft_dir, d.dtype or job.target.dtype, device, loop,
                                          execution=target.plan.execution, backend=d.backend,
                                          trust_remote_code=d.trust_remote_code)
            if model.spec.vocab_size != target.spec.vocab_size:
                raise ValueError(f"drafter {d.name!r}: vocab size {model.spec.vocab_size} differs from the "
                                 f"target's {target.spec.vocab_size}")
            cache = model.allocate_cache(job.batch.slots, job.batch.max_model_len)
            if model.feature_head is not None:
                if features is None:
                    features = TargetFeatures(job.batch.slots, job.batch.max_model_len, target.spec.hidden_size,
                                              target.spec.rms_norm_eps, target.dtype, device)
                drafters[d.name] = FeatureDrafter(d.name, model, cache, features)
            else:
                drafters[d.name] = ModelDrafter(d.name, model, cache)
        elif isinstance(d, NgramDrafterConfig):
            drafters[d.name] = NgramDrafter(d.name, d.min_ngram, d.max_ngram)
        elif d.kind not in COMPOSITE_KINDS:  # a kind added to config/drafters.py but not here
            raise ValueError(f"drafter kind {d.kind!r} has no implementation")
    for d in job.drafters:  # votes and cascades last: they reuse the drafters above
        members = {m: drafters[m] for m in getattr(d, "members", ())}
        if isinstance(d, VoteDrafterConfig):
            drafters[d.name] = VoteDrafter(d.name, members, d.beta, job.batch.slots)
        elif isinstance(d, CascadeDrafterConfig):
            drafters[d.name] = CascadeDrafter(d.name, members, d.min_tokens)
    return {d.name: drafters[d.name] for d in job.drafters}


def loop_settings(job: JobConfig, eos: frozenset[int], device: torch.device,
                  generation: RowParams | None = None) -> LoopSettings:
    """The loop's settings from the job; ``generation``: the model's generation defaults
    (generation_defaults), which OpenAI lines' omitted fields take with sampling.openai_defaults: model."""
    s = job.sampling
    pipeline = job.spin.pipeline == "on"  # auto: off (docs/gpu.md: two target forwards a step never paid)
    return LoopSettings(
        slots=job.batch.slots,
        max_model_len=job.batch.max_model_len,
        max_num_batched_tokens=job.batch.max_num_batched_tokens,
        max_tokens=s.max_tokens,
        sampling=SamplingParams(s.temperature, s.top_k, s.top_p, sampler=s.sampler),
        seed=s.seed,
        stop=s.stop,
        ignore_eos=s.ignore_eos,
        eos_token_ids=eos,
        pipeline=pipeline,
        logprobs=LogprobAsk(s.logprobs, s.prompt_logprobs, s.logprobs_mode == "processed_logprobs"),
        stop_token_ids=frozenset(s.stop_token_ids),
        min_tokens=s.min_tokens,
        controls=LogitControls(s.min_p, s.logit_bias, s.repetition_penalty, s.presence_penalty, s.frequency_penalty),
        openai_defaults=generation if s.openai_defaults == "model" else None,
        n=s.n,
        structured=structured_from(s.structured, "sampling.structured"),
    )


def prefix_exact(target) -> bool:
    """Whether a reused K/V row is the one a prefill would write: the target's rows are batch-invariant
    (the whole decoder in C, docs/kernels.md), not on torch's GEMMs, Triton or the transformers backend."""
    return isinstance(target, LlamaModel) and target.path == "c_decoder"


def make_prefix_cache(job: JobConfig, target) -> PrefixCache | None:
    """The job's prefix cache: batch.prefix_cache on, or auto where reuse is exact (prefix_exact); else None."""
    mode = job.batch.prefix_cache
    if mode == "off" or (mode == "auto" and not prefix_exact(target)):
        return None
    return PrefixCache(job.batch.prefix_cache_mb << 20)


def int8_target(target, target_dir: Path) -> LlamaModel:
    """target.quantize: int8: the target's int8 copy (every logit from its int8 head) in its place; the float32
    or bfloat16 layers are dropped."""
    if not isinstance(target, LlamaModel) or not target.plan.c_library:
        raise ValueError("target.quantize: int8 runs on the C int8 GEMM: the native backend on CPU with the C "
                         "kernels (target.kernels auto or c; `spin-batch env` says whether they build here)")
    state = loader.load_state_dict(target_dir)
    return target.int8_copy(state, draft=False)


def build_engine(job: JobConfig, stats: RunStats | None = None) -> Engine:
    t0 = time.perf_counter()
    if job.target.dtype == "auto":  # where the caller has not resolved it (preflight.resolve_dtype does)
        auto = loader.auto_dtype(loader.resolve_device(job.target.device), job.target.c_kernels_allowed)[0]
        job = replace(job, target=replace(job.target, dtype=auto))
    device = loader.resolve_device(job.target.device)
    target_dir = loader.resolve_model_dir(job.target.model)
    tokenizer = loader.load_tokenizer(target_dir, job.target.trust_remote_code)
    loop = cpu_plan.workloads(job.batch.slots, job.spin.num_speculative_tokens if job.drafters else 0)
    target = loader.load_model(target_dir, job.target.dtype, device, loop,
                               execution=loader.resolve_execution(job.target.kernels, device),
                               backend=job.target.backend, trust_remote_code=job.target.trust_remote_code)
    if job.target.quantize == "int8":
        target = int8_target(target, target_dir)
    cache = target.allocate_cache(job.batch.slots, job.batch.max_model_len)
    drafters = build_drafters(job, target, cache, device)
    policy = make_policy(job.spin.selector, drafters, job.spin.num_speculative_tokens, job.sampling.seed,
                         job.spin.confidence_gate, backoff=job.spin.backoff, tree_nodes=job.spin.tree_nodes,
                         target_trees=target.tree_segments)
    memory = SelectionMemory(memory_key(job, target, target_dir)) if job.spin.warm_start and drafters else None
    if memory is not None:
        recall(memory, policy)
    settings = loop_settings(job, eos_ids(target_dir, tokenizer), device, generation_defaults(target_dir))
    loop = BatchLoop(target, tokenizer, settings, policy, drafters, cache, stats, make_prefix_cache(job, target),
                     remember=memory.save if memory is not None else None)
    return Engine(target_dir, target, tokenizer, loop, time.perf_counter() - t0, memory)


def prefix_summary(prefix: PrefixCache | None) -> dict:
    """summary.json's `prefix_cache`: whether it ran, its budget and what it held and did."""
    if prefix is None:
        return {"enabled": False}
    return {"enabled": True, "budget_mb": prefix.budget_bytes / 2**20, "used_mb": prefix.used_bytes / 2**20,
            "blocks": len(prefix), "block_tokens": prefix.block, "blocks_stored": prefix.stored,
            "blocks_evicted": prefix.evicted, "tokens_reused": prefix.reused}


def backends(engine: Engine) -> dict:
    """Which backend and path each model runs on and why (native: cpu_plan.py, execution.py; transformers:
    hf_backend.py): the target's, and each model drafter's."""
    out = {"target": model_backend(engine.target)}
    for name, d in engine.loop.drafters.items():
        model = getattr(d, "model", None)
        if isinstance(model, (LlamaModel, TransformersModel)) and model is not engine.target:
            out[name] = model_backend(model)
    return out


def model_backend(model: LlamaModel | TransformersModel) -> dict:
    """A model's backend() led by the backend's name (a TransformersModel's names itself)."""
    return {"backend": loader.NATIVE, **model.backend()}
