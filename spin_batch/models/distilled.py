"""Distilled drafts tied to their target: the on-disk format written by `spin-batch distill`.

A distilled draft is a Hugging Face-style directory (config.json, model.safetensors; `spin-batch
distill` also copies the target's tokenizer files beside them, which nothing reads: a draft proposes
the target's token ids and runs with the target's tokenizer, so a draft folder needs none, as the
shipped examples/drafts have none). Its config.json is a plain Llama config of the draft's own decoder
(hidden_size, layers, heads) with one extra block, "spin_batch_draft":

    target_fingerprint      identifies the target it was distilled for (see fingerprint())
    target_hidden_size      E, the width of the target's token embeddings
    vocab_subset            K, the number of target ids the output head covers
    reads_target_features   whether the draft also reads the target's last hidden state

Three things make such a draft cheap where a CPU spends its time and accurate where a small
model is weak, and all of them read the target:
- input embeddings are the target's own rows (frozen, never stored in the draft), projected
  to the draft width C by `model.embed_proj.weight`;
- the output head covers only K frequent target ids (`vocab_ids` [K]). A draft predicts a
  feature g in the target's normalised hidden space, g = lm_head_proj.weight [E, C] @
  rms_norm(h), and scores it with the target's own head restricted to those ids (embedding
  rows times the target's final norm weight); head row k is target id vocab_ids[k];
- a feature-reading draft (EAGLE-style) also takes the target's normalised last hidden state
  at the previous position: its input is embed_proj [C, 2E] @ [embedding(x_t); g_{t-1}]. While
  drafting past the verified tokens it feeds back its own predicted g.
So the draft loads only next to the target it was trained for; `check_pairing` says so before
any weights load.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from . import cpu_plan
from .execution import ModelPlan
from .checkpoint import load_state_dict, read_spec
from .llama import Linear, LlamaModel
from .segments import Segments
from .spec import CheckpointError, ModelSpec, layer_tensors, tensor_problem

DRAFT_KEY = "spin_batch_draft"
EMBED_KEY = "model.embed_tokens.weight"
_FINGERPRINT_ROWS = 16
# A draft's own tensors besides its decoder layers (it has no embeddings nor lm_head: it reads the target's).
DRAFT_TENSORS = ("model.embed_proj.weight", "model.norm.weight", "lm_head_proj.weight", "vocab_ids")


def draft_meta(model_dir: Path) -> dict | None:
    """The "spin_batch_draft" block of a model directory's config.json, or None for a plain model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    meta = cfg.get(DRAFT_KEY)
    return dict(meta) if isinstance(meta, dict) else None


def draft_tensors(spec: ModelSpec) -> set[str]:
    """The tensors load_draft reads (the rule for a distilled draft's checkpoint; see spec.expected_tensors)."""
    return layer_tensors(spec) | set(DRAFT_TENSORS)


def fingerprint(model_dir: Path) -> str:
    """A short hash of a model's token embeddings: shape, dtype and the first and last rows.

    Reads a few rows through safetensors' lazy slices, so it costs milliseconds even for a
    large target.
    """
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if EMBED_KEY not in fh.keys():
                continue
            sl = fh.get_slice(EMBED_KEY)
            rows, cols = sl.get_shape()
            k = min(_FINGERPRINT_ROWS, rows)
            h = hashlib.sha256(f"{rows}x{cols}:{sl.get_dtype()}".encode())
            for part in (sl[:k], sl[rows - k:]):
                h.update(part.to(torch.float32).contiguous().numpy().tobytes())
            return h.hexdigest()[:16]
    raise ValueError(f"{model_dir}: no {EMBED_KEY} tensor in its safetensors files")


def check_pairing(draft_dir: Path, target_dir: Path) -> str | None:
    """Why the draft cannot run next to this target, or None when it can (plain models: always)."""
    meta = draft_meta(draft_dir)
    if meta is None:
        return None
    want = meta.get("target_fingerprint")
    got = fingerprint(target_dir)
    if want != got:
        return (f"{draft_dir} was distilled for another target (fingerprint {want}, this target's is {got}); "
                "distill a draft for this target with `spin-batch distill`")
    return None


class TargetFeatures:
    """The target's normalised last hidden state per slot and position, for feature-reading drafts.

    Written at every target forward at the rows' (slot, position), like the KV cache; a position
    is valid once its token is committed, and later writes overwrite rejected rows.
    """

    def __init__(self, slots: int, max_len: int, width: int, eps: float, dtype: torch.dtype, device: torch.device):
        self.g = torch.zeros(slots, max_len, width, dtype=dtype, device=device)
        self.eps = eps

    def write(self, seg: Segments, hidden: torch.Tensor) -> None:
        """At the rows the forward wrote K/V to (a token tree's scratch rows; see keep_path)."""
        self.g[seg.token_slots, seg.rows] = normalize(hidden, self.eps).to(self.g.dtype)

    def keep_path(self, slot: int, cache_len: int, path: list[int]) -> None:
        """After a token-tree verify: the accepted nodes' features move into place, as KVCache.keep_path
        moves their K/V (path: the accepted segment tokens below the root, increasing)."""
        moved = [k for k, p in enumerate(path) if p != k + 1]
        if moved:
            src = torch.tensor([cache_len + path[k] for k in moved], device=self.g.device)
            self.g[slot, cache_len + 1 + torch.tensor(moved, device=self.g.device)] = self.g[slot, src]


def normalize(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight: the feature space a draft reads and predicts."""
    return torch.nn.functional.rms_norm(h, (h.shape[-1],), None, eps)


class FeatureHead:
    """A draft's output side: normed hidden state -> predicted target feature g [E] -> logits over the kept ids."""

    def __init__(self, proj: torch.Tensor, head: torch.Tensor, panel: bool | None = None):
        self.proj = Linear(proj, panel=panel)  # [E, C]
        self.head = Linear(head, panel=panel)  # [K, E]: target embedding rows of the kept ids times the target's norm weight

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the draft's final-normed hidden state (LlamaModel.normed(h, model.norm))."""
        g = self.proj(x)
        return self.head(g).float(), g


def load_draft(draft_dir: Path, target: LlamaModel, dtype: torch.dtype, device: torch.device,
               embeds: dict[torch.dtype, torch.Tensor] | None = None,
               loop: tuple[tuple[int, int], ...] | None = None) -> LlamaModel:
    """An inference LlamaModel for a distilled draft, sharing the target's embedding tensor and running on
    the target's kernels (its plan's `execution`), on its own CPU path (cpu_plan.model_plan).

    A feature-reading draft gets a `feature_head` (FeatureHead); a plain one a precomputed
    [K, C] lm_head, so one matmul scores the kept ids. `embeds` caches the target's embedding
    cast to `dtype`, so drafts loaded together share one copy.
    """
    meta = draft_meta(draft_dir)
    if meta is None:
        raise ValueError(f"{draft_dir} is not a distilled draft (no {DRAFT_KEY} in config.json)")
    spec: ModelSpec = read_spec(draft_dir)
    if target.embed.shape[1] != meta["target_hidden_size"] or spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"{draft_dir} does not fit this target (embedding width or vocabulary size differs)")
    sd = load_state_dict(draft_dir)
    problem = tensor_problem(spec, draft_tensors(spec), sd)
    if problem:
        raise CheckpointError(f"{draft_dir}: {problem}")

    def get(name: str) -> torch.Tensor:
        return sd[name].to(device=device, dtype=dtype).contiguous()

    vocab_ids = sd["vocab_ids"].to(device=device, dtype=torch.long)
    embed = target.embed
    if embed.dtype != dtype:  # one cast copy per dtype, shared through `embeds`
        embeds = {} if embeds is None else embeds
        if dtype not in embeds:
            embeds[dtype] = embed.to(dtype)
        embed = embeds[dtype]
    # The target's head restricted to the kept ids, with its final norm weight folded in: [K, E].
    head_e = embed[vocab_ids].float() * target.norm.float()
    proj = sd["lm_head_proj.weight"].to(device=device, dtype=torch.float32)  # [E, C]
    plan: ModelPlan = cpu_plan.model_plan(replace(spec, vocab_size=len(vocab_ids)), dtype, torch.device(device), loop,
                                          target.plan.execution)
    model = LlamaModel(spec, embed, LlamaModel.layers_from_state_dict(spec, get, plan.linears),
                       get("model.norm.weight"), (head_e @ proj).to(dtype).contiguous(),
                       embed_proj=get("model.embed_proj.weight"), vocab_ids=vocab_ids, plan=plan)
    if meta.get("reads_target_features"):
        model.feature_head = FeatureHead(proj.to(dtype).contiguous(), head_e.to(dtype).contiguous(),
                                         panel=plan.projections)
    return model
