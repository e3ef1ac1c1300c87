"""What the loop and the drafters read from a model: the target-model protocol.

Both backends implement it with every member present (no defaults read through getattr): the native
decoder (llama.LlamaModel, its int8 copies and distilled drafts) and the transformers backend
(hf_backend.TransformersModel). engine.BatchLoop takes its target as a TargetModel, and a model drafter
its draft model; tests/test_hf_backend.py checks both classes against it.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .cache import KVCache
from .execution import ModelPlan
from .segments import Segments

if TYPE_CHECKING:
    from .distilled import FeatureHead


class ModelShape(Protocol):
    """The facts of a model's spec the loop and the drafters read (spec.ModelSpec and hf_backend.HfSpec)."""

    vocab_size: int  # the width of the logits
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


@runtime_checkable
class TargetModel(Protocol):
    """A decoder over packed segments (segments.Segments) with its KV cache passed in; no per-request state."""

    spec: ModelShape
    plan: ModelPlan  # how it runs, decided once (execution.ModelPlan)
    device: torch.device
    dtype: torch.dtype
    kernels: ModuleType | None  # the Triton kernels (spin_kernels) where its plan runs them: the accept step's too
    tree_segments: bool  # whether forward() verifies token-tree segments (else it refuses them)
    vocab_ids: torch.Tensor | None  # [K] the target id of each logits column, for a head over a subset; None: all
    feature_head: FeatureHead | None  # a draft that reads the target's features: its output side

    def allocate_cache(self, slots: int, max_len: int, num_layers: int | None = None) -> KVCache:
        """A KV cache of `slots` rows of max_len positions (the first num_layers layers; all by default)."""
        ...

    def forward(self, tokens: torch.Tensor, seg: Segments, cache: KVCache,
                logits_rows: torch.Tensor | list[int] | None = None, num_layers: int | None = None) -> torch.Tensor:
        """tokens [N] over seg's segments, K/V written into cache; logits [M, V] float32 at logits_rows (all N
        rows when None), after the first num_layers layers (all by default: fewer is early exit)."""
        ...

    def forward_with_hidden(self, tokens: torch.Tensor, seg: Segments, cache: KVCache,
                            logits_rows: torch.Tensor | list[int] | None = None,
                            num_layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(), plus the final residual [N, C] of every row (for drafts that read the target's features)."""
        ...

    def backend(self) -> dict:
        """The path it runs on and why, for summary.json's `backends`."""
        ...
