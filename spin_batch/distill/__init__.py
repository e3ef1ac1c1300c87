"""`spin-batch distill`: a family of small drafts trained to imitate a target, offline.

    generate  the target's greedy completions for the prompts (a job on our own runner), plus
              optional sampled ones (--samples): more distinct contexts from the same prompts
    score     the target's top-k log-probs at every position of prompt + completion
    vocab     the K target ids with the most teacher mass: the drafts' output head
    train     one draft per size, by KL distillation (seeded: the same inputs give the same draft)
    measure   held-out top-1 agreement by prompt kind; cost per drafted token vs a target step
Each draft is written as DIR/<LxW>/ (see models/distilled.py) and loads as a `model` drafter.
DIR/report.json and DIR/report.md hold the measurements.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..io.writer import write_json_atomic
from ..models import cpu_decoder, loader
from ..models.distilled import fingerprint, load_draft
from .data import TeacherData, data_key, generation_job, score, sequences
from .net import DraftArch, save_draft
from .train import TrainSettings, agreement, choose_vocab, step_time, train_draft

DATA_VERSION = 2  # bump when the cached teacher data changes form


@dataclass(frozen=True)
class DistillSettings:
    target: str
    prompts: tuple[str, ...]
    out: Path
    sizes: tuple[DraftArch, ...]
    heldout: tuple[str, ...] = ()
    max_tokens: int = 128
    slots: int = 32
    vocab: int = 8192
    topk: int = 16
    device: str = "auto"
    save_dtype: str = "bfloat16"
    cost_slots: tuple[int, ...] = (1, 16)
    train: TrainSettings = field(default_factory=TrainSettings)
    samples: int = 0  # sampled completions per training prompt, on top of the greedy one
    sample_temperature: float = 0.8
    teacher_dtype: str = "auto"  # the target's dtype for the training data; "auto": bfloat16 where native

    def __post_init__(self) -> None:
        if self.teacher_dtype not in TEACHER_DTYPES:
            raise ValueError(f"teacher dtype {self.teacher_dtype!r} is not one of {', '.join(TEACHER_DTYPES)}")


TEACHER_DTYPES = ("auto", "float32", "bfloat16")


def teacher_dtype(s: DistillSettings, device: torch.device) -> str:
    """The dtype the target makes the training data in.

    "auto" is bfloat16 where its matmuls are native: the target then generates and scores about
    1.5x faster, and its top-1 next token agrees with float32's at about 99% of positions (a
    near-tie can go either way), which is noise next to what a draft gets wrong. The held-out
    data, which the agreement figures are measured on, is always made in float32.
    """
    if s.teacher_dtype != "auto":
        return s.teacher_dtype
    return "bfloat16" if loader.native_bf16(device) else "float32"


def teacher_key(s: DistillSettings, prompts: tuple[str, ...], fp: str, dtype: str) -> str:
    """What the greedy teacher data depends on (prompt files by content): a rerun with the same key reuses it."""
    from ..io.shards import list_shards

    contents = [(str(f), hashlib.sha256(f.read_bytes()).hexdigest()) for f in list_shards(list(prompts))]
    return data_key(DATA_VERSION, fp, contents, s.max_tokens, s.topk, s.train.seed, dtype)


def sample_key(greedy_key: str, i: int, temperature: float) -> str:
    """Sampled completion set i: depends on its index and temperature, not on how many sets there are."""
    return data_key(greedy_key, "sample", i, temperature)


def _generate(s: DistillSettings, gen_dir: Path, key: str, prompts: tuple[str, ...], seed: int,
              temperature: float, dtype: str, progress: bool):
    """One resumable generation job into gen_dir (wiped first if it holds another key's completions)."""
    from ..runner import run_job

    key_file = gen_dir / "teacher-key"
    if gen_dir.exists() and (not key_file.exists() or key_file.read_text() != key):
        shutil.rmtree(gen_dir)  # completions of other prompts or settings: a resume would mix them up
    gen_dir.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key)
    job = generation_job(s.target, list(prompts), gen_dir, s.max_tokens, s.slots, seed, s.device, temperature, dtype)
    run_job(job, progress=progress, shard_index=0, num_shards=1)  # resumes a killed generation
    return job


def _teacher(s: DistillSettings, name: str, prompts: tuple[str, ...], target, tokenizer, fp: str,
             progress: bool, samples: int = 0) -> TeacherData:
    """Generate and score (or reuse what an earlier run cached) the teacher data for these prompts:
    the greedy completions, plus `samples` sampled ones per prompt (each its own resumable job)."""
    from ..build import eos_ids, make_encoder

    cache_file = s.out / "data" / f"{name}.pt"
    dtype = str(target.dtype).removeprefix("torch.")  # the key names the dtype the data is made in
    greedy_key = teacher_key(s, prompts, fp, dtype)
    sample_keys = [sample_key(greedy_key, i, s.sample_temperature) for i in range(1, samples + 1)]
    key = data_key(greedy_key, *sample_keys) if samples else greedy_key
    data = TeacherData.load(cache_file, key)
    if data is not None:
        return data
    target_dir = loader.resolve_model_dir(s.target)
    eos = sorted(eos_ids(target_dir, tokenizer))
    eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else (eos[0] if eos else None)
    seqs, plens, kinds = [], [], []
    runs = [(s.out / "data" / name, greedy_key, s.train.seed, 0.0)]
    runs += [(s.out / "data" / f"{name}-sample{i}", k, s.train.seed + i, s.sample_temperature)
             for i, k in enumerate(sample_keys, start=1)]
    for gen_dir, gen_key, seed, temperature in runs:
        job = _generate(s, gen_dir, gen_key, prompts, seed, temperature, dtype, progress)
        q, p, k = sequences(job, Path(job.output.dir), tokenizer, make_encoder(tokenizer, job), eos_id)
        seqs, plens, kinds = seqs + q, plens + p, kinds + k
    if not seqs:
        raise ValueError(f"no completions to learn from in {job.output.dir} (every row failed?)")
    top_ids, top_logp, feats = score(target, seqs, s.topk, progress=progress)
    data = TeacherData([torch.tensor(q, dtype=torch.long) for q in seqs], plens, top_ids, top_logp, kinds, feats)
    data.save(cache_file, key)
    return data


def run_distill(s: DistillSettings, progress: bool = True) -> dict:
    from ..build import eos_ids

    t_start = time.perf_counter()
    device = loader.resolve_device(s.device)
    target_dir = loader.resolve_model_dir(s.target)
    tokenizer = loader.load_tokenizer(target_dir)
    target = loader.load_model(target_dir, "float32", device)
    fp = fingerprint(target_dir)
    s.out.mkdir(parents=True, exist_ok=True)
    t_dtype = teacher_dtype(s, device)

    t0 = time.perf_counter()
    # The teacher only generates and scores, never verifies a draft: its bfloat16 GEMMs may take the
    # faster, batch-variant oneDNN path (cpu_decoder.throughput_gemm; the float32 held-out data is unchanged).
    with cpu_decoder.throughput_gemm():
        teacher = target if t_dtype == "float32" else loader.load_model(target_dir, t_dtype, device)
        train_data = _teacher(s, "train", s.prompts, teacher, tokenizer, fp, progress, s.samples)
        del teacher
    held = _teacher(s, "heldout", s.heldout, target, tokenizer, fp, progress) if s.heldout else None
    data_s = time.perf_counter() - t0

    always = sorted(eos_ids(target_dir, tokenizer))
    ranked = choose_vocab(train_data, max([s.vocab] + [a.vocab or 0 for a in s.sizes]), target.spec.vocab_size,
                          always)  # most teacher mass first: every draft keeps a prefix
    coverage: dict[str, float] = {}

    target_ms = {n: step_time(target, n) * 1e3 for n in s.cost_slots}
    drafts = []
    for arch in s.sizes:
        vocab_ids = torch.sort(ranked[: arch.vocab or s.vocab]).values
        if len(vocab_ids) < (arch.vocab or s.vocab):
            print(f"spin-batch distill: {arch.name}: only {len(vocab_ids)} target ids have teacher mass in the "
                  f"training data, so its head keeps {len(vocab_ids)}, not {arch.vocab or s.vocab}", file=sys.stderr)
        coverage[str(len(vocab_ids))] = _coverage(held or train_data, vocab_ids, target.spec.vocab_size)
        net, info = train_draft(arch, train_data, target, vocab_ids, s.train, device, progress)
        net.round_to(loader.DTYPES[s.save_dtype])  # measure exactly what is saved
        row: dict = {"name": arch.name, "arch": asdict(arch), "params": sum(p.numel() for p in net.parameters()),
                     "vocab_subset": len(vocab_ids), "heldout_coverage": coverage[str(len(vocab_ids))], **info}
        if held is not None:
            row["heldout_agreement"] = agreement(net, held, device)
            if net.reads_features:
                row["heldout_agreement_step2"] = agreement(net, held, device, depth=2)
        out_dir = s.out / arch.name
        save_draft(net, out_dir, target_dir, fp, {"trained": row}, loader.DTYPES[s.save_dtype])
        model = load_draft(out_dir, target, torch.float32, device)
        row["cost_ms"] = {str(n): round(step_time(model, n) * 1e3, 3) for n in s.cost_slots}
        row["cost_vs_target_step"] = {str(n): round(row["cost_ms"][str(n)] / target_ms[n], 4) for n in s.cost_slots}
        row["dir"] = str(out_dir)
        drafts.append(row)
        _write_config_info(out_dir, row)
    report = {
        "target": s.target,
        "target_fingerprint": fp,
        "prompts": list(s.prompts),
        "heldout": list(s.heldout),
        "train_sequences": len(train_data),
        "train_tokens": train_data.num_tokens(),
        "heldout_sequences": len(held) if held is not None else 0,
        "heldout_coverage": coverage,
        "target_step_ms": {str(n): round(v, 3) for n, v in target_ms.items()},
        "data_s": round(data_s, 1),
        "total_s": round(time.perf_counter() - t_start, 1),
        "settings": {"max_tokens": s.max_tokens, "topk": s.topk, "vocab": s.vocab, "samples": s.samples,
                     "sample_temperature": s.sample_temperature, "teacher_dtype": t_dtype, **asdict(s.train)},
        "machine": {"device": str(device), "threads": torch.get_num_threads(), "cpu": platform.processor()},
        "drafts": drafts,
    }
    write_json_atomic(s.out / "report.json", report)
    (s.out / "report.md").write_text(report_markdown(report))
    return report


def _coverage(data: TeacherData, vocab_ids: torch.Tensor, vocab_size: int) -> float:
    """Fraction of completion positions whose teacher top-1 id is in the kept vocabulary."""
    kept = torch.zeros(vocab_size, dtype=torch.bool)
    kept[vocab_ids] = True
    hit = tot = 0
    for ids, plen in zip(data.top_ids, data.prompt_lens):
        top = ids[max(plen - 1, 0):-1, 0].long()
        hit += int(kept[top].sum())
        tot += top.numel()
    return round(hit / max(tot, 1), 4)


def _write_config_info(out_dir: Path, row: dict) -> None:
    """Record the measurements in the draft's config.json too (they travel with the draft)."""
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["spin_batch_draft"]["trained"] = row
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def report_markdown(r: dict) -> str:
    slots = list(r["target_step_ms"])
    kinds = sorted({k for d in r["drafts"] for k in d.get("heldout_agreement", {}) if k != "all"})
    head = ["draft", "params", "head ids (coverage)", *[f"cost @{n} slot{'s' if n != '1' else ''}" for n in slots],
            "agreement", "agreement, 2nd token", *kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    nan = float("nan")
    for d in r["drafts"]:
        agr = d.get("heldout_agreement", {})
        cells = [d["name"], f"{d['params'] / 1e6:.2f}M", f"{d['vocab_subset']} ({d['heldout_coverage']:.1%})",
                 *[f"{d['cost_vs_target_step'][n]:.3f} ({d['cost_ms'][n]:.2f} ms)" for n in slots],
                 f"{agr.get('all', nan):.3f}", f"{d.get('heldout_agreement_step2', {}).get('all', nan):.3f}",
                 *[f"{agr.get(k, nan):.2f}" for k in kinds]]
        lines.append("| " + " | ".join(cells) + " |")
    target = ", ".join(f"{v:.2f} ms at {n} slot(s)" for n, v in r["target_step_ms"].items())
    return (f"# Distilled drafts for {r['target']}\n\n"
            f"Trained on {r['train_sequences']} sequences ({r['train_tokens']} tokens); held-out: "
            f"{r['heldout_sequences']} sequences. Target decode step: {target}. Teacher data "
            f"{r['data_s'] / 60:.1f} min (training data made in {r['settings'].get('teacher_dtype', 'float32')}), "
            f"total {r['total_s'] / 60:.1f} min.\n\n"
            "Cost: one drafted token (one decode step of the draft) relative to one target decode step at the "
            "same slot count. Coverage: the share of the target's held-out next tokens inside the draft's head. "
            "Agreement: teacher-forced top-1 agreement with the target over held-out completion positions, by "
            "prompt kind; a feature-reading draft reads the target's features there (its first draft token). "
            "2nd token: the same when it reads its own predicted feature, as it does from its second draft "
            "token on.\n\n" + "\n".join(lines) + "\n")
