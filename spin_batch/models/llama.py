"""A compact decoder for the Llama family with a packed-segment forward.

Covers Llama 2/3, Mistral (within its sliding window), Qwen2 (q/k/v bias) and SmolLM. One
forward takes flat token ids plus a `Segments` table, runs the first `num_layers` layers
(all by default: fewer is an early-exit draft), writes K/V into a `KVCache`, and computes
logits only at the rows asked for.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_decoder, cuda_graphs
from .attention import AttentionPlan, attention
from .buckets import PaddedTreeSegments
from .cache import KVCache
from .execution import NATIVE, TORCH, ModelPlan
from .quantize import INT8_C, RescoredHead, fake_quantize_groups, quantize_rows
from .segments import Segments
from .spec import (EMBED_TENSOR, HEAD_TENSOR, CheckpointError, ModelSpec, UnsupportedModelError, expected_tensors,
                   tensor_problem, window_problem)


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


def triton_kernels(plan: ModelPlan):
    """spin_kernels (the Triton kernels) where the model's plan runs on them (execution.py), else None.
    Imported only then: importing Triton costs start-up time."""
    if not plan.triton:
        return None
    import spin_kernels

    return spin_kernels


PACKED_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_takes(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs this dtype on this CPU. Its bfloat16 path needs AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 2/3) torch refuses to prepack."""
    if not _onednn_linear_available() or dtype not in PACKED_DTYPES:
        return False
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        warnings.warn(message, stacklevel=3)


class Linear:
    """x [N, in] -> x @ weight[out, in]^T (+ bias) -> [N, out].

    On CPU, with panel=True (the model's plan chose the C path, see execution.ModelPlan and cpu_plan.py),
    float32 and bfloat16 weights go to our panel GEMM (cpu_decoder.py): it streams them near memory speed at
    the loop's batch sizes and keeps each row's result independent of the batch. Otherwise the weight is prepacked once
    into oneDNN's blocked layout where oneDNN takes its dtype on this CPU, and runs on torch's F.linear
    where it does not (bfloat16 without AVX-512: slower, but it runs; said once). Other devices use
    F.linear. panel=None: the C path wherever it applies.

    quantize: int8 weights with a scale per output row and int8 inputs in groups of 64 (quantize.py), for
    drafts: on the C path in a float32 model (spin_gemm_q8), else the same rounding in torch per call
    (correct, not faster).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, panel: bool | None = None,
                 quantize: bool = False):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.scale = None  # int8 weights off the C path: the scale per output row
        if quantize:
            self.packed = False
            q, scale = quantize_rows(weight)
            # the C int8 GEMM takes float32 rows; the C decoder widens a bfloat16 model's for it
            c = panel is not False and weight.dtype in (torch.float32, torch.bfloat16)
            self.panel = cpu_decoder.panel_weight(q, scale) if c else None
            self.weight, self.scale = (None, None) if self.panel is not None else (q, scale.to(weight.dtype))
            return
        self.panel = cpu_decoder.panel_weight(weight) if panel is not False else None
        cpu = weight.device.type == "cpu"
        self.packed = self.panel is None and cpu and onednn_takes(weight.dtype)
        if self.panel is None and cpu and weight.dtype == torch.bfloat16 and not self.packed:
            _say_once("bf16-linear", "spin-batch: oneDNN's bfloat16 GEMM needs AVX-512 or AVX-NE-CONVERT, which this "
                      "CPU lacks: bfloat16 linears off the C path run on torch's generic GEMM (slower)")
        if self.panel is not None:
            self.weight = None
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panel is not None:
            y = self.panel(x)
            if self.panel.scale is not None:  # int8 weights give float32 rows: a bfloat16 model's go back to it
                y = y.to(x.dtype)
            return y if self.bias is None else y.add_(self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        if self.scale is not None:
            y = F.linear(fake_quantize_groups(x), self.weight.to(x.dtype)) * self.scale
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [C]
    qkv: Linear  # [C] -> [(H + 2 KV) * D], q/k/v bias folded in
    o: Linear  # [H * D] -> [C]
    mlp_norm: torch.Tensor  # [C]
    gate_up: Linear  # [C] -> [2 I]
    down: Linear  # [I] -> [C]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [N, heads, D] in one pass: x * cos + swap_halves(x) * sin_signed.

    sin_signed [N, 1, D] is sin with its first half negated, so swap_halves(x) * sin_signed
    equals the usual rotate_half(x) * sin bit for bit.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin_signed)


class LlamaModel:
    """Weights plus the packed forward. Holds no per-request state: caches are passed in. A
    protocol.TargetModel."""

    tree_segments = True  # the forward verifies token-tree segments (ancestor masks)

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,  # [V, C]
        layers: list[LayerWeights],
        norm: torch.Tensor,  # [C]
        lm_head,  # [V, C] tensor, or [K, C] over a vocabulary subset (see vocab_ids); or a built head (RescoredHead)
        max_len: int | None = None,
        embed_proj: torch.Tensor | None = None,  # [C, E]: embeddings of width E projected to C
        quantize: bool = False,  # the LM head in int8 (Linear); the layers' linears say their own
        vocab_ids: torch.Tensor | None = None,  # [K] long: target id of each lm_head row
        plan: ModelPlan | None = None,  # how it runs (execution.py); None: ModelPlan.make's default
    ):
        self.spec = spec
        self.plan = plan or ModelPlan.make(NATIVE, embed.dtype, embed.device, heads=attention_shape(spec))
        self.embed = embed
        self.embed_proj = None if embed_proj is None else Linear(embed_proj, panel=self.plan.projections)
        self.vocab_ids = vocab_ids
        self.feature_head = None  # a FeatureHead (models/distilled.py) for drafts that read target features
        # The residual stream and the RMS norms run in float32 whatever the weights' dtype: in
        # bf16/fp16 that is both more accurate and cheaper on CPU (one cast per norm instead of
        # a round trip through float32 inside it). In float32 nothing changes.
        for lw in layers:
            lw.attn_norm, lw.mlp_norm = lw.attn_norm.float(), lw.mlp_norm.float()
        self.layers = layers
        self.norm = norm.float()
        self.lm_head = lm_head if not isinstance(lm_head, torch.Tensor) else Linear(
            lm_head, panel=self.plan.lm_head, quantize=quantize)
        self.dtype = embed.dtype
        self.device = embed.device
        self.kernels = triton_kernels(self.plan)  # Triton kernels, or None for the torch path
        self.graphs = cuda_graphs.StepGraphs(self) if self.plan.cuda_graphs else None  # CUDA graphs of short forwards
        self.cpu_lib = self.plan.lib  # the C library (norms, attention, the decoder), or None
        self._rope_len = 0
        self._ensure_rope(max_len or min(spec.max_position_embeddings, 4096))
        # All layers in one C call per forward where the attention is C's and every linear takes the C GEMM.
        self.c_decoder = None
        if self.plan.attention == "c" and cpu_decoder.Decoder.applies(self.cpu_lib, layers, self.dtype):
            self.c_decoder = cpu_decoder.Decoder(self.cpu_lib, layers, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                                              head_dim=spec.head_dim, intermediate=spec.intermediate_size,
                                              eps=spec.rms_norm_eps, dtype=self.dtype)
        # The forward's path, decided once: the C decoder, the Triton kernels, C attention or torch (hidden()).
        self.path = "c_decoder" if self.c_decoder is not None else self.plan.attention

    def backend(self) -> dict:
        """The path this model runs on and why, for summary.json's `backends`: the CPU plan (layers, lm_head,
        why, ...) and the job's kernels (kernels, triton, cuda_graphs, any environment override)."""
        return self.plan.describe()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls, spec: ModelSpec, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str,
        plan: ModelPlan | None = None,
    ) -> "LlamaModel":
        """Raises CheckpointError unless sd holds exactly the tensors the spec reads (expected_tensors).
        plan: how it runs (None: ModelPlan.make's default for this dtype and device)."""
        problem = tensor_problem(spec, expected_tensors(spec, sd), sd)
        if problem:
            raise CheckpointError(problem)

        def get(name: str) -> torch.Tensor:
            return sd[name].to(device=device, dtype=dtype).contiguous()

        embed = get(EMBED_TENSOR if EMBED_TENSOR in sd else HEAD_TENSOR)
        # Tied and saved equal (or only one saved): one tensor serves both, as transformers ties them.
        shared = HEAD_TENSOR not in sd or EMBED_TENSOR not in sd or (
            spec.tie_word_embeddings and sd[EMBED_TENSOR].dtype == sd[HEAD_TENSOR].dtype
            and torch.equal(sd[EMBED_TENSOR], sd[HEAD_TENSOR]))
        head = embed if shared else get(HEAD_TENSOR)
        plan = plan or ModelPlan.make(NATIVE, dtype, torch.device(device), heads=attention_shape(spec))
        layers = cls.layers_from_state_dict(spec, get, plan.linears)
        return cls(spec, embed, layers, get("model.norm.weight"), head, plan=plan)

    @staticmethod
    def layers_from_state_dict(spec: ModelSpec, get, panel: bool | None = None, quantize: bool = False,
                               num_layers: int | None = None) -> list[LayerWeights]:
        """The first num_layers (default all) decoder layers, fused (qkv, gate_up), from the tensors
        layer_tensors(spec) names; get(name) returns a tensor on the target device; panel and quantize as
        for Linear."""
        layers = []
        for i in range(num_layers or spec.num_layers):
            p = f"model.layers.{i}."
            wqkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
            bqkv = None
            if spec.qkv_bias:
                bqkv = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
            bo = get(p + "self_attn.o_proj.bias") if spec.o_bias else None  # the C decoder refuses it: per-layer path
            w_gate_up = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0)
            layers.append(
                LayerWeights(
                    attn_norm=get(p + "input_layernorm.weight"),
                    qkv=Linear(wqkv, bqkv, panel, quantize=quantize),
                    o=Linear(get(p + "self_attn.o_proj.weight"), bo, panel, quantize=quantize),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(w_gate_up, panel=panel, quantize=quantize),
                    down=Linear(get(p + "mlp.down_proj.weight"), panel=panel, quantize=quantize),
                )
            )
        return layers

    def int8_copy(self, state_dict: dict[str, torch.Tensor], num_layers: int | None = None,
                  draft: bool = True) -> "LlamaModel":
        """This model's first num_layers layers (all by default) with int8 linears and LM head (quantize.py),
        sharing its embedding, final norm and kernels. state_dict: this model's checkpoint (the packed weights
        are not read back). draft: the head a draft needs on the C path (int4 scores, the best rescored in
        int8); else every logit from the int8 head, as a target's must be (target.quantize: int8)."""

        def get(name: str) -> torch.Tensor:
            return state_dict[name].to(device=self.device, dtype=self.dtype)

        # The C int8 GEMM wherever this model's plan has the C library (target.kernels torch: not): int8 has no
        # fast torch path, so this model's measured float32 plan does not apply.
        plan = self.plan.with_cpu(INT8_C if self.plan.c_library else TORCH, attention_shape(self.spec))
        layers = self.layers_from_state_dict(self.spec, get, plan.linears, quantize=True, num_layers=num_layers)
        head = get(HEAD_TENSOR if HEAD_TENSOR in state_dict else EMBED_TENSOR)
        if plan.c_library and draft:  # the int4 head rescored in int8 (quantize.py), on float32 rows
            head = RescoredHead(plan.lib, head)
        return LlamaModel(self.spec, self.embed, layers, self.norm, head, quantize=True, plan=plan)

    def _ensure_rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        inv = rope_inv_freq(self.spec).to(self.device)
        freqs = torch.arange(length, device=self.device).float()[:, None] * inv[None, :]  # [L, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)
        half = inv.shape[0]
        self.sin_signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)  # see apply_rope
        # float32 tables for the C decoder, which rotates in float32 whatever the weights' dtype
        self.cos32, sin32 = emb.cos(), emb.sin()
        self.sin32_signed = torch.cat((-sin32[:, :half], sin32[:, half:]), dim=-1)
        self._rope_len = length

    def allocate_cache(self, slots: int, max_len: int, num_layers: int | None = None) -> KVCache:
        problem = window_problem(self.spec, max_len)
        if problem:
            raise UnsupportedModelError(problem)
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
        return self.forward_with_hidden(tokens, seg, cache, logits_rows, num_layers)[0]

    @torch.inference_mode()
    def forward_with_hidden(
        self,
        tokens: torch.Tensor,
        seg: Segments,
        cache: KVCache,
        logits_rows: torch.Tensor | list[int] | None = None,
        num_layers: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(), plus the final residual [N, C] of every row (before the final norm)."""
        h = self.hidden(tokens, seg, cache, num_layers)
        rows = h if logits_rows is None else h[torch.as_tensor(logits_rows, dtype=torch.long, device=h.device)]
        return self.logits(rows), h

    def hidden(
        self, tokens: torch.Tensor, seg: Segments, cache: KVCache, num_layers: int | None = None,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the first num_layers layers (all by default) and returns the residual [N, C].

        extra [N, X], if given, is concatenated to the token embeddings before embed_proj (a draft
        that reads the target's features does this).
        """
        s = self.spec
        layers = num_layers or s.num_layers
        if self.path == "c_decoder":
            h = self._embed(tokens, extra).contiguous()
            return self.c_decoder(h, layers, seg.token_slots, seg.rows, self.cos32[seg.positions],
                                  self.sin32_signed[seg.positions], cache.k, cache.v, _tree_bits(seg))
        if self.path == "triton":
            if self.graphs is not None:
                h = self.graphs.hidden(tokens, seg, cache, layers, extra)
                if h is not None:
                    return h
            trees = (seg.rows.to(self.device), _tree_bits(seg).to(self.device)) if seg.has_trees else (None, None)
            return self.kernel_hidden(self._embed(tokens, extra), seg.packed_index().to(self.device),
                                      max(seg.lengths(), default=0), cache, layers, *trees)
        attend = self._c_attention(seg) if self.path == "c" else self._torch_attention(seg, cache)
        return self._layers(self._embed(tokens, extra), seg.positions, attend, cache, layers)

    def kernel_hidden(
        self,
        h: torch.Tensor,  # [N, C] float32: the embedded tokens
        index: torch.Tensor,  # [2 N + 3 S + 1] long on the device: Segments.packed_index()
        longest: int,  # the longest segment (sizes the attention grid)
        cache: KVCache,
        num_layers: int,
        rows: torch.Tensor | None = None,  # [N] long: Segments.rows with a tree segment, else None (the positions)
        tree_mask: torch.Tensor | None = None,  # [N] int64: _tree_bits(seg) on the device where rows is given
    ) -> torch.Tensor:
        """The layers on the Triton path: a KV scatter and one varlen attention launch per layer.

        Everything here is on the device and sized by N, S and `longest` alone, so models/cuda_graphs.py
        can capture it for a shape and replay it with new values in the same buffers (forwards without trees).
        """
        kn = self.kernels
        n = h.shape[0]
        S = (index.shape[0] - 2 * n - 1) // 3
        token_slots, positions = index[:n], index[n : 2 * n]
        table = index[2 * n :]
        slots, starts, cache_lens = table[:S], table[S : 2 * S + 1], table[2 * S + 1 :]
        write_rows = positions if rows is None else rows

        def attend(li: int, cache: KVCache, q, k, v) -> torch.Tensor:
            kn.kv_write(cache.k[li], cache.v[li], token_slots, write_rows, k, v)
            return kn.varlen_attention(q, cache.k[li], cache.v[li], slots, starts, cache_lens, longest, tree_mask)

        return self._layers(h, positions, attend, cache, num_layers)

    def _layers(self, h: torch.Tensor, positions: torch.Tensor, attend, cache: KVCache,
                num_layers: int) -> torch.Tensor:
        """The first num_layers layers over the residual h [N, C]; attend(li, cache, q, k, v) -> [N, H, D]."""
        s = self.spec
        n_tok = h.shape[0]
        H, KV, D = s.num_heads, s.num_kv_heads, s.head_dim
        qk_width, inter = (H + KV) * D, s.intermediate_size
        cos = self.cos[positions].unsqueeze(1)  # [N, 1, D]
        sin = self.sin_signed[positions].unsqueeze(1)
        for li, lw in enumerate(self.layers[:num_layers]):
            qkv = lw.qkv(self.normed(h, lw.attn_norm))  # [N, (H + 2 KV) * D]
            qk = apply_rope(qkv[:, :qk_width].view(n_tok, H + KV, D), cos, sin)  # [N, H + KV, D]
            o = attend(li, cache, qk[:, :H], qk[:, H:], qkv[:, qk_width:].view(n_tok, KV, D))  # [N, H, D]
            h = h + lw.o(o.reshape(n_tok, H * D))
            gate_up = lw.gate_up(self.normed(h, lw.mlp_norm))  # [N, 2 I]
            h = h + lw.down(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        return h

    def _embed(self, tokens: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        """The float32 residual stream's start [N, C]: token embeddings (plus extra, projected)."""
        h = self.embed[tokens]  # [N, C] (or [N, E], projected to C)
        if extra is not None:
            h = torch.cat((h, extra), dim=-1)
        if self.embed_proj is not None:
            h = self.embed_proj(h)
        return h.float()  # the residual stream (a no-op in float32)

    def normed(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """rms_norm of the float32 residual h, in the weights' dtype (the input of a linear)."""
        if self.cpu_lib is not None and h.dtype == torch.float32 and h.dim() == 2:
            x = cpu_decoder.rms_norm(self.cpu_lib, h, weight, self.spec.rms_norm_eps)
        else:
            x = F.rms_norm(h, weight.shape, weight, self.spec.rms_norm_eps)
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def _torch_attention(self, seg: Segments, cache: KVCache):
        plan = AttentionPlan(seg, self.spec.num_heads // self.spec.num_kv_heads, self.dtype, self.device)

        rows = cache.rows(seg.token_slots, seg.rows)  # seg.rows is seg.positions unless a segment is a tree

        def attend(li: int, cache: KVCache, q, k, v) -> torch.Tensor:
            cache.write(li, rows, k, v)
            return attention(q, cache.k[li], cache.v[li], seg, plan)

        return attend

    def _c_attention(self, seg: Segments):
        """C on CPU: KV write and every row's attention in one call per layer (see cpu_decoder.c)."""
        lib = self.cpu_lib
        anc = _tree_bits(seg)  # None unless a segment is a tree

        def attend(li: int, cache: KVCache, q, k, v) -> torch.Tensor:
            return cpu_decoder.attention(lib, q, k, v, cache.k[li], cache.v[li], seg.token_slots, seg.rows, anc)

        return attend

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [M, C] -> [M, V] float32."""
        return self.lm_head(self.normed(h, self.norm)).float()


def attention_shape(spec: ModelSpec) -> tuple[int, int, int]:
    """(heads, KV heads, head size): what the C attention must take (ModelPlan.make's `heads`)."""
    return spec.num_heads, spec.num_kv_heads, spec.head_dim


def _tree_bits(seg: Segments) -> torch.Tensor | None:
    """[N] int64 ancestor bitmasks for the C attention and the Triton attention (cpu_decoder.tree_bits, on the
    host; a bucket's padded trees carry theirs on the device, models/buckets.py), or None without trees."""
    if isinstance(seg, PaddedTreeSegments):
        return seg.bits
    return cpu_decoder.tree_bits(seg.parents, seg.lengths()) if seg.has_trees else None
