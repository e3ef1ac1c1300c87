"""Early-exit drafting: the target's first L layers, then its final norm and LM head; or the same with
int8 weights (`quantize: int8`, models/quantize.py), all layers by default.

It shares the target's weights and the target's KV cache for those layers, so it costs no
memory. The target cache holds every committed token but the last, for all layers, so each
proposal starts at the last committed token. Draft K/V it writes past that point are always
overwritten by the verify forward, which covers the same positions with all layers.
"""

from __future__ import annotations

from ..models.cache import KVCache
from ..models.protocol import TargetModel
from .base import DraftRequest
from .model import ModelDrafter


def check_layers(layers: int, num_layers: int) -> str | None:
    if not 1 <= layers <= num_layers:
        return f"early_exit layers must be in 1..{num_layers} for this target, got {layers}"
    return None


class EarlyExitDrafter(ModelDrafter):
    kind = "early_exit"

    def __init__(self, name: str, target: TargetModel, target_cache: KVCache, layers: int | None,
                 model: TargetModel | None = None, lookahead: int = 0):
        """layers None: all of them; model: the target by default, or a copy of its first layers with
        other weights (LlamaModel.int8_copy); lookahead: guessed tokens per forward (model.py)."""
        problem = None if layers is None else check_layers(layers, target.spec.num_layers)
        if problem:
            raise ValueError(f"drafter {name!r}: {problem}")
        super().__init__(name, model or target, target_cache, num_layers=layers)
        self.lookahead = lookahead
        if model is not None and model is not target:
            # A copy of the whole target agrees with it far more often than its own confidence says (it is as
            # unsure as the target, and mostly unsure the same way): the bandit's gamma decides its length,
            # not a confidence floor, and a chain beats a tree's width.
            self.gates = self.trees = False

    def _start(self, r: DraftRequest) -> int:
        return len(r.tokens) - 1

    def on_commit(self, slot: int, tokens: list[int]) -> None:
        """Nothing to roll back: the target cache is the truth."""
