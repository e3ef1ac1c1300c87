"""Distilled drafts tied to their target: the on-disk format written by `spin-batch distill`.

A distilled draft is a Hugging Face-style directory (config.json, model.safetensors, the
target's tokenizer files). Its config.json is a plain Llama config of the draft's own decoder
(hidden_size, layers, heads) with one extra block, "spin_batch_draft":

    target_fingerprint   identifies the target it was distilled for (see fingerprint())
    target_hidden_size   E, the width of the target's token embeddings
    vocab_subset         K, the number of target ids the output head covers

Two things make such a draft cheap where a CPU spends its time, and both read the target:
- input embeddings are the target's own rows (frozen, never stored in the draft), projected
  from E to the draft width by `model.embed_proj.weight` [C, E];
- the output head covers only K frequent target ids (`vocab_ids` [K]); its weight is the
  target's embedding rows of those ids times `lm_head_proj.weight` [E, C], computed once at
  load time, and a proposal maps head row k back to target id vocab_ids[k].
So the draft loads only next to the target it was trained for; `check_pairing` says so before
any weights load.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .llama import LlamaModel, ModelSpec

DRAFT_KEY = "spin_batch_draft"
EMBED_KEY = "model.embed_tokens.weight"
_FINGERPRINT_ROWS = 16


def draft_meta(model_dir: Path) -> dict | None:
    """The "spin_batch_draft" block of a model directory's config.json, or None for a plain model."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    meta = cfg.get(DRAFT_KEY)
    return dict(meta) if isinstance(meta, dict) else None


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


def load_draft(draft_dir: Path, target: LlamaModel, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    """An inference LlamaModel for a distilled draft, sharing the target's embedding tensor."""
    from .loader import load_state_dict, read_spec

    meta = draft_meta(draft_dir)
    if meta is None:
        raise ValueError(f"{draft_dir} is not a distilled draft (no {DRAFT_KEY} in config.json)")
    spec: ModelSpec = read_spec(draft_dir)
    if target.embed.shape[1] != meta["target_hidden_size"] or spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"{draft_dir} does not fit this target (embedding width or vocabulary size differs)")
    sd = load_state_dict(draft_dir)

    def get(name: str) -> torch.Tensor:
        return sd[name].to(device=device, dtype=dtype).contiguous()

    vocab_ids = sd["vocab_ids"].to(device=device, dtype=torch.long)
    embed = target.embed if target.embed.dtype == dtype else target.embed.to(dtype)
    # The head is fixed at load time: the target's rows of the kept ids, projected to the draft width.
    head = (embed[vocab_ids].float() @ sd["lm_head_proj.weight"].to(device=device, dtype=torch.float32)).to(dtype)
    return LlamaModel(spec, embed, LlamaModel.layers_from_state_dict(spec, get), get("model.norm.weight"),
                      head.contiguous(), embed_proj=get("model.embed_proj.weight"), vocab_ids=vocab_ids)
