"""Early-exit drafting: the target's first L layers, then its final norm and LM head.

It shares the target's weights and the target's KV cache for those layers, so it costs no
memory. The target cache holds every committed token but the last, for all layers, so each
proposal starts at the last committed token. Draft K/V it writes past that point are always
overwritten by the verify forward, which covers the same positions with all layers.
"""

from __future__ import annotations

from ..models.cache import KVCache
from ..models.llama import LlamaModel
from .base import DraftRequest
from .model import ModelDrafter


def check_layers(layers: int, num_layers: int) -> str | None:
    if not 1 <= layers <= num_layers:
        return f"early_exit layers must be in 1..{num_layers} for this target, got {layers}"
    return None


class EarlyExitDrafter(ModelDrafter):
    kind = "early_exit"

    def __init__(self, name: str, target: LlamaModel, target_cache: KVCache, layers: int):
        problem = check_layers(layers, target.spec.num_layers)
        if problem:
            raise ValueError(f"drafter {name!r}: {problem}")
        super().__init__(name, target, target_cache, num_layers=layers)

    def _start(self, r: DraftRequest) -> int:
        return len(r.tokens) - 1

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        """Nothing to roll back: the target cache is the truth."""
