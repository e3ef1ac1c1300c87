"""Training a draft by KL distillation against the teacher's top-k, and measuring it.

The loss at each position is the cross-entropy of the draft's distribution over the kept ids
against the teacher's top-k probabilities restricted to those ids and renormalised (KL up to
a constant). Completion positions weigh 1; prompt positions weigh `prompt_weight`, because a
draft only ever drafts inside completions.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.llama import LlamaModel
from ..models.loader import native_bf16
from ..models.segments import Segments
from .data import TeacherData
from .net import DraftArch, DraftNet


@dataclass(frozen=True)
class TrainSettings:
    epochs: float = 8.0
    steps: int | None = None  # overrides epochs
    batch_tokens: int = 2048  # padded tokens per optimizer step
    lr: float = 3e-3
    prompt_weight: float = 1.0
    seed: int = 0
    features: bool = True  # the drafts read the target's last hidden state (EAGLE-style)
    feature_weight: float = 1.0  # weight of the feature regression loss
    unroll: bool = True  # also train the second draft step, on the draft's own predicted features
    weight_decay: float = 0.0  # AdamW decoupled weight decay (a regulariser against overfitting the teacher data)
    precision: str = "auto"  # matmuls in "bfloat16" (autocast), "float32", or "auto": bf16 where it is native

    def __post_init__(self) -> None:  # rejected here, not after the teacher data is made
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")


PRECISIONS = ("auto", "bfloat16", "float32")


def choose_vocab(data: TeacherData, size: int, vocab_size: int, always: list[int],
                 prompt_weight: float = 0.1) -> torch.Tensor:
    """The `size` target ids with the most teacher probability mass, most first (completion positions
    count fully: drafts only draft inside completions)."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, logp, plen in zip(data.top_ids, data.top_logp, data.prompt_lens):
        w = torch.full((ids.shape[0], 1), prompt_weight, dtype=torch.float64)
        w[max(plen - 1, 0):] = 1.0
        mass.index_add_(0, ids.reshape(-1).long(), (logp.double().exp() * w).reshape(-1))
    for t in always:
        mass[t] = math.inf
    order = torch.sort(-mass, stable=True).indices.tolist()  # most mass first; ties by id
    return torch.tensor([i for i in order[:size] if mass[i] > 0], dtype=torch.long)  # ranked, not sorted


def _batches(data: TeacherData, batch_tokens: int, gen: torch.Generator) -> list[list[int]]:
    """Sequences grouped by length so padding stays small; batch order shuffled."""
    order = sorted(range(len(data)), key=lambda i: (len(data.tokens[i]), i))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = len(data.tokens[i]) - 1  # the longest so far: the order is ascending
        if cur and (len(cur) + 1) * n > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    perm = torch.randperm(len(out), generator=gen).tolist()
    return [out[p] for p in perm]


@dataclass
class Batch:
    x: torch.Tensor  # [B, T] input tokens
    feats: torch.Tensor | None  # [B, T, E] target features paired with the inputs (feature drafts)
    tid: torch.Tensor  # [B, T, k] teacher ids as indices into the kept ids (0 where not kept: weight 0)
    tp: torch.Tensor  # [B, T, k] teacher probabilities over the kept ids, renormalised
    w: torch.Tensor  # [B, T] position weights (0: padding)
    g: torch.Tensor | None  # [B, T, E] the target's feature at each position (regression target)


def collate(data: TeacherData, idx: list[int], lookup: torch.Tensor, prompt_weight: float, device,
            features: bool) -> Batch:
    """Row r of a sequence of length L predicts token r + 1 (teacher row r), for r < L - 1.

    A feature draft reads (token r, target feature r - 1), so its rows start at r = 1; row r's
    predicted feature is regressed onto the target's feature r.
    """
    o = 1 if features else 0
    T = max(len(data.tokens[i]) for i in idx) - 1 - o
    k = data.top_ids[idx[0]].shape[1]
    B = len(idx)
    x = torch.zeros(B, T, dtype=torch.long)
    tid = torch.full((B, T, k), -1, dtype=torch.long)
    tp = torch.zeros(B, T, k)
    w = torch.zeros(B, T)
    E = data.features[idx[0]].shape[1] if features else 0
    f_in = torch.zeros(B, T, E) if features else None
    g = torch.zeros(B, T, E) if features else None
    for b, i in enumerate(idx):
        L = len(data.tokens[i])
        n = L - 1 - o  # rows o .. L - 2
        x[b, :n] = data.tokens[i][o : L - 1]
        tid[b, :n] = lookup[data.top_ids[i][o : L - 1].long()]
        tp[b, :n] = data.top_logp[i][o : L - 1].float().exp()
        w[b, :n] = prompt_weight
        w[b, max(data.prompt_lens[i] - 1 - o, 0) : n] = 1.0
        if features:
            f_in[b, :n] = data.features[i][: L - 2].float()
            g[b, :n] = data.features[i][1 : L - 1].float()
    tp = tp * (tid >= 0)
    total = tp.sum(-1, keepdim=True)
    tp = tp / total.clamp_min(1e-9)
    w_ce = w * (total[..., 0] > 0)
    to = (lambda t: None if t is None else t.to(device))
    return Batch(x.to(device), to(f_in), tid.clamp_min(0).to(device), tp.to(device), w_ce.to(device), to(g))


class TeacherCE(torch.autograd.Function):
    """Weighted mean over positions of -sum_j tp[j] * log softmax(logits)[tid[j]].

    The same value and gradient as log_softmax + gather, but the float32 work runs in chunks of
    rows through one reused buffer, and the backward writes the gradient (softmax minus the
    scattered teacher probabilities) in one pass. A [B*T, K] float32 temporary is 32 MB at 2k
    tokens and K = 4096; on CPU each such allocation is a fresh mmap whose page faults cost more
    than the arithmetic on it (log_softmax forward and backward took 14% of a training step).
    """

    CHUNK_ELEMS = 1 << 20  # float32 elements per chunk (4 MB): heap-allocated and reused

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tid: torch.Tensor, tp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        K = logits.shape[-1]
        x, ids, p, wf = logits.reshape(-1, K), tid.reshape(-1, tid.shape[-1]), tp.reshape(-1, tp.shape[-1]), \
            w.reshape(-1).float()
        rows = max(1, TeacherCE.CHUNK_ELEMS // K)
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        buf = torch.empty(min(rows, x.shape[0]), K, dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], rows):
            c = buf[: min(rows, x.shape[0] - a)]
            c.copy_(x[a : a + rows])
            m = c.amax(-1, keepdim=True)
            lse[a : a + rows] = c.sub_(m).exp_().sum(-1).log_().add_(m[:, 0])
        picked = (p * x.gather(-1, ids).float()).sum(-1)
        n = wf.sum().clamp_min(1e-9)
        ctx.save_for_backward(logits, lse, tid, tp, wf, n)
        return ((lse * p.sum(-1) - picked) * wf).sum() / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, tid, tp, wf, n = ctx.saved_tensors
        K = logits.shape[-1]
        x, ids, p = logits.reshape(-1, K), tid.reshape(-1, tid.shape[-1]), tp.reshape(-1, tp.shape[-1])
        scale = (wf * (grad / n)).unsqueeze(-1)
        out = torch.empty_like(x)
        rows = max(1, TeacherCE.CHUNK_ELEMS // K)
        buf = torch.empty(min(rows, x.shape[0]), K, dtype=torch.float32, device=x.device)
        for a in range(0, x.shape[0], rows):
            c = buf[: min(rows, x.shape[0] - a)]
            c.copy_(x[a : a + rows]).sub_(lse[a : a + rows, None]).exp_()
            c.mul_(p[a : a + rows].sum(-1, keepdim=True))  # sum(tp) is 1, or 0 where no teacher id is kept
            c.scatter_add_(-1, ids[a : a + rows], -p[a : a + rows])
            out[a : a + rows] = c.mul_(scale[a : a + rows])
        return out.view_as(logits), None, None, None


def _ce(logits: torch.Tensor, b: Batch, w: torch.Tensor) -> torch.Tensor:
    return TeacherCE.apply(logits, b.tid, b.tp, w)


def _reg(g: torch.Tensor, b: Batch, w: torch.Tensor) -> torch.Tensor:
    mask = (w > 0).float()
    reg = F.smooth_l1_loss(g, b.g, reduction="none").mean(-1)  # [B, T]
    return (reg * mask).sum() / mask.sum().clamp_min(1)


def second_step_features(b: Batch, g: torch.Tensor) -> torch.Tensor:
    """Inputs for a second drafting step: row r reads the draft's predicted feature of row r - 1."""
    return torch.cat((b.feats[:, :1], g[:, :-1]), dim=1)


def distill_loss(net: DraftNet, b: Batch, feature_weight: float, unroll: bool) -> torch.Tensor:
    """CE against the teacher; for a feature draft, plus the feature regression, and (unroll) the same
    again with the draft reading its own predicted features, as it does from its second draft token on."""
    logits, g, kvs = net.run(b.x, b.feats)
    loss = _ce(logits, b, b.w)
    if g is None:
        return loss
    loss = loss + feature_weight * _reg(g, b, b.w)
    if unroll:
        w2 = b.w.clone()
        w2[:, 0] = 0  # row 0 has no predicted feature to read
        logits2, g2 = net.second_step(b.x, second_step_features(b, g), kvs)
        loss = loss + _ce(logits2, b, w2) + feature_weight * _reg(g2, b, w2)
    return loss


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for training matmuls: None for float32 throughout.

    "auto" picks bfloat16 where the hardware multiplies it natively (CUDA with bf16, CPUs with
    AVX512-BF16 or AMX). Weights, optimizer state, norms, the residual stream and the losses stay
    float32; only the matmul inputs are rounded, with float32 accumulation.
    """
    if precision == "float32":
        return None
    return torch.bfloat16 if precision == "bfloat16" or native_bf16(device) else None


def train_draft(arch: DraftArch, data: TeacherData, target: LlamaModel, vocab_ids: torch.Tensor,
                settings: TrainSettings, device: torch.device, progress: bool = True) -> tuple[DraftNet, dict]:
    from tqdm import tqdm

    torch.manual_seed(settings.seed)
    gen = torch.Generator().manual_seed(settings.seed)
    net = DraftNet(arch, target.embed.float(), target.norm.float(), vocab_ids, target.spec.rope_theta,
                   target.spec.rms_norm_eps, settings.features).to(device)
    lookup = torch.full((target.spec.vocab_size,), -1, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(vocab_ids.shape[0])
    per_epoch = len(_batches(data, settings.batch_tokens, torch.Generator().manual_seed(0)))
    steps = settings.steps or max(1, round(settings.epochs * per_epoch))
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=settings.lr,
                            betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    warm = max(1, min(50, steps // 20))
    amp = autocast_dtype(settings.precision, device)

    def lr_at(step: int) -> float:
        if step < warm:
            return settings.lr * (step + 1) / warm
        t = (step - warm) / max(1, steps - warm)
        return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    t0 = time.perf_counter()
    queue: list[list[int]] = []
    losses: list[float] = []
    bar = tqdm(total=steps, unit="step", desc=f"distill: {arch.name}", disable=not progress, dynamic_ncols=True)
    net.train()
    for step in range(steps):
        if not queue:
            queue = _batches(data, settings.batch_tokens, gen)
        batch = collate(data, queue.pop(), lookup, settings.prompt_weight, device, settings.features)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
            loss = distill_loss(net, batch, settings.feature_weight, settings.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.update(1)
        bar.set_postfix_str(f"loss {statistics.fmean(losses[-20:]):.3f}", refresh=False)
    bar.close()
    net.eval()
    info = {"steps": steps, "steps_per_epoch": per_epoch, "train_s": round(time.perf_counter() - t0, 1),
            "final_loss": round(statistics.fmean(losses[-20:]), 4), "lr": settings.lr, "seed": settings.seed,
            "batch_tokens": settings.batch_tokens, "train_tokens": data.num_tokens(),
            "reads_target_features": settings.features, "unroll": settings.unroll and settings.features,
            "precision": str(amp).removeprefix("torch.") if amp else "float32"}
    return net, info


@torch.inference_mode()
def agreement(net: DraftNet, data: TeacherData, device: torch.device, depth: int = 1) -> dict[str, float]:
    """Teacher-forced top-1 agreement with the target over completion positions, overall and by kind.

    depth 1: a feature draft reads the target's features (its first draft token); depth 2: it
    reads its own prediction of the previous feature (its second draft token).
    """
    hits: dict[str, list[int]] = {}
    lookup = torch.full((int(net.embed.shape[0]),), -1, dtype=torch.long)
    lookup[net.vocab_ids] = torch.arange(net.vocab_ids.shape[0])
    for i in range(len(data)):
        b = collate(data, [i], lookup, 0.0, device, net.reads_features)
        logits, g, kvs = net.run(b.x, b.feats)
        if depth == 2 and g is not None:
            logits, _ = net.second_step(b.x, second_step_features(b, g), kvs)
        pred = net.vocab_ids[logits[0].argmax(-1)].cpu()
        o = 1 if net.reads_features else 0
        want = data.top_ids[i][o : len(data.tokens[i]) - 1, 0].long()
        done = torch.arange(len(want)) >= data.prompt_lens[i] - 1 - o  # completion rows
        h = hits.setdefault(data.kinds[i], [0, 0])
        h[0] += int(((pred == want) & done).sum())
        h[1] += int(done.sum())
    out = {k: round(v[0] / v[1], 4) for k, v in sorted(hits.items()) if v[1]}
    total = [sum(v[0] for v in hits.values()), sum(v[1] for v in hits.values())]
    out["all"] = round(total[0] / max(total[1], 1), 4)
    return out


@torch.inference_mode()
def step_time(model: LlamaModel, slots: int, context: int = 128, reps: int = 15) -> float:
    """Median seconds of one decode step (one new token per slot, logits + argmax) at this batch size.

    A feature-reading draft is timed on its whole path: features in, predicted features and logits out.
    """
    cache = model.allocate_cache(slots, context + reps + 8)
    g = torch.Generator().manual_seed(0)
    feature_head = model.feature_head
    width = model.embed.shape[1]

    def step(tokens: torch.Tensor, seg: Segments, rows: list[int] | None) -> torch.Tensor:
        if feature_head is None:
            return model.forward(tokens, seg, cache, rows)
        feats = torch.randn(tokens.shape[0], width, generator=g).to(model.device, model.dtype)
        h = model.hidden(tokens, seg, cache, extra=feats)
        return feature_head(model.normed(h if rows is None else h[rows], model.norm))[0]

    prompt = torch.randint(0, model.spec.vocab_size, (slots * context,), generator=g).to(model.device)
    step(prompt, Segments.build([(s, context, 0) for s in range(slots)], model.device), [0])
    times = []
    for r in range(reps + 3):
        tok = torch.randint(0, model.spec.vocab_size, (slots,), generator=g).to(model.device)
        seg = Segments.build([(s, 1, context + r) for s in range(slots)], model.device)
        t0 = time.perf_counter()
        step(tok, seg, None).argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])
