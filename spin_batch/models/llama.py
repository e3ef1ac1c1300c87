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
from .cache import KVCache
from .execution import DEFAULT_C, TORCH, CpuPlan, Execution
from .segments import Segments

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


def triton_kernels(execution: Execution):
    """spin_kernels (the Triton kernels) where the job runs on them (execution.py), else None. Imported
    only then: importing Triton costs start-up time."""
    if not execution.triton:
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

    On CPU, with panel=True (the model's plan chose the C path, see cpu_plan.py), float32 and bfloat16
    weights go to our panel GEMM (cpu_decoder.py): it streams them near memory speed at the loop's batch
    sizes and keeps each row's result independent of the batch. Otherwise the weight is prepacked once
    into oneDNN's blocked layout where oneDNN takes its dtype on this CPU, and runs on torch's F.linear
    where it does not (bfloat16 without AVX-512: slower, but it runs; said once). Other devices use
    F.linear. panel=None: the C path wherever it applies.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, panel: bool | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
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
            return y if self.bias is None else y.add_(self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
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


def attention_ref(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, seg: Segments, only: list[int] | None = None
) -> torch.Tensor:
    """Torch reference for packed varlen attention over per-slot caches.

    q: [N, H, D]; cache_k/cache_v: [slots, KV, max_len, D] (this segment's K/V already written).
    Returns [N, H, D]. Segment s's query i (absolute position cache_len + i) sees its slot's
    keys at positions <= cache_len + i. `only` restricts it to those segment indices (other rows
    of the result are left unset).
    """
    out = torch.empty_like(q)
    for i in range(seg.num_segments) if only is None else only:
        slot, a, b, c = seg.slots[i], seg.starts[i], seg.starts[i + 1], seg.cache_lens[i]
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


# Segments with at most this many new tokens (decode, verify) are attended in batched calls,
# grouped by AttentionPlan; longer ones (prefill chunks) keep a call each.
SHORT_SEGMENT = 16


class _ShortGroup:
    """Short segments (decode tokens, verify runs) attended in one batched call.

    Their queries are laid out in a grid of [slot, nmax] rows, nmax the longest of them: cells no
    segment fills are padding, computed and dropped. Only the attention's queries are padded; the
    linear layers stay packed. The grid spans the slots from the lowest member to the highest, so
    the keys are a view of the cache: gathering the members' caches instead copies them at every
    layer, which costs several padded rows per slot. Each KV head's G query heads are folded into
    its query rows ([R, KV, G * nmax, D]), so the call is plain multi-head attention over the
    cache's KV heads: no grouped-query expansion, which on CPU costs more than the attention
    itself at decode sizes. An additive mask hides keys past each query's own position (so also
    another slot's longer context); a padded query sees what its segment's last query sees, and a
    slot of the span with no segment sees its first key only, so no row is all masked. A lone
    decode token (one segment, n = 1) sees exactly its slot's keys: no mask.
    """

    def __init__(self, seg: Segments, members: list[int], groups: int, dtype: torch.dtype,
                 device: torch.device):
        slots = [seg.slots[i] for i in members]
        starts = [seg.starts[i] for i in members]
        lens = [seg.starts[i + 1] - seg.starts[i] for i in members]
        ctxs = [seg.cache_lens[i] for i in members]
        self.nmax = nmax = max(lens)
        self.ctx = max(c + n for c, n in zip(ctxs, lens))
        lo, hi = min(slots), max(slots)
        if len(set(slots)) == len(slots):
            self.slots: slice | torch.Tensor = slice(lo, hi + 1)  # a view of the cache
            grid = [s - lo for s in slots]
            self.grid_rows = hi - lo + 1
        else:  # a slot twice (not made by the loop): gather its cache per segment
            self.slots = torch.tensor(slots, dtype=torch.long, device=device)
            grid = list(range(len(slots)))
            self.grid_rows = len(slots)
        R = self.grid_rows
        # flat query row of each grid cell (padding repeats its segment's last row, or row 0)
        src = [starts[0]] * (R * nmax)
        qpos = [[0] * nmax for _ in range(R)]  # query position of each cell: what it may see
        take: list[int] = []  # grid cell of each member row, in flat order
        for r, a, n, c in zip(grid, starts, lens, ctxs):
            for j in range(nmax):
                src[r * nmax + j] = a + min(j, n - 1)
                qpos[r][j] = c + min(j, n - 1)
            take.extend(r * nmax + j for j in range(n))
        count = sum(lens)
        contiguous = all(starts[k + 1] == starts[k] + lens[k] for k in range(len(members) - 1))
        self.rows: slice | torch.Tensor = (
            slice(starts[0], starts[0] + count) if contiguous
            else torch.tensor([a + j for a, n in zip(starts, lens) for j in range(n)], device=device)
        )  # the members' flat rows, in flat order
        # No padding and the grid in flat order: the queries are a view and so is the output.
        exact = take == list(range(R * nmax)) and contiguous
        self.q_index: slice | torch.Tensor = (
            slice(starts[0], starts[0] + count) if exact else torch.tensor(src, dtype=torch.long, device=device))
        self.take = None if exact else torch.tensor(take, dtype=torch.long, device=device)
        self.mask = None
        if R > 1 or nmax > 1:
            pos = torch.tensor(qpos, device=device)  # [R, nmax]
            visible = torch.arange(self.ctx, device=device) <= pos[..., None]  # [R, nmax, ctx]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self.mask = mask.repeat(1, groups, 1)[:, None]  # [R, 1, G * nmax, ctx]: row g * nmax + j is query j

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """The members' rows of the output, in flat order, [rows, H, D]. Query head h reads KV head h // G."""
        _, H, D = q.shape
        KV = cache_k.shape[1]
        G, R, n = H // KV, self.grid_rows, self.nmax
        qs = q[self.q_index].view(R, n, KV, G, D).permute(0, 2, 3, 1, 4).reshape(R, KV, G * n, D)
        k = cache_k[self.slots, :, : self.ctx]  # [R, KV, ctx, D]
        v = cache_v[self.slots, :, : self.ctx]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=self.mask)  # [R, KV, G * n, D]
        o = o.view(R, KV, G, n, D).permute(0, 3, 1, 2, 4).reshape(R * n, H, D)
        return o if self.take is None else o[self.take]


# What one more attention call costs, in padded query rows: the grouping below weighs the two.
GROUP_CALL_ROWS = 4


class AttentionPlan:
    """How one forward's segments are attended; built once per forward, shared by all layers.

    Short segments are grouped by length: a group pads its queries to its longest member over the
    span of slots it covers (see _ShortGroup). One group for all pads every slot to the longest
    draft; one group per length covers the span once per length. The groups are the runs of
    sorted distinct lengths that minimise the padded rows plus GROUP_CALL_ROWS per call (a small
    dynamic programme over at most SHORT_SEGMENT lengths).
    """

    def __init__(self, seg: Segments, groups: int, dtype: torch.dtype, device: torch.device):
        by_len: dict[int, list[int]] = {}
        self.long: list[int] = []
        for i, n in enumerate(seg.lengths()):
            if 0 < n <= SHORT_SEGMENT:
                by_len.setdefault(n, []).append(i)
            elif n > SHORT_SEGMENT:
                self.long.append(i)
        self.groups = [_ShortGroup(seg, sorted(members), groups, dtype, device)
                       for members in self._partition(seg, by_len)]
        # One group holding every row in flat order (a decode or verify step without prefill): its output is the result.
        rows = self.groups[0].rows if len(self.groups) == 1 and not self.long else None
        self.whole = isinstance(rows, slice) and rows == slice(0, seg.num_tokens)

    @staticmethod
    def _partition(seg: Segments, by_len: dict[int, list[int]]) -> list[list[int]]:
        lens = sorted(by_len)
        if len(lens) <= 1:
            return [by_len[n] for n in lens]

        def cost(i: int, j: int) -> int:  # one group for lengths lens[i..j]
            slots = [seg.slots[m] for n in lens[i : j + 1] for m in by_len[n]]
            return GROUP_CALL_ROWS + (max(slots) - min(slots) + 1) * lens[j]

        best = [0] + [None] * len(lens)  # best[j]: cheapest grouping of lens[:j]
        cut = [0] * (len(lens) + 1)
        for j in range(1, len(lens) + 1):
            best[j], cut[j] = min((best[i] + cost(i, j - 1), i) for i in range(j))
        out, j = [], len(lens)
        while j:
            out.append([m for n in lens[cut[j] : j] for m in by_len[n]])
            j = cut[j]
        return out[::-1]


def attention(
    q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, seg: Segments, plan: AttentionPlan
) -> torch.Tensor:
    """Packed attention per the plan: a batched call per segment length, a call per long segment."""
    if plan.whole:
        return plan.groups[0].attend(q, cache_k, cache_v)
    out = attention_ref(q, cache_k, cache_v, seg, only=plan.long) if plan.long else torch.empty_like(q)
    for group in plan.groups:
        out[group.rows] = group.attend(q, cache_k, cache_v)
    return out


class LlamaModel:
    """Weights plus the packed forward. Holds no per-request state: caches are passed in."""

    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,  # [V, C]
        layers: list[LayerWeights],
        norm: torch.Tensor,  # [C]
        lm_head: torch.Tensor,  # [V, C], or [K, C] over a vocabulary subset (see vocab_ids)
        max_len: int | None = None,
        embed_proj: torch.Tensor | None = None,  # [C, E]: embeddings of width E projected to C
        vocab_ids: torch.Tensor | None = None,  # [K] long: target id of each lm_head row
        plan: CpuPlan | None = None,  # the CPU path (cpu_plan.py); None: the C kernels wherever they apply
        execution: Execution | None = None,  # the job's kernels (execution.py); None: Execution()
    ):
        self.spec = spec
        self.execution = execution or Execution()
        on_cpu = embed.device.type == "cpu"
        self.plan = plan or (DEFAULT_C if on_cpu and self.execution.cpu != "torch" else TORCH)
        self.embed = embed
        c_gemm = False if self.execution.cpu == "torch" else None  # else the C GEMM wherever it applies
        self.embed_proj = None if embed_proj is None else Linear(embed_proj, panel=c_gemm)
        self.vocab_ids = vocab_ids
        self.feature_head = None  # a FeatureHead (models/distilled.py) for drafts that read target features
        # The residual stream and the RMS norms run in float32 whatever the weights' dtype: in
        # bf16/fp16 that is both more accurate and cheaper on CPU (one cast per norm instead of
        # a round trip through float32 inside it). In float32 nothing changes.
        for lw in layers:
            lw.attn_norm, lw.mlp_norm = lw.attn_norm.float(), lw.mlp_norm.float()
        self.layers = layers
        self.norm = norm.float()
        self.lm_head = Linear(lm_head, panel=None if self.plan is DEFAULT_C else self.plan.lm_head == "c")
        self.dtype = embed.dtype
        self.device = embed.device
        self.kernels = triton_kernels(self.execution)  # Triton kernels, or None for the torch path
        # CUDA graphs of the short (decode, verify) forwards on the Triton path, or None
        graphs = self.execution.cuda_graphs and self.device.type == "cuda" and self.kernels is not None
        self.graphs = cuda_graphs.StepGraphs(self) if graphs else None
        # the C norm, or None
        self.cpu_lib = cpu_decoder.library() if on_cpu and self.execution.cpu != "torch" else None
        # The C attention (cpu_decoder.c) on CPU where the plan has it and it takes this model, else the torch path.
        self.c_attention = self.cpu_lib is not None and self.plan.c_attention and cpu_decoder.attention_applies(
            self.cpu_lib, self.dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self._rope_len = 0
        self._ensure_rope(max_len or min(spec.max_position_embeddings, 4096))
        # All layers in one C call per forward where every piece runs on the C kernels.
        self.c_decoder = None
        if self.c_attention and cpu_decoder.Decoder.applies(self.cpu_lib, layers, self.dtype):
            self.c_decoder = cpu_decoder.Decoder(self.cpu_lib, layers, heads=spec.num_heads, kv_heads=spec.num_kv_heads,
                                              head_dim=spec.head_dim, intermediate=spec.intermediate_size,
                                              eps=spec.rms_norm_eps)

    def backend(self) -> dict:
        """The path this model runs on and why, for summary.json's `backends`: the CPU plan (layers, lm_head,
        why, ...) and the job's kernels (kernels, triton, cuda_graphs, any environment override)."""
        return {**self.plan.describe(), **self.execution.describe()}

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_state_dict(
        cls, spec: ModelSpec, sd: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str,
        plan: CpuPlan | None = None, execution: Execution | None = None,
    ) -> "LlamaModel":
        """Raises CheckpointError unless sd holds exactly the tensors the spec reads (expected_tensors)."""
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
        layers = cls.layers_from_state_dict(spec, get, None if plan is None else plan.c_linears)
        return cls(spec, embed, layers, get("model.norm.weight"), head, plan=plan, execution=execution)

    @staticmethod
    def layers_from_state_dict(spec: ModelSpec, get, panel: bool | None = None) -> list[LayerWeights]:
        """The decoder layers, fused (qkv, gate_up), from the tensors layer_tensors(spec) names; get(name) returns
        a tensor on the target device; panel as for Linear."""
        layers = []
        for i in range(spec.num_layers):
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
                    qkv=Linear(wqkv, bqkv, panel),
                    o=Linear(get(p + "self_attn.o_proj.weight"), bo, panel),
                    mlp_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=Linear(w_gate_up, panel=panel),
                    down=Linear(get(p + "mlp.down_proj.weight"), panel=panel),
                )
            )
        return layers

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
        if self.c_decoder is not None and not self.kernels:
            h = self._embed(tokens, extra).contiguous()
            return self.c_decoder(h, layers, seg.token_slots, seg.positions,
                                  self.cos32[seg.positions], self.sin32_signed[seg.positions], cache.k, cache.v)
        if self.kernels:
            if self.graphs is not None:
                h = self.graphs.hidden(tokens, seg, cache, layers, extra)
                if h is not None:
                    return h
            return self.kernel_hidden(self._embed(tokens, extra), seg.packed_index().to(self.device),
                                      max(seg.lengths(), default=0), cache, layers)
        attend = self._c_attention(seg) if self.c_attention else self._torch_attention(seg, cache)
        return self._layers(self._embed(tokens, extra), seg.positions, attend, cache, layers)

    def kernel_hidden(
        self,
        h: torch.Tensor,  # [N, C] float32: the embedded tokens
        index: torch.Tensor,  # [2 N + 3 S + 1] long on the device: Segments.packed_index()
        longest: int,  # the longest segment (sizes the attention grid)
        cache: KVCache,
        num_layers: int,
    ) -> torch.Tensor:
        """The layers on the Triton path: a KV scatter and one varlen attention launch per layer.

        Everything here is on the device and sized by N, S and `longest` alone, so models/cuda_graphs.py
        can capture it for a shape and replay it with new values in the same buffers.
        """
        kn = self.kernels
        n = h.shape[0]
        S = (index.shape[0] - 2 * n - 1) // 3
        token_slots, positions = index[:n], index[n : 2 * n]
        table = index[2 * n :]
        slots, starts, cache_lens = table[:S], table[S : 2 * S + 1], table[2 * S + 1 :]

        def attend(li: int, cache: KVCache, q, k, v) -> torch.Tensor:
            kn.kv_write(cache.k[li], cache.v[li], token_slots, positions, k, v)
            return kn.varlen_attention(q, cache.k[li], cache.v[li], slots, starts, cache_lens, longest)

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

        rows = cache.rows(seg.token_slots, seg.positions)

        def attend(li: int, cache: KVCache, q, k, v) -> torch.Tensor:
            cache.write(li, rows, k, v)
            return attention(q, cache.k[li], cache.v[li], seg, plan)

        return attend

    def _c_attention(self, seg: Segments):
        """C on CPU: KV write and every row's attention in one call per layer (see cpu_decoder.c)."""
        lib = self.cpu_lib

        def attend(li: int, cache: KVCache, q, k, v) -> torch.Tensor:
            return cpu_decoder.attention(lib, q, k, v, cache.k[li], cache.v[li], seg.token_slots, seg.positions)

        return attend

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [M, C] -> [M, V] float32."""
        return self.lm_head(self.normed(h, self.norm)).float()

