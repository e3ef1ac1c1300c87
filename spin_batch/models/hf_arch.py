"""Whether the transformers backend (hf_backend.py) can run a model folder, and if not, why.

Three levels, cheapest first, all without reading weights:
1. config.json: a model type transformers knows (or remote code the job trusts), a decoder-only causal
   LM, no recurrent or state-space layers, no attention sinks, no quantized weights.
2. The model class: it routes attention through transformers' AttentionInterface
   (`is_backend_compatible`); a class that computes attention itself would never call ours.
3. The probe: the model built on the meta device (no memory, no weights) runs one two-token forward on
   packed_attention in probe mode. Every layer must call it once, with K and V of one shape, and ask
   for nothing the packed attention refuses (hf_attention.refusal). The same probe runs again with the
   weights at load (TransformersModel.load), where it also gives the cache's heads and head size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .hf_attention import ATTN_IMPLEMENTATION, STATE_KWARG, PackedPass, register
from .segments import Segments
from .spec import UnsupportedModelError

# Model types whose layers keep a recurrent or state-space state instead of (or beside) a KV cache.
RECURRENT_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "jamba", "zamba", "zamba2", "bamba",
    "falcon_h1", "granitemoehybrid", "nemotron_h", "lfm2", "lfm2_moe", "qwen3_next", "xlstm", "minimax",
    "plamo2", "mamba_ssm", "hymba", "gated_deltanet", "kimi_linear",
})
# layer_types entries that are attention the packed attention runs (sliding windows are masks over a full cache)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
SINK_TYPES = frozenset({"gpt_oss"})  # models whose attention has learned sink logits


@dataclass(frozen=True)
class ProbeResult:
    """What one probe forward showed: the K/V shape every layer writes and what the calls asked for."""

    num_layers: int  # layers that attended (each exactly once)
    kv_heads: int
    head_dim: int
    features: frozenset[str]  # "sliding_window", "softcap"


def read_config_json(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def remote_code_problem(raw: dict, trust_remote_code: bool) -> str | None:
    """Why transformers cannot build this config without code from the folder (and the job does not trust it)."""
    from transformers import CONFIG_MAPPING, __version__

    model_type = raw.get("model_type")
    if model_type in CONFIG_MAPPING:
        return None
    if raw.get("auto_map"):
        if trust_remote_code:
            return None
        return (f"model_type {model_type!r} is not in transformers {__version__}; the folder ships its own modelling "
                "code (auto_map), which runs only with trust_remote_code: true")
    return f"model_type {model_type!r} is not known to transformers {__version__} (and the folder has no auto_map code)"


def load_config(model_dir: Path, trust_remote_code: bool):
    """transformers' config object for the folder (raises UnsupportedModelError with the reason)."""
    from transformers import AutoConfig

    problem = remote_code_problem(read_config_json(model_dir), trust_remote_code)
    if problem:
        raise UnsupportedModelError(problem)
    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # transformers raises ValueError, KeyError, OSError... for a config it cannot read
        raise UnsupportedModelError(f"transformers cannot read its config.json ({first_line(e)})") from None


def config_problem(config) -> str | None:
    """Why the architecture config.json describes cannot run on the packed attention, from the config alone."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        return f"{model_type} is an encoder-decoder model; only decoder-only causal LMs run"
    if getattr(config, "add_cross_attention", False):
        return f"{model_type} has cross-attention layers (add_cross_attention); only decoder-only causal LMs run"
    if getattr(config, "is_causal", True) is False:
        return f"{model_type} is configured non-causal (is_causal false)"
    if model_type in RECURRENT_TYPES:
        return f"{model_type} has recurrent or state-space layers, which keep no KV cache"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return (f"{model_type} has layers of type {', '.join(map(str, other))}; the packed attention runs "
                "full and sliding-window attention only")
    if model_type in SINK_TYPES:
        return f"{model_type} uses attention sinks, which the packed attention does not implement"
    if getattr(config, "quantization_config", None):
        return "quantized checkpoints (quantization_config) are not supported; use float32/bfloat16/float16 weights"
    return None


def probe(model, device: torch.device | str) -> PackedPass:
    """One two-token forward of `model` (loaded with ATTN_IMPLEMENTATION) on packed_attention in probe mode."""
    seg = Segments.build([(0, 2, 0)], device)
    state = PackedPass(seg, None)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), position_ids=seg.positions[None],
              use_cache=False, **{STATE_KWARG: state})
    return state


def probe_result(state: PackedPass, num_layers: int) -> ProbeResult:
    """The probe's findings; raises UnsupportedModelError where a layer did not attend through us exactly
    once, or where layers or K and V differ in shape."""
    if sorted(state.layers) != list(range(num_layers)):
        seen = len(set(state.layers))
        raise UnsupportedModelError(
            f"{seen} of its {num_layers} layers attend through transformers' attention interface "
            f"(calls by layer: {sorted(state.layers)}); a layer that computes its own attention or keeps other "
            "state would not use the packed cache")
    shapes = set(state.kv_shapes.values())
    if len(shapes) != 1:
        raise UnsupportedModelError(f"its layers give K/V of different shapes {sorted(shapes)}; the cache holds one")
    (k_shape, v_shape), = shapes
    if k_shape != v_shape:
        raise UnsupportedModelError(f"its K {list(k_shape)} and V {list(v_shape)} differ in shape per token "
                                    "(multi-head latent attention?); the cache holds one shape for both")
    return ProbeResult(num_layers, k_shape[0], k_shape[1], frozenset(state.features))


def model_class_problem(model) -> str | None:
    if not type(model).is_backend_compatible():
        return (f"{type(model).__name__} computes attention itself rather than through transformers' attention "
                "interface, so it cannot run on the packed attention and cache")
    return None


def num_layers_of(config) -> int:
    return int(config.num_hidden_layers)


def position_limit(model) -> int | None:
    """The longest context a model with a learned position table takes (GPT-2's wpe, OPT's embed_positions):
    config.max_position_embeddings where the model has an embedding table besides the tokens', else None
    (rotary and other computed positions extend past it)."""
    token_table = model.get_input_embeddings()
    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m is not token_table]
    if not tables:
        return None
    return getattr(model.config, "max_position_embeddings", None)


def context_problem(limit: int | None, max_len: int) -> str | None:
    if limit is not None and max_len > limit:
        return f"max_model_len {max_len} exceeds the model's learned position table ({limit} positions)"
    return None


def check_folder(model_dir: Path, trust_remote_code: bool, max_len: int) -> str | None:
    """Why the transformers backend cannot run this folder at max_len positions, or None. No weights are read:
    the model is built on the meta device and probed there."""
    from transformers import AutoModelForCausalLM

    try:
        config = load_config(model_dir, trust_remote_code)
    except UnsupportedModelError as e:
        return str(e)
    problem = config_problem(config)
    if problem:
        return problem
    register()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION,
                                                     trust_remote_code=trust_remote_code)
    except Exception as e:  # ValueError (no causal LM for this config), ImportError, ...
        return f"transformers cannot build a causal LM from its config ({first_line(e)})"
    model.eval()
    problem = model_class_problem(model) or context_problem(position_limit(model), max_len)
    if problem:
        return problem
    try:
        probe_result(probe(model, "meta"), num_layers_of(config))
    except UnsupportedModelError as e:
        return str(e)
    except Exception:  # a forward that does not run on meta tensors: the probe at load, with the weights, decides
        return None
    return None


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
