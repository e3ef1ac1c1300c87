"""What the native decoder reads from a model folder: ModelSpec from config.json, and the checkpoint rule.

ModelSpec holds the architecture facts of a Llama-family config.json (Llama 2/3, Mistral, Qwen2,
SmolLM) and refuses what the decoder (llama.py) does not run; window_problem says when a cache is
longer than a sliding window. The checkpoint rule (expected_tensors, tensor_problem) says which
tensors the decoder reads, for loading and for `validate`, which reads only safetensors headers.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


class CheckpointError(ValueError):
    """A model folder's weights cannot be used as they are: a safetensors file is unreadable, or its
    tensors are not the ones config.json's architecture reads (a tensor missing, or one the decoder
    would not use: dropping it gives wrong text)."""


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts read from a Hugging Face config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    sliding_window: int | None
    o_bias: bool = False  # o_proj has a bias (Llama's attention_bias; Qwen2 biases q/k/v only)

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelSpec":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else rope
        if scaling is not None and rope_type not in ("linear", "llama3"):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        # transformers reads attention_bias for Llama only (q, k, v and o); Mistral and Qwen2 ignore it
        attention_bias = model_type == "llama" and bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            sliding_window=window,
            o_bias=attention_bias,
        )


def window_problem(spec: ModelSpec, max_len: int) -> str | None:
    """Why a cache of max_len positions does not fit the model (a context past its sliding window), or None."""
    if spec.sliding_window is not None and max_len > spec.sliding_window:
        return (f"max_model_len {max_len} exceeds the model's sliding window {spec.sliding_window}; "
                "sliding-window attention is not implemented")
    return None


# -- which checkpoint tensors the decoder reads ------------------------------------------------
#
# One rule, used where a checkpoint loads (LlamaModel.from_state_dict, models/distilled.py's load_draft)
# and where `validate` reads only the safetensors headers (loader.check_model_ref): every tensor of the
# checkpoint is read, and every tensor read is there. A tensor we would not read (a q_norm, an
# unexpected bias, quantization scales) means an architecture we do not run: its text would be wrong.

EMBED_TENSOR = "model.embed_tokens.weight"
HEAD_TENSOR = "lm_head.weight"
# Tensors transformers also ignores when it loads (buffers recomputed from config.json; older Llama
# checkpoints saved the rotary inverse frequencies of each layer).
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
NAMES_SHOWN = 3  # a problem names this many tensors, plus a count of the rest


def layer_tensors(spec: ModelSpec) -> set[str]:
    """The tensors layers_from_state_dict reads: every decoder layer's."""
    names = set()
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        names.update(p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                     "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))
        names.update(p + f"self_attn.{n}_proj.weight" for n in "qkvo")
        if spec.qkv_bias:
            names.update(p + f"self_attn.{n}_proj.bias" for n in "qkv")
        if spec.o_bias:
            names.add(p + "self_attn.o_proj.bias")
    return names


def expected_tensors(spec: ModelSpec, present) -> set[str]:
    """The tensors from_state_dict reads from a checkpoint whose tensor names are `present`.

    Untied (tie_word_embeddings false): the embeddings and lm_head.weight, both. Tied, as transformers
    loads it (PreTrainedModel.tie_weights): lm_head.weight is read where the checkpoint has it (saved
    with values of its own, transformers does not tie them; saved equal, it makes no difference), and
    one of the two serves as both where only one is there."""
    names = layer_tensors(spec) | {"model.norm.weight"}
    if not spec.tie_word_embeddings:
        return names | {EMBED_TENSOR, HEAD_TENSOR}
    return names | ({EMBED_TENSOR, HEAD_TENSOR} & set(present) or {EMBED_TENSOR})


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in name.split(".")]


def _few(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown if len(names) <= NAMES_SHOWN else f"{shown} and {len(names) - NAMES_SHOWN} more"


def tensor_problem(spec: ModelSpec, expected: set[str], present) -> str | None:
    """What is wrong with a checkpoint holding `present` (names) where `expected` are read, or None."""
    present = set(present)
    missing = sorted(expected - present, key=_natural)
    unused = sorted((n for n in present - expected if not n.endswith(IGNORED_TENSOR_SUFFIXES)), key=_natural)
    if not missing and not unused:
        return None
    what = [f"{spec.model_type}, {spec.num_layers} layer{'s' if spec.num_layers != 1 else ''}"]
    if spec.qkv_bias or spec.o_bias:
        what.append("q/k/v" + ("/o" if spec.o_bias else "") + " biases")
    what.append(f"tie_word_embeddings {str(spec.tie_word_embeddings).lower()}")
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor{'s' if len(missing) > 1 else ''} missing: {_few(missing)}")
    if unused:
        parts.append(f"{len(unused)} tensor{'s' if len(unused) > 1 else ''} the decoder would not use "
                     f"(a different architecture; its text would be wrong): {_few(unused)}")
    return f"weights do not match config.json ({', '.join(what)}): {'; '.join(parts)}"
