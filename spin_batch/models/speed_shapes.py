"""Random-weight models at the sizes GPU users run, for the speed-only bench (bench_speed.py).

Targets: Llama-3.2-1B and Llama-3.1-8B shapes (layers, width, heads, KV heads, FFN, vocabulary 128256, their
llama3 RoPE), and a `tiny` shape for tests, built directly on the device in the requested dtype from seeded
normal weights (no checkpoint). Their text means nothing: they time a step, never judge one.

Drafts, each a token-only LlamaModel that the device step's draft chain runs (engine/device_draft.py):

- the shipped distilled drafts' shapes (examples/drafts/smollm2-135m/*/config.json: layers x width x heads x
  KV heads x FFN, and K, the target ids their head covers). Their sides that face the target take the
  target's width E: the input projection [C, 2E] over the token's embedding (the target's own rows) and the
  target's feature, and the output side [E, C] then [K, E], as models/distilled.py runs a feature-reading
  draft. The target's feature is stood in for by the token's embedding row again (a random target's
  feature means nothing either): the GEMMs have the real drafts' sizes;
- an EAGLE-sized draft: one decoder layer at the target's width (its heads, KV heads and FFN), the same
  [C, 2C] input projection, and the target's own LM head over the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .execution import NATIVE, ModelPlan
from .llama import LayerWeights, Linear, LlamaModel, attention_shape
from .loader import resolve_execution
from .spec import ModelSpec

LLAMA3_VOCAB = 128256


def _llama3(layers: int, hidden: int, heads: int, kv: int, head_dim: int, inter: int, tied: bool,
            factor: float) -> ModelSpec:
    return ModelSpec(model_type="llama", vocab_size=LLAMA3_VOCAB, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=1e-5,
                     rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 8192},
                     tie_word_embeddings=tied, qkv_bias=False, max_position_embeddings=131072, sliding_window=None)


# The targets (their config.json's architecture facts).
SHAPES: dict[str, ModelSpec] = {
    "llama-3.2-1b": _llama3(16, 2048, 32, 8, 64, 8192, tied=True, factor=32.0),
    "llama-3.1-8b": _llama3(32, 4096, 32, 8, 128, 14336, tied=False, factor=8.0),
    "tiny": ModelSpec(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=None, tie_word_embeddings=False, qkv_bias=False, max_position_embeddings=4096,
                      sliding_window=None),
}


@dataclass(frozen=True)
class DraftShape:
    """A draft's decoder (layers x width, heads, KV heads, FFN) and the target ids its head covers (0: all)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


# The shipped distilled drafts (examples/drafts/smollm2-135m/<name>/config.json, "spin_batch_draft"."arch").
SHIPPED_DRAFTS: dict[str, DraftShape] = {
    "d1x128-k1024": DraftShape(1, 128, 2, 1, 384, 1024),
    "d1x192-k2048": DraftShape(1, 192, 3, 1, 512, 2048),
    "d1x384-k4096": DraftShape(1, 384, 6, 2, 1024, 4096),
}
EAGLE = "eagle1"  # the EAGLE-sized draft: one layer at the target's width


def draft_shape(name: str, target: ModelSpec) -> DraftShape:
    """A shipped draft's shape, or the EAGLE-sized one for this target."""
    if name == EAGLE:
        return DraftShape(1, target.hidden_size, target.num_heads, target.num_kv_heads, target.intermediate_size, 0)
    if name not in SHIPPED_DRAFTS:
        raise ValueError(f"no draft shape {name!r} (have: {', '.join([*SHIPPED_DRAFTS, EAGLE])})")
    return SHIPPED_DRAFTS[name]


def _normal(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, std: float = 0.02) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)


def _layers(spec: ModelSpec, plan: ModelPlan, dtype: torch.dtype, device: torch.device) -> list[LayerWeights]:
    C, H, KV, D, inter = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                          spec.intermediate_size)
    ones = dict(dtype=dtype, device=device)
    return [LayerWeights(attn_norm=torch.ones(C, **ones), qkv=Linear(_normal(((H + 2 * KV) * D, C), dtype, device),
                                                                      panel=plan.linears),
                         o=Linear(_normal((C, H * D), dtype, device), panel=plan.linears),
                         mlp_norm=torch.ones(C, **ones),
                         gate_up=Linear(_normal((2 * inter, C), dtype, device), panel=plan.linears),
                         down=Linear(_normal((C, inter), dtype, device), panel=plan.linears))
            for _ in range(spec.num_layers)]


def _plan(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> ModelPlan:
    return ModelPlan.make(NATIVE, dtype, device, resolve_execution("auto", device), heads=attention_shape(spec))


def random_target(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> LlamaModel:
    """A target of SHAPES[shape] with seeded normal weights, built on `device` in `dtype`."""
    spec = SHAPES[shape]
    torch.manual_seed(seed)
    plan = _plan(spec, dtype, device)
    embed = _normal((spec.vocab_size, spec.hidden_size), dtype, device)
    head = embed if spec.tie_word_embeddings else _normal((spec.vocab_size, spec.hidden_size), dtype, device)
    return LlamaModel(spec, embed, _layers(spec, plan, dtype, device), torch.ones(spec.hidden_size, dtype=dtype,
                                                                                    device=device), head, plan=plan)


class FeatureInput:
    """The input side of a draft that reads the target's features: row t is [embedding(x_t); feature], the
    feature stood in for by the embedding row again (width 2E). What LlamaModel reads of an embedding."""

    def __init__(self, embed: torch.Tensor):
        self.table = embed
        self.dtype, self.device = embed.dtype, embed.device
        self.shape = (embed.shape[0], 2 * embed.shape[1])

    def __getitem__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.table[tokens]  # [N, E]
        return torch.cat((rows, rows), dim=-1)  # [N, 2E]


class FeatureLogits:
    """A distilled draft's output side: normed hidden [N, C] -> predicted feature [N, E] -> logits [N, K]."""

    def __init__(self, proj: torch.Tensor, head: torch.Tensor, panel: bool | None):
        self.proj, self.head = Linear(proj, panel=panel), Linear(head, panel=panel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def random_draft(name: str, target: LlamaModel, seed: int = 1) -> LlamaModel:
    """The draft `name` (SHIPPED_DRAFTS or EAGLE) for this target, seeded normal weights on its device and dtype;
    see the module docstring."""
    t, dev, dtype = target.spec, target.device, target.dtype
    shape = draft_shape(name, t)
    torch.manual_seed(seed)
    E, C = t.hidden_size, shape.hidden
    K = min(shape.vocab, t.vocab_size) if shape.vocab else t.vocab_size
    spec = replace(t, hidden_size=C, intermediate_size=shape.intermediate, num_layers=shape.layers,
                   num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=C // shape.heads,
                   vocab_size=t.vocab_size, tie_word_embeddings=False)
    plan = _plan(spec, dtype, dev)
    if shape.vocab:
        head = FeatureLogits(_normal((E, C), dtype, dev), _normal((K, E), dtype, dev), plan.projections)
        vocab_ids = torch.randperm(t.vocab_size, device=dev)[:K]
    else:  # the EAGLE-sized draft scores with the target's own head
        head, vocab_ids = target.lm_head, None
    return LlamaModel(spec, FeatureInput(target.embed), _layers(spec, plan, dtype, dev),
                      torch.ones(C, dtype=dtype, device=dev), head, embed_proj=_normal((C, 2 * E), dtype, dev),
                      vocab_ids=vocab_ids, plan=plan)


def target_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """The weights of a target of this spec, in bytes."""
    C, H, KV, D, inter, V = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                             spec.intermediate_size, spec.vocab_size)
    layer = (H + 2 * KV) * D * C + C * H * D + 3 * inter * C
    params = spec.num_layers * layer + V * C * (1 if spec.tie_word_embeddings else 2)
    return params * torch.finfo(dtype).bits // 8


def draft_bytes(name: str, spec: ModelSpec, dtype: torch.dtype) -> int:
    """A draft's own weights for a target of this spec (the embedding and, for EAGLE's, the head are shared)."""
    s, E = draft_shape(name, spec), spec.hidden_size
    D = s.hidden // s.heads
    layer = (s.heads + 2 * s.kv_heads) * D * s.hidden + s.hidden * s.heads * D + 3 * s.intermediate * s.hidden
    params = s.layers * layer + s.hidden * 2 * E + ((E * s.hidden + min(s.vocab, spec.vocab_size) * E) if s.vocab else 0)
    return params * torch.finfo(dtype).bits // 8


def cache_bytes(layers: int, kv_heads: int, head_dim: int, slots: int, max_len: int,
                dtype: torch.dtype) -> int:
    """A KV cache's bytes: K and V, layers x slots x KV heads x positions x head size."""
    return 2 * layers * slots * kv_heads * max_len * head_dim * torch.finfo(dtype).bits // 8
