"""`spin-batch report OUTPUT_DIR`: a finished or running job at a glance (table + PNG)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from .io.outputs import read_outputs, read_stats


def load(out_dir: Path) -> dict:
    """Everything the report shows, from outputs, stats parts and summaries (any may be missing)."""
    outputs = read_outputs(out_dir)
    stats = read_stats(out_dir, parts=True)
    summaries = [json.loads(p.read_text()) for p in sorted(out_dir.glob("summary*.json"))]
    rows = outputs.height
    status = dict(outputs.group_by("status").len().iter_rows()) if rows else {}
    finish = dict(outputs.group_by("finish_reason").len().iter_rows()) if rows else {}
    drafters: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    if stats.height:
        for col in stats.columns:
            if "." in col:
                key, name = col.split(".", 1)
                drafters[name][key] += float(stats[col].fill_null(0).sum())
    gen = float(outputs["completion_tokens"].sum()) if rows else 0.0
    # Every run writes parts of its own (part-/stats-<worker>-<run id>-<seq>), and each summary-*.json holds
    # its worker's last run only: runs are counted from the parts, and decode time and throughput come from
    # the stats intervals of all runs (a run killed with -9 loses its last interval, up to stats_interval_s).
    parts = [*(out_dir / "outputs").glob("part-*.parquet"), *(out_dir / "stats").glob("stats-*.parquet")]
    runs = {tuple(p.name.split("-")[1:3]) for p in parts}  # (worker, run id)
    prefill = {k: float(stats[f"{k}_tokens"].fill_null(0).sum()) if f"{k}_tokens" in stats.columns else 0.0
               for k in ("prefill", "reused")}  # prompt tokens computed, and copied in (prefix cache, samples)
    if stats.height:
        run_time = float(stats["interval_s"].sum())
        tokens = float(stats["generated_tokens"].sum())
    else:
        run_time = sum(s.get("wall_time_s", 0.0) for s in summaries)
        tokens = sum(s.get("generated_tokens", 0) for s in summaries)
    return {
        "out_dir": str(out_dir),
        "rows": rows,
        "status": status,
        "finish_reason": finish,
        "completion_tokens": int(gen),
        "prompt_tokens": int(outputs["prompt_tokens"].sum()) if rows else 0,
        "runs": max(len(runs), len(summaries)),
        "finished": bool(summaries) and all(s.get("finished") for s in summaries),
        "decode_time_s": run_time,
        "tokens_per_s": tokens / run_time if run_time else None,
        "drafters": {k: dict(v) for k, v in drafters.items()},
        "prefill_tokens": int(prefill["prefill"]),
        "reused_tokens": int(prefill["reused"]),
        "stats": stats,
    }


def text_table(info: dict) -> str:
    lines = [
        f"job output: {info['out_dir']}",
        f"rows: {info['rows']}  " + "  ".join(f"{k}={v}" for k, v in sorted(info["status"].items(), key=str)),
        "finish: " + "  ".join(f"{k}={v}" for k, v in sorted(info["finish_reason"].items(), key=str)),
        f"tokens: prompt {info['prompt_tokens']}, completion {info['completion_tokens']}",
        prefill_line(info.get("prefill_tokens", 0), info.get("reused_tokens", 0)),
        f"runs: {info['runs']} ({'finished' if info['finished'] else 'running or interrupted'}), decode time "
        f"{info['decode_time_s']:.1f}s" + (f", {info['tokens_per_s']:.1f} tok/s" if info["tokens_per_s"] else ""),
        "",
        f"{'drafter':<16}{'pulls':>8}{'drafted':>10}{'accepted':>10}{'accept rate':>13}{'accept len':>12}",
    ]
    for name, d in sorted(info["drafters"].items()):
        drafted, acc, spec = d.get("drafted", 0), d.get("accepted", 0), d.get("spec_steps", 0)
        rate = f"{acc / drafted:.2f}" if drafted else "-"
        length = f"{(acc + spec) / spec:.2f}" if spec else "-"
        lines.append(f"{name:<16}{int(d.get('pulls', 0)):>8}{int(drafted):>10}{int(acc):>10}{rate:>13}{length:>12}")
    return "\n".join(lines)


def prefill_line(prefilled: int, reused: int) -> str:
    """Prompt tokens the target computed and those reused (prefix cache, n samples), and the hit rate."""
    total = prefilled + reused
    rate = f"{reused / total:.1%}" if total else "-"
    return f"prefill: {prefilled} prompt tokens computed, {reused} reused (prefix hit rate {rate})"


def _run_start(run_id: str) -> float | None:
    """The UTC start time (epoch seconds) a run id begins with (``20250101T120000123456_3fa9c2``)."""
    try:
        return datetime.strptime(run_id.split("_")[0], "%Y%m%dT%H%M%S%f").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def timelines(stats) -> tuple[dict[str, tuple[list[float], list[float]]], str]:
    """``({worker: (elapsed times, tokens/s)}, unit)``: each stats interval at its end time, counted from
    the start of the earliest interval of any worker, in seconds or (past ten minutes) minutes; the runs
    of one worker are one line with a gap (NaN) between them. An interval's time is its ``wall_time``,
    or for stats written before there was one, its run's start (from the run id) plus its ``time_s``."""
    cols = stats.columns
    points: dict[str, dict[str, list[tuple[float, float, float]]]] = defaultdict(lambda: defaultdict(list))
    for rec in stats.iter_rows(named=True):
        run_id = rec.get("run_id") or ""
        t = rec.get("wall_time") if "wall_time" in cols else None
        if t is None:
            start = _run_start(run_id)
            t = (start or 0.0) + float(rec.get("time_s") or 0.0)
        dt = float(rec.get("interval_s") or 0.0)
        points[rec.get("worker") or "w0000"][run_id].append((float(t), dt, float(rec.get("tokens_per_s") or 0.0)))
    if not points:
        return {}, "s"
    t0 = min(t - dt for runs in points.values() for run in runs.values() for t, dt, _ in run)
    t1 = max(t for runs in points.values() for run in runs.values() for t, _, _ in run)
    unit, scale = ("min", 60.0) if t1 - t0 > 600 else ("s", 1.0)
    lines = {}
    for worker in sorted(points):
        xs: list[float] = []
        ys: list[float] = []
        for run in sorted(points[worker].values(), key=lambda r: min(p[0] for p in r)):
            if xs:
                xs.append(float("nan"))
                ys.append(float("nan"))
            for t, _, tps in sorted(run):
                xs.append((t - t0) / scale)
                ys.append(tps)
        lines[worker] = (xs, ys)
    return lines, unit


def plot(info: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("spin-batch: the PNG needs matplotlib: pip install 'spin-batch[plot]'", file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    stats = info["stats"]
    unit = "s"
    if stats.height and "tokens_per_s" in stats.columns:
        lines, unit = timelines(stats)
        for worker, (xs, ys) in lines.items():
            axes[0].plot(xs, ys, marker=".", label=worker)
        if len(lines) > 1:
            axes[0].legend(title="worker", fontsize=8)
    axes[0].set_title("Throughput per stats interval")
    axes[0].set_xlabel(f"elapsed time ({'minutes' if unit == 'min' else 'seconds'} since the first interval began)")
    axes[0].set_ylabel("generated tokens/s")
    names = sorted(n for n, d in info["drafters"].items() if d.get("drafted"))
    axes[1].bar(names, [(info["drafters"][n]["accepted"] + info["drafters"][n].get("spec_steps", 0))
                        / max(info["drafters"][n].get("spec_steps", 0), 1) for n in names])
    axes[1].set_title("Mean acceptance length per drafter")
    all_names = sorted(info["drafters"])
    axes[2].bar(all_names, [info["drafters"][n].get("pulls", 0) for n in all_names])
    axes[2].set_title("Drafter usage (pulls)")
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelsize=8, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
