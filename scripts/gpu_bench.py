"""The device step's GPU checks, one JSON file: versions, greedy equality of the device step with the loop, the
sync audit, the graph inventory and CUDA-event step timings (scripts/gpu_bench.sh runs it, then the demo bench).
Drafts: none, the n-gram lookup, and a model drafter's chain (EXIT_LAYERS of the target's layers over its cache,
the early-exit drafter: a model draft with no checkpoint to carry).

    python scripts/gpu_bench.py OUT_DIR [--dry]
    python scripts/gpu_bench.py OUT_DIR --summary

--dry: on the CPU with a few steps (the C kernels, no graphs, no CUDA events), to check that the script runs.
Each section records its error and the script goes on: the JSON is always written.
--summary: OUT_DIR/summary.json from what gpu_bench.sh left there: the statuses, each bench's table and
markdown, and per bench, slots and method the paired tok/s ratios (median over repeats of the method's tok/s
over the base's in the same repeat) against autoregressive on the device step and on today's loop.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from spin_batch.drafters.early_exit import EarlyExitDrafter
from spin_batch.engine.device_step import HOST_READS, DeviceDrafting, DeviceLoop, host_reads
from spin_batch.engine.loop import BatchLoop, LoopSettings
from spin_batch.models.loader import load_model, load_tokenizer, resolve_execution, resolve_model_dir
from spin_batch.records import Request, RowParams
from spin_batch.sampling import SamplingParams
from spin_batch.selection.fixed import NoSpeculation

PROMPTS = [
    "Explain how the tides work, in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number, then call it for n = 10.",
    "List the planets of the solar system in order, one per line.",
    "Summarise the plot of Romeo and Juliet. Then summarise it again in one sentence.",
    "def quicksort(xs):\n    ",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "What is 17 * 23? Show the steps.",
    "Translate to French: good morning, how are you today?",
]
AUDITED, counted = HOST_READS, host_reads  # the sync audit (engine/device_step.py)
EXIT_LAYERS = 8  # the model drafter's chain: the target's first 8 layers (of SmolLM2-135M's 30)


def device_loop(model, tok, s: LoopSettings, gamma: int, chain: bool) -> DeviceLoop:
    """The device step with n-gram drafts, or with the early-exit model chain (chain) at this gamma."""
    layers = min(EXIT_LAYERS, model.spec.num_layers)
    drafter = EarlyExitDrafter(f"exit{layers}", model, model.allocate_cache(1, 8), layers) if chain else None
    return DeviceLoop(model, tok, s, DeviceDrafting(gamma=gamma), drafter)


def settings(slots: int, max_tokens: int, max_model_len: int = 1024) -> LoopSettings:
    return LoopSettings(slots=slots, max_model_len=max_model_len, max_num_batched_tokens=512, max_tokens=max_tokens,
                        sampling=SamplingParams(), eos_token_ids=frozenset(), ignore_eos=True)


def requests(n: int, max_tokens: int | None = None) -> list[Request]:
    return [Request(source=f"mem#{i}", id=str(i), prompt=PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)),
                    messages=None, params=RowParams(max_tokens=max_tokens)) for i in range(n)]


def decode(loop, tok, reqs) -> dict[str, tuple[int, ...]]:
    done = []
    loop.run(iter(reqs), lambda r: tok.encode(r.prompt), done.append)
    return {c.request.id: c.token_ids for c in done}


def differences(want: dict, got: dict) -> dict:
    """Requests and tokens that differ (up to the first difference, the rest counts as different)."""
    rows = [k for k in want if want[k] != got.get(k)]
    tokens = sum(len(want[k]) for k in want)
    bad = 0
    for k in rows:
        a, b = want[k], got.get(k, ())
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        bad += len(a) - first
    return {"requests": len(want), "requests_differing": len(rows), "tokens": tokens,
            "token_difference_rate": round(bad / max(tokens, 1), 5)}


def run_section(out: dict, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001  (record it and go on: the JSON is the report)
        out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc(limit=6)}
    out.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 2)
    print(f"gpu_bench: {name}: {json.dumps(out[name])[:300]}", flush=True)


def main(out_dir: Path, dry: bool) -> None:
    out: dict = {"dry": dry}
    out_dir.mkdir(parents=True, exist_ok=True)

    def section(res: dict, name: str, fn) -> None:  # each section's result saved at once: a timeout keeps them
        run_section(res, name, fn)
        (out_dir / "device_step.json").write_text(json.dumps(out, indent=1))
    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda" if cuda else "cpu")

    def versions():
        import spin_batch

        v = {"python": platform.python_version(), "torch": torch.__version__, "spin_batch": spin_batch.__version__,
             "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"}
        try:
            import triton

            v["triton"] = triton.__version__
        except Exception:  # noqa: BLE001
            v["triton"] = None
        return v

    section(out, "versions", versions)
    folder = resolve_model_dir("builtin:smollm2-135m")
    tok = load_tokenizer(folder)
    execution = resolve_execution("auto", device)
    steps, n_req, max_tokens = (12, 4, 16) if dry else (200, 16, 64)

    for dtype in ("float32",) if dry else ("float32", "bfloat16"):
        model = load_model(folder, dtype=dtype, device=device, execution=execution)
        res: dict = out.setdefault(dtype, {})

        def equality():
            got = {}
            for slots in (1, 16):
                if dry and slots > 4:
                    continue
                s = settings(slots, max_tokens)
                base = BatchLoop(model, tok, s, NoSpeculation(), {}, model.allocate_cache(slots, s.max_model_len))
                want = decode(base, tok, requests(n_req))
                for gamma, chain in ((0, False), (8, False), (8, True)):
                    loop = device_loop(model, tok, s, gamma, chain)
                    got[f"slots{slots}_{loop.name}_gamma{gamma}"] = {
                        **differences(want, decode(loop, tok, requests(n_req))), **loop.stats()}
            return got

        section(res, "equality", equality)

        def audit(chain: bool):
            loop = device_loop(model, tok, settings(4, 1900, 2048), 8, chain)
            for r in requests(4, 1900):
                loop.admit(r, tok.encode(r.prompt))
            for _ in range(4):  # the buckets' eager runs and captures happen here, before the audit
                loop.queue()
                loop.collect()
            inside = {n: 0 for n in AUDITED}
            sync_error = None
            for _ in range(steps):
                if cuda:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    with counted() as calls:
                        loop.queue()
                except RuntimeError as e:
                    sync_error = sync_error or str(e)
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                for k, v in calls.items():
                    inside[k] += v
                if len(loop.queued) > 1:
                    loop.collect()
            return {"steps": steps, "python_reads_inside_step": inside, "cuda_sync_debug_error": sync_error,
                    "cuda_sync_debug": "error" if cuda else "not on CUDA", **loop.stats()}

        section(res, "sync_audit", lambda: audit(False))
        section(res, "sync_audit_model_chain", lambda: audit(True))

        def timings():
            table = {}
            for slots in (1, 16):
                for gamma, chain in ((0, False), (4, False), (8, False), (4, True), (8, True)):
                    if dry and (slots > 1 or gamma == 4):
                        continue
                    loop = device_loop(model, tok, settings(slots, 900, 1024), gamma, chain)
                    for r in requests(slots, 900):
                        loop.admit(r, tok.encode(r.prompt))
                    for _ in range(3):
                        loop.queue()
                        loop.collect()
                    lengths0 = sum(len(s.tokens) for s in loop.slots if s is not None)
                    n = 10 if dry else 50
                    start = torch.cuda.Event(enable_timing=True) if cuda else None
                    end = torch.cuda.Event(enable_timing=True) if cuda else None
                    t0 = time.perf_counter()
                    if cuda:
                        start.record()
                    for _ in range(n):
                        loop.queue()
                        if len(loop.queued) > 1:
                            loop.collect()
                    if cuda:
                        end.record()
                    while loop.queued:
                        loop.collect()
                    wall = time.perf_counter() - t0
                    made = sum(len(s.tokens) for s in loop.slots if s is not None) - lengths0
                    row = {"steps": n, "wall_ms_per_step": round(1000 * wall / n, 3), "tokens": made,
                           "tokens_per_step": round(made / n, 3), "tok_per_s_wall": round(made / wall, 1)}
                    if cuda:
                        row["cuda_ms_per_step"] = round(start.elapsed_time(end) / n, 3)
                    table[f"slots{slots}_{loop.name}_gamma{gamma}"] = row
                base = BatchLoop(model, tok, settings(slots, 900, 1024), NoSpeculation(), {},
                                 model.allocate_cache(slots, 1024))
                for r in requests(slots, 900):
                    base.admit(r, tok.encode(r.prompt))
                for _ in range(4):
                    base.step()
                n = 10 if dry else 50
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    base.step()
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                table[f"slots{slots}_batchloop_autoregressive"] = {"steps": n, "wall_ms_per_step": round(1000 * wall / n, 3),
                                                                   "tok_per_s_wall": round(slots * n / wall, 1)}
            return table

        section(res, "timings", timings)
        del model
        if cuda:
            torch.cuda.empty_cache()
    print(f"gpu_bench: wrote {out_dir / 'device_step.json'}")


BASES = ("device:autoregressive", "autoregressive")


def paired_ratios(runs: list[dict]) -> dict:
    """{slots: {method: {vs base: median ratio}}} from a bench's bench_runs rows (method, slots, repeat,
    tokens_per_s)."""
    import statistics

    tok = {(r["method"], r["slots"], r["repeat"]): r["tokens_per_s"] for r in runs}
    out: dict = {}
    for method, slots, repeat in sorted(tok):
        for base in BASES:
            b = tok.get((base, slots, repeat))
            if b and method != base:
                out.setdefault(slots, {}).setdefault(method, {}).setdefault(f"vs {base}", []).append(
                    tok[method, slots, repeat] / b)
    return {s: {m: {k: round(statistics.median(v), 3) for k, v in d.items()} for m, d in ms.items()}
            for s, ms in out.items()}


def summarize(out_dir: Path) -> None:
    import pyarrow.parquet as pq

    status = out_dir / "status.txt"
    summary: dict = {"status": status.read_text().splitlines() if status.exists() else []}
    for d in sorted(p for p in out_dir.glob("bench-*") if p.is_dir()):
        entry: dict = {}
        try:
            entry["markdown"] = (d / "bench.md").read_text()
            entry["table"] = pq.read_table(d / "bench.parquet").to_pylist()
            entry["ratios"] = paired_ratios(pq.read_table(d / "bench_runs.parquet").to_pylist())
        except Exception as e:  # noqa: BLE001  (a bench that timed out or failed leaves less: say so, go on)
            entry["error"] = f"{type(e).__name__}: {e}"
        summary[d.name] = entry
    for p in sorted(out_dir.glob("speed-*.json")):  # scripts/gpu_bench_speed.sh: speed only, replayed acceptance
        try:
            data = json.loads(p.read_text())
            summary[p.stem] = {"label": data["label"], "markdown": p.with_suffix(".md").read_text(),
                               "break_even": data["break_even"], "rows": data["rows"]}
        except Exception as e:  # noqa: BLE001
            summary[p.stem] = {"error": f"{type(e).__name__}: {e}"}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    for name, entry in summary.items():
        if name.startswith("bench-"):
            print(f"gpu_bench: {name} ratios: {json.dumps(entry.get('ratios', entry.get('error')))}")
    print(f"gpu_bench: {out_dir / 'summary.json'}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--dry", "--summary")]
    out = Path(args[0] if args else "gpu_out")
    if "--summary" in sys.argv[1:]:
        summarize(out)
    else:
        main(out, "--dry" in sys.argv[1:])
