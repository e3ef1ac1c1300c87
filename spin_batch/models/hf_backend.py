"""The transformers backend: any causal LM transformers implements, on our packed attention and KV cache.

transformers' own modelling code runs (embeddings, norms, MLPs, rotary or learned positions, q/k
norms, final logit soft-capping, the LM head); only attention is ours: the model is loaded with
attn_implementation = hf_attention.ATTN_IMPLEMENTATION, and each forward passes a PackedPass down
through model.forward's kwargs. A forward runs the flat tokens of the packed segments as a [1, N]
batch with the segments' positions as position ids, so prefill chunks, decode tokens and verify runs
share one call, as on the native decoder (llama.py). The loop and the drafters see the same interface,
protocol.TargetModel.

Early exit (drafters.early_exit) runs the first L decoder layers, then the model's final norm and head:
the decoder's layer list is cut to L for that forward.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from .cache import KVCache
from .execution import TRANSFORMERS, Execution, ModelPlan
from .hf_arch import (ProbeResult, config_problem, context_problem, first_line, load_config, model_class_problem,
                      num_layers_of, position_limit, probe, probe_result)
from .hf_attention import ATTN_IMPLEMENTATION, STATE_KWARG, PackedPass, register
from .llama import Linear, triton_kernels
from .segments import Segments
from .spec import CheckpointError, UnsupportedModelError

BACKEND = TRANSFORMERS


@dataclass(frozen=True)
class HfSpec:
    """The facts the loop, the drafters and the runner read from a model (LlamaModel's ModelSpec has more)."""

    model_type: str
    vocab_size: int  # rows of the logits
    hidden_size: int
    num_layers: int
    num_kv_heads: int  # per layer, as the model's attention gives K/V (the probe)
    head_dim: int
    max_position_embeddings: int | None


class TransformersModel:
    """A transformers causal LM whose attention runs on our packed segments and cache. Holds no
    per-request state: caches are passed in, as to LlamaModel. A protocol.TargetModel."""

    vocab_ids = None  # every logits row is its own token id (a distilled draft's head would map them)
    feature_head = None  # no target-feature drafts on this backend
    tree_segments = False  # writes K/V at positions: token-tree segments are refused (forward), not verified

    def __init__(self, hf, spec: HfSpec, probed: ProbeResult, execution: Execution | None = None,
                 position_limit: int | None = None):
        self.hf = hf
        self.spec = spec
        self.features = probed.features
        self.device = next(hf.parameters()).device
        self.dtype = next(hf.parameters()).dtype
        self.plan = ModelPlan.make(TRANSFORMERS, self.dtype, self.device, execution)
        self.position_limit = position_limit
        # the Triton kernels (CUDA) for attention's plain causal path and for acceptance (the loop reads .kernels)
        self.kernels = triton_kernels(self.plan)
        self._keeps_rows = "logits_to_keep" in inspect.signature(hf.forward).parameters
        self._layers = _layer_list(hf, spec.num_layers)
        # Where the plan has the C library (CPU, not torch's path, not Triton): the C kernels the native decoder
        # uses, for every nn.Linear (panel GEMMs, or oneDNN's prepacked ones) and for plain causal attention.
        self.cpu_lib = self.plan.lib
        self.c_linears = swap_linears(hf) if self.plan.c_library else 0

    # -- construction -------------------------------------------------------------------

    @classmethod
    def load(cls, model_dir: Path, dtype: torch.dtype, device: torch.device | str, execution: Execution | None = None,
             trust_remote_code: bool = False) -> "TransformersModel":
        """The folder's safetensors weights, loaded by transformers. Raises UnsupportedModelError where the
        architecture cannot run here (hf_arch), CheckpointError where weights are missing or unused."""
        from transformers import AutoModelForCausalLM

        config = load_config(model_dir, trust_remote_code)
        problem = config_problem(config)
        if problem:
            raise UnsupportedModelError(problem)
        register()
        try:
            hf, info = AutoModelForCausalLM.from_pretrained(
                str(model_dir), config=config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                use_safetensors=True, local_files_only=True, trust_remote_code=trust_remote_code,
                output_loading_info=True)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"transformers cannot load it ({first_line(e)})") from None
        problem = loading_problem(info)
        if problem:
            raise CheckpointError(problem)
        hf = hf.to(device).eval()
        problem = model_class_problem(hf)
        if problem:
            raise UnsupportedModelError(problem)
        dev = torch.device(device)
        probed = probe_result(probe(hf, dev), num_layers_of(config))
        spec = HfSpec(
            model_type=str(config.model_type),
            vocab_size=_vocab_size(hf, config),
            hidden_size=int(config.hidden_size),
            num_layers=probed.num_layers,
            num_kv_heads=probed.kv_heads,
            head_dim=probed.head_dim,
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
        )
        return cls(hf, spec, probed, execution, position_limit(hf))

    def backend(self) -> dict:
        """For summary.json's `backends`: this backend, the model class and how attention runs."""
        from transformers import __version__

        return {
            "backend": BACKEND,
            "transformers": __version__,
            "model_class": type(self.hf).__name__,
            "attention": self.plan.attention,
            "c_linears": self.c_linears,
            "attention_features": sorted(self.features),
            **self.plan.execution.describe(),
        }

    def allocate_cache(self, slots: int, max_len: int, num_layers: int | None = None) -> KVCache:
        problem = context_problem(self.position_limit, max_len)
        if problem:
            raise UnsupportedModelError(problem)
        s = self.spec
        return KVCache.allocate(num_layers or s.num_layers, slots, s.num_kv_heads, max_len, s.head_dim, self.dtype,
                                self.device)

    # -- forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [N] long
        seg: Segments,
        cache: KVCache,
        logits_rows: torch.Tensor | list[int] | None = None,  # [M] flat rows that need logits
        num_layers: int | None = None,  # the first layers only (early exit); all by default
    ) -> torch.Tensor:
        """Returns logits [M, V] in float32 (M = N when logits_rows is None)."""
        if seg.has_trees:  # hf_attention writes K/V at seg.positions: a tree's rows would land wrong
            raise NotImplementedError("token-tree segments run on the native backend only (torch or C paths)")
        layers = num_layers or self.spec.num_layers
        state = PackedPass(seg, cache, self.kernels, self.cpu_lib)
        rows = None if logits_rows is None else torch.as_tensor(logits_rows, dtype=torch.long, device=self.device)
        keep = {"logits_to_keep": 0 if rows is None else rows} if self._keeps_rows else {}
        with self._first_layers(layers):
            out = self.hf(input_ids=tokens[None], position_ids=seg.positions[None], use_cache=False, **keep,
                          **{STATE_KWARG: state})
        if sorted(state.layers) != list(range(layers)):  # a layer skipped our attention, or ran it twice
            raise UnsupportedModelError(f"the forward attended through layers {sorted(state.layers)}; "
                                        f"expected each of the first {layers} once")
        logits = out.logits[0]  # [M or N, V]
        if rows is not None and not self._keeps_rows:
            logits = logits[rows]
        return logits.float()

    def forward_with_hidden(self, tokens: torch.Tensor, seg: Segments, cache: KVCache,
                            logits_rows: torch.Tensor | list[int] | None = None,
                            num_layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Refused: the drafts that read a target's features run next to a native target only (build.py
        refuses the pairing before any forward)."""
        raise UnsupportedModelError("the target's features (a distilled draft that reads them) need the native "
                                    "backend")

    @contextlib.contextmanager
    def _first_layers(self, layers: int):
        """The decoder's layer list cut to its first `layers` for one forward (early exit)."""
        if layers == self.spec.num_layers:
            yield
            return
        if self._layers is None:
            raise UnsupportedModelError(f"{type(self.hf).__name__}: no decoder layer list found to stop after "
                                        f"{layers} layers (early exit)")
        owner, name, full = self._layers
        setattr(owner, name, torch.nn.ModuleList(list(full)[:layers]))
        try:
            yield
        finally:
            setattr(owner, name, full)


def _layer_list(hf, num_layers: int):
    """(owner module, attribute, ModuleList) of the decoder layers: the one ModuleList of num_layers modules
    each holding an attention module with a layer_idx; None where there is no single such list."""
    found = []
    for owner in hf.modules():
        for name, child in owner.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == num_layers and all(
                    any(hasattr(m, "layer_idx") for m in layer.modules()) for layer in child):
                found.append((owner, name, child))
    return found[0] if len(found) == 1 else None


class CpuLinear(torch.nn.Module):
    """An nn.Linear's weight and bias on our CPU GEMM (llama.Linear: the panel GEMM of cpu_decoder.c, or
    oneDNN's prepacked one): x [..., in] -> [..., out], each row's result independent of the batch."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach()
        self.linear = Linear(linear.weight.detach(), bias, panel=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.reshape(-1, self.in_features))  # [rows, out]
        return y.view(*x.shape[:-1], self.out_features)


def swap_linears(hf) -> int:
    """Every plain nn.Linear of the model replaced by a CpuLinear (its weight repacked once; the original
    freed unless tied elsewhere, as a tied LM head's embedding is). Returns how many were replaced."""
    swapped = 0
    for owner in list(hf.modules()):
        for name, child in list(owner.named_children()):
            if type(child) is torch.nn.Linear and child.weight.dtype in (torch.float32, torch.bfloat16):
                setattr(owner, name, CpuLinear(child))
                swapped += 1
    return swapped


def _vocab_size(hf, config) -> int:
    """The logits' width: the LM head's rows (config.vocab_size where the model has no plain head)."""
    head = hf.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else int(config.vocab_size)


def loading_problem(info: dict) -> str | None:
    """A checkpoint transformers loaded with tensors missing (it would fill them at random), unused (a
    different architecture) or of another shape: its text would be wrong."""
    parts = []
    for key, what in (("missing_keys", "missing"), ("unexpected_keys", "the model would not use"),
                      ("mismatched_keys", "of another shape than config.json says")):
        names = sorted(str(n if isinstance(n, str) else n[0]) for n in (info.get(key) or ()))
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            parts.append(f"{len(names)} tensor{'s' if len(names) > 1 else ''} {what}: {shown}")
    return f"weights do not match config.json: {'; '.join(parts)}" if parts else None

