"""`spin-batch bench-speed`: speed only, at the sizes GPU users run (docs/gpu.md, "The speed-only bench").

Random-weight targets of Llama-3.2-1B and Llama-3.1-8B shapes (models/speed_shapes.py), with random drafts of
the shipped distilled drafts' shapes, an EAGLE-sized one-layer draft and n-gram, on the device step
(engine/device_step.py). Random weights accept nothing, so acceptance is replayed (engine/replay.py): each
verify step commits the accepted length a recorded trace of a real run says, and the figures are speed only:
tokens/s of autoregressive decoding and of each drafter at the replayed acceptance, and the speedup, at each
slot count; then each drafter again at fixed acceptance lengths 0..gamma, so that the break-even acceptance
length (the least at which drafting pays) shows per shape and slot count.

The traces (data/acceptance_traces.json) are per-step accepted lengths of the demo job on the embedded model,
one drafter fixed, no confidence gate, at gamma RECORDED_GAMMA (`python -m spin_batch.bench_speed --record
jobs/demo.yaml` rewrites them). Replayed at a smaller gamma g a recorded length a becomes min(a, g): a chain's
first g tokens are the same whatever the chain's length. The EAGLE-sized draft replays the most accurate
shipped draft's trace (d1x384-k4096, also feature-reading): a real EAGLE draft on an 8B target accepts more.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .engine.replay import Replay, replay_loop
from .models.loader import resolve_device
from .models.speed_shapes import EAGLE, SHAPES, SHIPPED_DRAFTS, cache_bytes, draft_bytes, draft_shape, \
    random_draft, random_target, target_bytes
from .records import Request, RowParams

LABEL = "speed only: random weights, replayed acceptance"
TRACES = Path(__file__).resolve().parent / "data" / "acceptance_traces.json"
DRAFTERS = (*SHIPPED_DRAFTS, EAGLE, "ngram")
TRACE_OF = {**{d: d for d in SHIPPED_DRAFTS}, EAGLE: "d1x384-k4096", "ngram": "ngram"}  # the trace each replays
RECORDED_GAMMA = 8  # the demo job's num_speculative_tokens
WARM_STEPS = 3  # per point, untimed: the bucket's eager run, its capture (CUDA) and a replay
HEADROOM = 1.2  # the memory check's margin over its estimate (workspace, the allocator)


@dataclass(frozen=True)
class SpeedConfig:
    shape: str
    dtype: torch.dtype
    device: torch.device
    slots: tuple[int, ...] = (1, 16)
    drafters: tuple[str, ...] = DRAFTERS
    gamma: int = 4
    accept: tuple[int, ...] | None = None  # the fixed acceptance lengths of the sweep (None: 0..gamma)
    steps: int = 20  # timed steps per point
    prompt_len: int = 64
    repeat: int = 1
    budget_s: float | None = None  # no point starts past this many seconds (its rows say "skipped")
    seed: int = 0

    @property
    def sweep(self) -> tuple[int, ...]:
        return tuple(range(self.gamma + 1)) if self.accept is None else self.accept

    @property
    def max_model_len(self) -> int:
        """Room for the prompt and every step of a point at full acceptance."""
        return self.prompt_len + (WARM_STEPS + self.steps + 2) * (self.gamma + 1) + 1


def config_problem(cfg: SpeedConfig) -> str | None:
    """What is wrong with the options, or None."""
    if cfg.shape not in SHAPES:
        return f"--shape {cfg.shape!r}: use one of {', '.join(SHAPES)}"
    bad = [d for d in cfg.drafters if d not in DRAFTERS]
    if bad:
        return f"--drafters: no drafter {', '.join(bad)} (have: {', '.join(DRAFTERS)})"
    if not 1 <= cfg.gamma <= RECORDED_GAMMA:
        return f"--gamma must be 1..{RECORDED_GAMMA} (the traces were recorded at gamma {RECORDED_GAMMA}), got {cfg.gamma}"
    if any(not 0 <= k <= cfg.gamma for k in cfg.sweep):
        return f"--accept: each length 0..gamma ({cfg.gamma}), got {list(cfg.sweep)}"
    if min(cfg.slots, default=0) < 1 or cfg.steps < 1 or cfg.repeat < 1 or cfg.prompt_len < 4:
        return "--slots, --steps and --repeat must be >= 1, --prompt-len >= 4"
    return None


def available_bytes(device: torch.device) -> int:
    """Memory free for this bench: the GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def needed_bytes(cfg: SpeedConfig) -> int:
    """The estimate the memory check compares: the target, every draft, the largest point's caches and logits."""
    spec, dtype = SHAPES[cfg.shape], cfg.dtype
    P, L = max(cfg.slots) + 1, cfg.max_model_len + 17
    drafts = [d for d in cfg.drafters if d != "ngram"]
    kv = cache_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, P, L, dtype)
    for d in drafts:
        s = draft_shape(d, spec)
        kv_d = cache_bytes(s.layers, s.kv_heads, s.hidden // s.heads, P, L, dtype)
        kv = max(kv, cache_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, P, L, dtype) + kv_d)
    logits = 3 * P * (cfg.gamma + 1) * spec.vocab_size * 4
    weights = target_bytes(spec, dtype) + sum(draft_bytes(d, spec, dtype) for d in drafts)
    return int(HEADROOM * (weights + kv + logits))


def memory_problem(cfg: SpeedConfig) -> str | None:
    """Why the shape does not fit the device's memory, or None (before anything is allocated)."""
    need, free = needed_bytes(cfg), available_bytes(cfg.device)
    if need <= free:
        return None
    dt = str(cfg.dtype).removeprefix("torch.")
    return (f"--shape {cfg.shape} in {dt} needs about {need / 2**30:.1f} GiB (weights, caches, logits at "
            f"{max(cfg.slots)} slots); {cfg.device.type} has {free / 2**30:.1f} GiB free. Use a smaller --shape, "
            f"--dtype bfloat16, fewer --slots or --drafters, or a device with more memory")


def load_traces(path: Path = TRACES) -> dict[str, list[int]]:
    """{drafter: per-step accepted lengths} of the recorded real runs."""
    data = json.loads(path.read_text())
    return {name: [int(c) for c in t["accepted"]] for name, t in data["drafters"].items()}


def time_point(target, name: str | None, slots: int, trace: list[int] | None, cfg: SpeedConfig, drafts: dict,
               seed: int) -> dict:
    """One timed point: `slots` requests of random prompts admitted, WARM_STEPS untimed steps, cfg.steps timed;
    the tokens committed per second and the acceptance the steps achieved (drafted steps only)."""
    loop = replay_loop(target, slots, cfg.max_model_len, cfg.prompt_len, cfg.gamma,
                       None if name is None else drafts.get(name, name))
    if trace is not None:
        loop.replay = Replay(trace, loop.P, target.spec.vocab_size, target.device)
    g = torch.Generator().manual_seed(seed)
    for i in range(slots):  # a random block of 16 ids repeated: text that n-gram lookups find matches in
        block = torch.randint(0, target.spec.vocab_size, (16,), generator=g).tolist()
        ids = (block * (cfg.prompt_len // 16 + 1))[: cfg.prompt_len]
        loop.admit(Request(source="speed", id=str(i), prompt="", messages=None, params=RowParams()), ids)
    for _ in range(WARM_STEPS):
        loop.queue()
        loop.collect()
    live = [s for s in loop.slots if s is not None]
    before = [(len(s.tokens), s.spec_steps, s.accepted_tokens) for s in live]
    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(cfg.steps):
        loop.queue()
        if len(loop.queued) > 1:
            loop.collect()
    while loop.queued:
        loop.collect()
    wall = time.perf_counter() - t0
    made = sum(len(s.tokens) - b[0] for s, b in zip(live, before))
    spec = sum(s.spec_steps - b[1] for s, b in zip(live, before))
    acc = sum(s.accepted_tokens - b[2] for s, b in zip(live, before))
    return {"tok_s": made / wall, "ms_per_step": 1000 * wall / cfg.steps, "tokens": made,
            "acceptance": acc / spec if spec else 0.0, "graphs": loop.stats()["captured"]}


def _points(cfg: SpeedConfig, traces: dict[str, list[int]]) -> list[tuple[str | None, str, list[int] | None]]:
    """(drafter or None, acceptance source, trace) per point of one slot count: autoregressive first."""
    out: list = [(None, "none", None)]
    for d in cfg.drafters:
        out.append((d, f"trace:{TRACE_OF[d]}", [min(a, cfg.gamma) for a in traces[TRACE_OF[d]]]))
    for d in cfg.drafters:
        out += [(d, f"fixed:{k}", [k]) for k in cfg.sweep]
    return out


def run_speed(cfg: SpeedConfig, say=lambda line: None, write=lambda rows: None) -> list[dict]:
    """Every point at every slot count, `repeat` times (interleaved); one row per point: tok/s (median), the
    speedup (median of the ratios to autoregressive of the same repeat), the acceptance replayed and achieved.
    write(rows) after each slot count; points past cfg.budget_s are rows marked skipped."""
    t_start = time.perf_counter()
    traces = load_traces()
    target = random_target(cfg.shape, cfg.dtype, cfg.device, cfg.seed)
    drafts = {d: random_draft(d, target, cfg.seed + 1 + i) for i, d in enumerate(cfg.drafters) if d != "ngram"}
    rows: list[dict] = []
    for slots in cfg.slots:
        points = _points(cfg, traces)
        got: dict[int, list[dict]] = {i: [] for i in range(len(points))}
        for r in range(cfg.repeat):
            for i, (name, source, trace) in enumerate(points):
                if cfg.budget_s is not None and time.perf_counter() - t_start > cfg.budget_s:
                    break
                got[i].append(time_point(target, name, slots, trace, cfg, drafts, cfg.seed + r))
        base = got[0]
        for i, (name, source, trace) in enumerate(points):
            row = {"label": LABEL, "shape": cfg.shape, "dtype": str(cfg.dtype).removeprefix("torch."),
                   "device": cfg.device.type, "slots": slots, "drafter": name or "autoregressive",
                   "gamma": cfg.gamma if name else 0, "acceptance_source": source,
                   "acceptance_replayed": round(statistics.mean(trace), 3) if trace else None}
            runs = got[i]
            if not runs:
                rows.append({**row, "skipped": "past --budget-s"})
                continue
            ratios = [p["tok_s"] / b["tok_s"] for p, b in zip(runs, base)]
            row.update(acceptance=round(statistics.mean(p["acceptance"] for p in runs), 3),
                       tok_s=round(statistics.median(p["tok_s"] for p in runs), 1),
                       ms_per_step=round(statistics.median(p["ms_per_step"] for p in runs), 3),
                       speedup=round(statistics.median(ratios), 3) if ratios else None, repeats=len(runs),
                       graphs=runs[-1]["graphs"])
            rows.append(row)
            say(line(row))
        write(rows)
    return rows


def line(row: dict) -> str:
    if "skipped" in row:
        return f"{LABEL}: {row['shape']} {row['slots']} slots {row['drafter']} {row['acceptance_source']}: skipped"
    speed = f", {row['speedup']:.2f}x" if row["drafter"] != "autoregressive" and row.get("speedup") else ""
    return (f"{LABEL}: {row['shape']} {row['dtype']} {row['device']} {row['slots']} slots {row['drafter']} "
            f"({row['acceptance_source']}, acceptance {row['acceptance']:.2f}): {row['tok_s']:.1f} tok/s{speed}")


def break_even(rows: list[dict]) -> dict[tuple[int, str], float | None]:
    """Per (slots, drafter): the least acceptance length at which the speedup reaches 1, interpolated linearly
    between the sweep's points on the achieved acceptance (None: not within the sweep)."""
    out: dict = {}
    for row in rows:
        if row["acceptance_source"].startswith("fixed:") and "skipped" not in row:
            out.setdefault((row["slots"], row["drafter"]), []).append((row["acceptance"], row["speedup"]))
    found = {}
    for key, pts in out.items():
        pts.sort()
        found[key] = None
        for (a0, s0), (a1, s1) in zip([(None, None), *pts], pts):
            if s1 >= 1.0:
                found[key] = a1 if a0 is None or s0 >= 1.0 or s1 == s0 else round(a0 + (1 - s0) * (a1 - a0) / (s1 - s0), 2)
                break
    return found


def markdown(rows: list[dict]) -> str:
    """Two tables: tok/s and speedup at the replayed traces; speedup against acceptance length (the sweep)."""
    done = [r for r in rows if "skipped" not in r]
    if not done:
        return f"## {LABEL}\n\nno point ran (--budget-s)\n"
    head = done[0]
    out = [f"## {head['shape']}, {head['dtype']}, {head['device']} ({LABEL})", "",
           "| slots | drafter | trace replayed (its mean) | acceptance | tok/s | speedup vs autoregressive |",
           "|---|---|---|---|---|---|"]
    for r in done:
        if not r["acceptance_source"].startswith("fixed:"):
            ar = r["drafter"] == "autoregressive"
            trace = "-" if ar else f"{r['acceptance_source'].removeprefix('trace:')} ({r['acceptance_replayed']:.2f})"
            out.append(f"| {r['slots']} | {r['drafter']} | {trace} | {'-' if ar else format(r['acceptance'], '.2f')} | "
                       f"{r['tok_s']:.1f} | {'1.00' if ar else format(r['speedup'], '.2f')} |")
    sweep = sorted({int(r["acceptance_source"].split(":")[1]) for r in done if r["acceptance_source"].startswith("fixed:")})
    if sweep:
        out += ["", f"### Speedup against acceptance length ({LABEL})", "",
                "| slots | drafter | " + " | ".join(f"accept {k}" for k in sweep) + " | break-even |",
                "|---|---|" + "---|" * (len(sweep) + 1)]
        cells: dict = {}
        for r in done:
            if r["acceptance_source"].startswith("fixed:"):
                cells[(r["slots"], r["drafter"], int(r["acceptance_source"].split(":")[1]))] = r["speedup"]
        even = break_even(done)
        for slots, d in dict.fromkeys((s, d) for s, d, _ in cells):
            vals = " | ".join(f"{cells[(slots, d, k)]:.2f}" if (slots, d, k) in cells else "-" for k in sweep)
            be = even.get((slots, d))
            out.append(f"| {slots} | {d} | {vals} | {'none within the sweep' if be is None else f'{be:.2f}'} |")
    return "\n".join(out) + "\n"


def write_results(rows: list[dict], out: Path, cfg: SpeedConfig) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"speed-{cfg.shape}"
    meta = {"label": LABEL, "shape": cfg.shape, "dtype": str(cfg.dtype).removeprefix("torch."),
            "device": cfg.device.type, "gamma": cfg.gamma, "steps": cfg.steps, "prompt_len": cfg.prompt_len,
            "repeat": cfg.repeat, "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda" else "cpu"}
    even = [{"slots": s, "drafter": d, "break_even_acceptance": v} for (s, d), v in break_even(rows).items()]
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    paths["json"].write_text(json.dumps({**meta, "rows": rows, "break_even": even}, indent=1))
    paths["markdown"].write_text(markdown(rows))
    return paths


def make_config(shape: str, slots: str, device: str, dtype: str, drafters: str | None, gamma: int,
                accept: str | None, steps: int, prompt_len: int, repeat: int, budget_s: float | None) -> SpeedConfig:
    """The CLI's options as a SpeedConfig; raises ValueError with the option's name."""
    try:
        dev = resolve_device(device)
    except RuntimeError as e:
        raise ValueError(f"--device: {e}") from None
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype {dtype!r}: use float32, bfloat16, float16 or auto")
    try:
        slot_list = tuple(int(x) for x in slots.split(","))
        sweep = None if accept is None else tuple(int(x) for x in accept.split(","))
    except ValueError:
        raise ValueError(f"--slots {slots!r} / --accept {accept!r}: comma-separated integers") from None
    names = DRAFTERS if drafters is None else tuple(d.strip() for d in drafters.split(",") if d.strip())
    cfg = SpeedConfig(shape, getattr(torch, dtype), dev, slot_list, names, gamma, sweep, steps, prompt_len, repeat,
                      budget_s)
    problem = config_problem(cfg)
    if problem:
        raise ValueError(problem)
    return cfg


# -- recording the traces (a real run of the demo job on the embedded model) ---------------------------------


def record_traces(job_path: str, drafters: tuple[str, ...] = ("ngram", *SHIPPED_DRAFTS), limit: int = 16,
                  max_tokens: int = 64, slots: int = 16, path: Path = TRACES) -> dict:
    """Rewrite the traces: per drafter, each step's accepted length over the job's first `limit` prompts, with
    that drafter fixed for every slot at gamma RECORDED_GAMMA and no confidence gate (the loop, greedy)."""
    from .bench import load_bench_input
    from .build import build_engine
    from .config import load_job
    from .engine.loop import BatchLoop
    from .selection.fixed import FixedDrafter
    from .stats import RunStats

    class Recording(FixedDrafter):
        def __init__(self, name: str):
            super().__init__(name, RECORDED_GAMMA)
            self.accepted: list[int] = []

        def learn(self, step, outcomes, costs) -> None:
            self.accepted += [o.accepted for o in outcomes if o.choice.drafter == self.drafter]

    job = load_job(job_path, ())
    job = replace(job, batch=replace(job.batch, slots=slots), sampling=replace(job.sampling, max_tokens=max_tokens),
                  spin=replace(job.spin, num_speculative_tokens=RECORDED_GAMMA))
    engine = build_engine(job)
    data = load_bench_input(job, engine, limit)
    out = {"source": f"{job_path}: {job.target.model}, {job.target.dtype}, the first {limit} prompts, max_tokens "
                     f"{max_tokens}, {slots} slots, one drafter fixed at gamma {RECORDED_GAMMA}, no confidence gate, "
                     "greedy; per drafter, each step's accepted draft length in step order (one digit a step)",
           "gamma": RECORDED_GAMMA, "drafters": {}}
    for name in drafters:
        policy = Recording(name)
        loop = BatchLoop(engine.target, engine.tokenizer, replace(engine.loop.cfg, pipeline=False), policy,
                         engine.loop.drafters, cache=engine.loop.cache, stats=RunStats())
        loop.run(iter(data.requests), data.encode, lambda c: None)
        acc = policy.accepted
        out["drafters"][name] = {"steps": len(acc), "mean": round(sum(acc) / max(len(acc), 1), 3),
                                 "accepted": "".join(str(a) for a in acc)}
        print(f"{name}: {len(acc)} steps, mean accepted {out['drafters'][name]['mean']}", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["--record"] or len(sys.argv) != 3:
        sys.exit("usage: python -m spin_batch.bench_speed --record JOB.yaml")
    record_traces(sys.argv[2])
