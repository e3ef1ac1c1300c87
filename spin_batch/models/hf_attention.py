"""The attention function a transformers model runs on our packed segments and per-slot KV cache.

transformers' modelling code calls `attention_interface(module, query, key, value, attention_mask,
scaling=..., dropout=..., **kwargs)` in each layer (modeling_utils.AttentionInterface). We register
`packed_attention` under ATTN_IMPLEMENTATION and load models with that implementation; a forward hands
its per-forward state (a PackedPass: the Segments, the KVCache) down through model.forward's **kwargs
under STATE_KWARG. Each call writes the layer's new K/V into the cache at the segments' (slot,
position) and attends each token to its own slot's cache prefix plus the causal part of its segment.

What the call's kwargs ask for is honoured or refused, never dropped: `scaling`, `sliding_window` and
`softcap` (attention-logit soft-capping, Gemma 2) are applied; an attention mask or bias the model
builds itself (ALiBi), attention sinks, relative position biases, non-causal attention and dropout
raise UnsupportedModelError naming what the model asked for.
"""

from __future__ import annotations

import math

import torch

from . import cpu_decoder
from .attention import AttentionPlan, attention
from .cache import KVCache
from .segments import Segments
from .spec import UnsupportedModelError

ATTN_IMPLEMENTATION = "spin_batch_packed"  # the name registered in transformers' AttentionInterface
STATE_KWARG = "spin_batch_pass"  # the model.forward kwarg that carries the PackedPass to every layer

# Attention kwargs some models pass whose meaning the packed attention does not implement.
REFUSED_KWARGS = {
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "a relative position bias",
    "block_indices": "block-sparse attention",
}


class PackedPass:
    """One forward's attention state: its segments and the cache every layer writes and reads.

    cache None is the probe (hf_arch.probe): nothing is written, each layer's K/V shape is recorded, and
    the output is zeros (the probe reads shapes, not values).
    """

    def __init__(self, seg: Segments, cache: KVCache | None, kernels=None, cpu_lib=None):
        self.seg, self.cache, self.kernels, self.cpu_lib = seg, cache, kernels, cpu_lib
        self.layers: list[int] = []  # layer index of each call, in call order
        self.kv_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # layer -> K, V [heads, dim]
        self.features: set[str] = set()  # what the calls asked for beyond plain causal attention
        self._rows: torch.Tensor | None = None
        self._plan: AttentionPlan | None = None
        self._index: tuple | None = None

    # -- the cache's rows and the attention plan: made at the first layer, shared by all ---------

    def rows(self) -> torch.Tensor:
        if self._rows is None:
            self._rows = self.cache.rows(self.seg.token_slots, self.seg.positions)
        return self._rows

    def plan(self, groups: int, dtype: torch.dtype) -> AttentionPlan:
        if self._plan is None:
            self._plan = AttentionPlan(self.seg, groups, dtype, self.cache.k.device)
        return self._plan

    def kernel_index(self) -> tuple:
        """(token slots, positions, segment slots, starts, cache lengths, longest) on the device, for Triton."""
        if self._index is None:
            seg, n = self.seg, self.seg.num_tokens
            S = seg.num_segments
            index = seg.packed_index().to(self.cache.k.device)
            table = index[2 * n :]
            self._index = (index[:n], index[n : 2 * n], table[:S], table[S : 2 * S + 1], table[2 * S + 1 :],
                           max(seg.lengths(), default=0))
        return self._index

    # -- one layer ---------------------------------------------------------------------------

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
               window: int | None, softcap: float | None) -> torch.Tensor:
        """q [N, H, D], k/v [N, KV, D] of one layer -> [N, H, D]: K/V written, then attended."""
        self.layers.append(layer)
        self.kv_shapes[layer] = (tuple(k.shape[1:]), tuple(v.shape[1:]))
        if window is not None:
            self.features.add("sliding_window")
        if softcap:
            self.features.add("softcap")
        if self.cache is None:
            return q.new_zeros(*q.shape[:2], v.shape[-1])  # [N, H, Dv]
        cache = self.cache
        if tuple(cache.k.shape[2:3]) + tuple(cache.k.shape[4:]) != tuple(k.shape[1:]) or k.shape != v.shape:
            raise UnsupportedModelError(
                f"layer {layer} gives K {list(k.shape[1:])} and V {list(v.shape[1:])} per token; the cache holds "
                f"[{cache.k.shape[2]}, {cache.k.shape[4]}] for both")
        k, v = k.to(cache.k.dtype), v.to(cache.k.dtype)
        q = q.to(cache.k.dtype)
        if window is not None and window >= cache.max_len:
            window = None  # every position this cache holds is within the window: plain causal
        if window is None and not softcap:
            return self._causal(layer, q, k, v, scaling)
        cache.write(layer, self.rows(), k, v)
        return capped_attention(q, cache.k[layer], cache.v[layer], self.seg, scaling, window, softcap)

    def _causal(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        """Plain causal attention on the native model's kernels (SDPA's 1/sqrt(D) scale: q rescaled to `scaling`)."""
        cache, D = self.cache, q.shape[-1]
        factor = scaling * math.sqrt(D)
        if abs(factor - 1.0) > 1e-12:
            q = q * factor
        if self.kernels is not None:
            token_slots, positions, slots, starts, cache_lens, longest = self.kernel_index()
            self.kernels.kv_write(cache.k[layer], cache.v[layer], token_slots, positions, k, v)
            return self.kernels.varlen_attention(q.contiguous(), cache.k[layer], cache.v[layer], slots, starts,
                                                 cache_lens, longest)
        if self.cpu_lib is not None and cpu_decoder.attention_applies(self.cpu_lib, q.dtype, q.shape[1], k.shape[1], D):
            return cpu_decoder.attention(self.cpu_lib, q.contiguous(), k.contiguous(), v.contiguous(), cache.k[layer],
                                         cache.v[layer], self.seg.token_slots, self.seg.positions)
        cache.write(layer, self.rows(), k, v)
        return attention(q.contiguous(), cache.k[layer], cache.v[layer], self.seg, self.plan(q.shape[1] // k.shape[1],
                                                                                          q.dtype))


def capped_attention(
    q: torch.Tensor,  # [N, H, D]
    cache_k: torch.Tensor,  # [slots, KV, max_len, D], this forward's K already written
    cache_v: torch.Tensor,  # [slots, KV, max_len, D]
    seg: Segments,
    scaling: float,
    window: int | None,  # a query at position p sees keys at p - window + 1 .. p (transformers' rule)
    softcap: float | None,  # scores -> softcap * tanh(scores / softcap) before the mask
) -> torch.Tensor:
    """Packed attention with a sliding window and/or logit soft-capping, one call per segment; [N, H, D].

    Scores and softmax in float32, as transformers' eager attention does."""
    out = torch.empty_like(q)
    G = q.shape[1] // cache_k.shape[1]
    for slot, a, b, c in zip(seg.slots, seg.starts[:-1], seg.starts[1:], seg.cache_lens):
        n = b - a
        if n == 0:
            continue
        total = c + n
        qs = q[a:b].transpose(0, 1).float()  # [H, n, D]
        ks = cache_k[slot, :, :total].float().repeat_interleave(G, dim=0)  # [H, total, D]
        vs = cache_v[slot, :, :total].float().repeat_interleave(G, dim=0)
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scaling  # [H, n, total]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        key_pos = torch.arange(total, device=q.device)
        query_pos = torch.arange(c, total, device=q.device)
        visible = key_pos[None, :] <= query_pos[:, None]  # [n, total]
        if window is not None:
            visible &= query_pos[:, None] - key_pos[None, :] < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.matmul(scores.softmax(-1), vs).transpose(0, 1).to(q.dtype)  # [n, H, D]
    return out


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """The function registered in transformers' AttentionInterface. query [1, H, N, D], key/value
    [1, KV, N, D] -> ([1, N, H, D], None)."""
    state = kwargs.get(STATE_KWARG)
    if not isinstance(state, PackedPass):
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called outside a TransformersModel forward")
    name = type(module).__name__
    problem = refusal(module, attention_mask, dropout, kwargs)
    if problem:
        raise UnsupportedModelError(f"{name} asks for {problem}, which the packed attention does not implement")
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise UnsupportedModelError(f"{name} has no layer index (layer_idx): its K/V has no place in the cache")
    if query.shape[0] != 1:
        raise RuntimeError(f"packed attention takes one flat batch, got {query.shape[0]}")
    D = query.shape[-1]
    scale = D ** -0.5 if scaling is None else float(scaling)
    q = query[0].transpose(0, 1).contiguous()  # [N, H, D]
    k = key[0].transpose(0, 1)  # [N, KV, D]
    v = value[0].transpose(0, 1)
    out = state.attend(layer, q, k, v, scale, sliding_window, softcap)  # [N, H, D]
    return out.to(query.dtype).unsqueeze(0), None  # [1, N, H, D]


def refusal(module, attention_mask, dropout: float, kwargs: dict) -> str | None:
    """What an attention call asks for that the packed attention would otherwise drop, or None."""
    if attention_mask is not None:
        return "an attention mask or bias of its own (ALiBi or a custom mask)"
    for key, what in REFUSED_KWARGS.items():
        if kwargs.get(key) is not None:
            return what
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        return "non-causal attention"
    if dropout:
        return f"attention dropout {dropout}"
    return None


def register() -> None:
    """Register packed_attention with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)
