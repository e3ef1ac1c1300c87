"""Distillation data: the target's own completions, then its top-k log-probs at every position.

1. generate: an ordinary spin-batch job (our runner, greedy, resumable) writes the target's
   completions for the prompts to DIR/<name>/gen.
2. score: each prompt + completion is re-read by the target in one packed prefill forward per
   chunk of sequences; the top-k log-probs of every position are kept (the teacher).
The result is cached in DIR/<name>.pt, so a rerun of distill skips work already done.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import parse_job
from ..io.reader import iter_requests
from ..io.rows import input_spec
from ..io.shards import list_shards
from ..io.outputs import read_outputs
from ..models.distilled import normalize
from ..models.llama import LlamaModel
from ..models.segments import Segments


@dataclass
class TeacherData:
    """Sequences (prompt + completion ids) with the target's top-k next-token log-probs per position."""

    tokens: list[torch.Tensor] = field(default_factory=list)  # [n] long each
    prompt_lens: list[int] = field(default_factory=list)
    top_ids: list[torch.Tensor] = field(default_factory=list)  # [n, k] int32: teacher's top ids at row t (for t+1)
    top_logp: list[torch.Tensor] = field(default_factory=list)  # [n, k] float16
    kinds: list[str] = field(default_factory=list)  # the input's `kind` column, or "all"
    features: list[torch.Tensor] = field(default_factory=list)  # [n, E] float16: normalised last hidden state

    def __len__(self) -> int:
        return len(self.tokens)

    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def save(self, path: Path, key: str) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"key": key, **self.__dict__}, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, key: str) -> "TeacherData | None":
        if not path.exists():
            return None
        d = torch.load(path, weights_only=True)
        if d.pop("key", None) != key:
            return None
        return cls(**d)


def generation_job(target: str, prompts: list[str], out_dir: Path, max_tokens: int, slots: int, seed: int,
                   device: str, temperature: float = 0.0, dtype: str = "float32"):
    """The job that makes the target's completions: plain decoding on our runner, greedy unless a
    temperature is given (sampled completions: other contexts from the same prompts)."""
    return parse_job({
        "name": "distill-generate",
        "input": {"paths": list(prompts), "chat_template": "auto"},
        "output": {"dir": str(out_dir)},
        "target": {"model": target, "dtype": dtype, "device": device},
        "spin": {"selector": "none"},
        "batch": {"slots": slots, "max_model_len": 1024},
        "sampling": {"temperature": temperature, "max_tokens": max_tokens, "seed": seed},
    }, source="<distill>")


def data_key(*parts) -> str:
    return hashlib.sha256(json.dumps([str(p) for p in parts]).encode()).hexdigest()[:16]


def kinds_by_id(shards: list[Path]) -> dict[str, str]:
    """id -> the optional `kind` column of the input rows (for per-kind agreement)."""
    import polars as pl

    out: dict[str, str] = {}
    for f in shards:
        df = pl.read_parquet(f) if f.suffix == ".parquet" else pl.read_ndjson(f, infer_schema_length=None)
        if "kind" in df.columns and "id" in df.columns:
            for i, k in zip(df["id"].cast(pl.String), df["kind"].cast(pl.String)):
                if i is not None and k is not None:
                    out[i] = k
    return out


def sequences(job, out_dir: Path, tokenizer, encode, eos_id: int | None) -> tuple[list[list[int]], list[int], list[str]]:
    """(prompt + completion ids, prompt length, kind) for every ok output row of the job."""
    shards = list_shards(job.input.paths, job.input.format)
    outputs = read_outputs(out_dir)
    # a row's output by its id and digest (io/identity.py), wherever it was read; by source where older
    # parts have no digest
    done = {(s if d is None else (i, d)): (t, f) for i, s, d, t, f, st in zip(
        outputs["id"], outputs["source"], outputs["input_digest"], outputs["text"], outputs["finish_reason"],
        outputs["status"]) if st == "ok"}
    kinds = kinds_by_id(shards)
    seqs, plens, ks = [], [], []
    for req in iter_requests(shards, input_spec(job.input, job.output.keep_columns)):
        found = done.get((req.id, req.digest)) or done.get(req.source)
        if not req.ok or found is None:
            continue
        text, finish = found
        prompt = encode(req)
        completion = tokenizer.encode(text or "", add_special_tokens=False)
        if finish == "stop" and eos_id is not None:
            completion.append(eos_id)
        if not completion:
            continue
        seqs.append(prompt + completion)
        plens.append(len(prompt))
        ks.append(kinds.get(req.id or "", "all"))
    return seqs, plens, ks


@torch.inference_mode()
def score(target: LlamaModel, seqs: list[list[int]], topk: int, chunk_tokens: int = 1024,
          progress: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """The target's top-k log-probs and normalised last hidden state at every position of every
    sequence (packed prefill forwards)."""
    from tqdm import tqdm

    longest = max(len(s) for s in seqs)
    slots = 16
    cache = target.allocate_cache(slots, longest)
    top_ids: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    top_logp: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    feats: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    bar = tqdm(total=sum(len(s) for s in seqs), unit="tok", desc="distill: scoring", disable=not progress,
               dynamic_ncols=True)
    i = 0
    while i < len(order):
        batch = [order[i]]
        i += 1
        while i < len(order) and len(batch) < slots and sum(len(seqs[j]) for j in batch) + len(seqs[order[i]]) \
                <= chunk_tokens:
            batch.append(order[i])
            i += 1
        seg = Segments.build([(slot, len(seqs[j]), 0) for slot, j in enumerate(batch)], target.device)
        flat = torch.tensor([t for j in batch for t in seqs[j]], dtype=torch.long, device=target.device)
        logits, hidden = target.forward_with_hidden(flat, seg, cache)
        logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        vals, ids = logp.topk(topk, dim=-1)
        g = normalize(hidden, target.spec.rms_norm_eps).to(torch.float16).cpu()
        for s, j in enumerate(batch):
            a, b = seg.starts[s], seg.starts[s + 1]
            top_ids[j] = ids[a:b].to(torch.int32).cpu()
            top_logp[j] = vals[a:b].to(torch.float16).cpu()
            feats[j] = g[a:b]
        bar.update(int(flat.shape[0]))
    bar.close()
    return top_ids, top_logp, feats
