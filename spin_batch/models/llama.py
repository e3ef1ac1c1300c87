"""A compact decoder for the Llama family with a packed-segment forward.

Covers Llama 2/3, Mistral (within its sliding window), Qwen2 (q/k/v bias) and SmolLM. One
forward takes flat token ids plus a `Segments` table, runs the first `num_layers` layers
(all by default: fewer is an early-exit draft), writes K/V into a `KVCache`, and computes
logits only at the rows asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import KVCache
from .segments import Segments

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    pass


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
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            sliding_window=window,
        )


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies, with linear or llama3 scaling applied."""
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = spec.rope_scaling
    if s is None:
        return inv
    rope_type = s.get("rope_type", s.get("type"))
    if rope_type == "linear":
        return inv / s["factor"]
    # llama3: leave high frequencies, divide low ones by factor, blend in between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(medium, blended, scaled)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [C]
    wqkv: torch.Tensor  # [(H + 2 KV) * D, C]
    bqkv: torch.Tensor | None  # [(H + 2 KV) * D]
    wo: torch.Tensor  # [C, H * D]
    mlp_norm: torch.Tensor  # [C]
    w_gate_up: torch.Tensor  # [2 I, C]
    w_down: torch.Tensor  # [C, I]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w[out, in]^T -> [N, out]."""
    return F.linear(x, w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_ref(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Torch reference for packed varlen attention over per-slot caches.

    q: [N, H, D]; cache_k/cache_v: [slots, KV, max_len, D] (this segment's K/V already written).
    Returns [N, H, D]. Segment s's query i (absolute position cache_len + i) sees its slot's
    keys at positions <= cache_len + i.
    """
    out = torch.empty_like(q)
    for slot, a, b, c in zip(seg.slots, seg.starts[:-1], seg.starts[1:], seg.cache_lens):
        n = b - a
        if n == 0:
            continue
        total = c + n
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        ks = cache_k[slot, :, :total].unsqueeze(0)  # [1, KV, total, D]
        vs = cache_v[slot, :, :total].unsqueeze(0)
        mask = None
        if n > 1:
            key_pos = torch.arange(total, device=q.device)
            query_pos = torch.arange(c, total, device=q.device)
            mask = key_pos[None, :] <= query_pos[:, None]  # [n, total]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)  # [1, H, n, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


class LlamaModel:
    """Weights plus the packed forward. Holds no per-request state: caches are passed in."""

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,  # [V, C]
        layers: list[LayerWeights],
        norm: torch.Tensor,  # [C]
        lm_head: torch.Tensor,  # [V, C]
        max_len: int | None = None,
    ):
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self._rope_len = 0
        self._ensure_rope(max_len or min(spec.max_position_embeddings, 4096))

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls, spec: ModelSpec, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str
    ) -> "LlamaModel":
        def get(name: str) -> torch.Tensor:
            return sd[name].to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            wqkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            bqkv = None
            if spec.qkv_bias:
                bqkv = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    wqkv=wqkv,
                    bqkv=bqkv,
                    wo=get(p + "self_attn.o_proj.weight"),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    w_gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0),
                    w_down=get(p + "mlp.down_proj.weight"),
                )
            )
        embed = get("model.embed_tokens.weight")
        head = embed if spec.tie_word_embeddings or "lm_head.weight" not in sd else get("lm_head.weight")
        return cls(spec, embed, layers, get("model.norm.weight"), head)

    def _ensure_rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        inv = rope_inv_freq(self.spec).to(self.device)
        freqs = torch.arange(length, device=self.device).float()[:, None] * inv[None, :]  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)
        self._rope_len = length

    def allocate_cache(self, slots: int, max_len: int, num_layers: int | None = None) -> KVCache:
        if self.spec.sliding_window is not None and max_len > self.spec.sliding_window:
            raise UnsupportedModelError(
                f"max_model_len {max_len} exceeds the model's sliding window {self.spec.sliding_window}; "
                "sliding-window attention is not implemented"
            )
        self._ensure_rope(max_len)
        s = self.spec
        return KVCache.allocate(
            num_layers or s.num_layers, slots, s.num_kv_heads, max_len, s.head_dim, self.dtype, self.device
        )

    # -- forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [N] long
        seg: Segments,
        cache: KVCache,
        logits_rows: torch.Tensor | list[int] | None = None,  # [M] flat rows that need logits
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """Returns logits [M, V] in float32 (M = N when logits_rows is None)."""
        h = self.hidden(tokens, seg, cache, num_layers)
        if logits_rows is not None:
            h = h[torch.as_tensor(logits_rows, dtype=torch.long, device=h.device)]
        return self.logits(h)

    def hidden(
        self, tokens: torch.Tensor, seg: Segments, cache: KVCache, num_layers: int | None = None
    ) -> torch.Tensor:
        """Runs the first num_layers layers (all by default) and returns the residual [N, C]."""
        s = self.spec
        n_tok = tokens.shape[0]
        H, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        cos = self.cos[seg.positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin[seg.positions].unsqueeze(1)
        h = self.embed[tokens]  # [N, C]
        for li, lw in enumerate(self.layers[: num_layers or s.num_layers]):
            x = rms_norm(h, lw.attn_norm, s.rms_norm_eps)
            qkv = linear(x, lw.wqkv)  # [N, (H + 2 KV) * D]
            if lw.bqkv is not None:
                qkv = qkv + lw.bqkv
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            q = q.view(n_tok, H, D)
            k = k.view(n_tok, KV, D)
            v = v.view(n_tok, KV, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache.write(li, seg.token_slots, seg.positions, k, v)
            o = attention_ref(q, cache.k[li], cache.v[li], seg)  # [N, H, D]
            h = h + linear(o.reshape(n_tok, H * D), lw.wo)
            x = rms_norm(h, lw.mlp_norm, s.rms_norm_eps)
            gate, up = linear(x, lw.w_gate_up).chunk(2, dim=-1)  # [N, I] each
            h = h + linear(F.silu(gate) * up, lw.w_down)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [M, C] -> [M, V] float32."""
        return linear(rms_norm(h, self.norm, self.spec.rms_norm_eps), self.lm_head).float()
