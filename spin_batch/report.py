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


def _points(stats) -> tuple[dict[str, dict[str, list[tuple[float, float, dict]]]], float, str, float]:
    """Each stats interval as ``(end time, length, record)`` by worker and run, and ``(t0, unit, scale)``: the
    start of the earliest interval of any worker, and seconds or (past ten minutes) minutes. An interval's
    time is its ``wall_time``, or for stats written before there was one, its run's start (from the run id)
    plus its ``time_s``."""
    cols = stats.columns
    points: dict[str, dict[str, list[tuple[float, float, dict]]]] = defaultdict(lambda: defaultdict(list))
    for rec in stats.iter_rows(named=True):
        run_id = rec.get("run_id") or ""
        t = rec.get("wall_time") if "wall_time" in cols else None
        if t is None:
            start = _run_start(run_id)
            t = (start or 0.0) + float(rec.get("time_s") or 0.0)
        dt = float(rec.get("interval_s") or 0.0)
        points[rec.get("worker") or "w0000"][run_id].append((float(t), dt, rec))
    if not points:
        return {}, 0.0, "s", 1.0
    t0 = min(t - dt for runs in points.values() for run in runs.values() for t, dt, _ in run)
    t1 = max(t for runs in points.values() for run in runs.values() for t, _, _ in run)
    unit, scale = ("min", 60.0) if t1 - t0 > 600 else ("s", 1.0)
    return points, t0, unit, scale


def timelines(stats) -> tuple[dict[str, tuple[list[float], list[float]]], str]:
    """``({worker: (elapsed times, tokens/s)}, unit)``: each stats interval at its end time, counted from
    the start of the earliest interval of any worker (:func:`_points`); the runs of one worker are one
    line with a gap (NaN) between them."""
    points, t0, unit, scale = _points(stats)
    lines = {}
    for worker in sorted(points):
        xs: list[float] = []
        ys: list[float] = []
        for run in sorted(points[worker].values(), key=lambda r: min(p[0] for p in r)):
            if xs:
                xs.append(float("nan"))
                ys.append(float("nan"))
            for t, _, rec in sorted(run, key=lambda p: p[0]):
                xs.append((t - t0) / scale)
                ys.append(float(rec.get("tokens_per_s") or 0.0))
        lines[worker] = (xs, ys)
    return lines, unit


def row_timelines(stats) -> tuple[dict[str, tuple[list[float], list[int], list[int]]], str]:
    """``({worker: (elapsed times, rows written so far, error rows so far)}, unit)``, every run of a worker
    counted on from the last; with more than one worker, ``"all"`` adds them up. Times as in
    :func:`timelines`; a line starts at 0 rows at the first interval's start."""
    points, t0, unit, scale = _points(stats)

    def cumulative(items) -> tuple[list[float], list[int], list[int]]:
        xs, done, errors = [], [], []
        n = e = 0
        for t, dt, rec in sorted(items, key=lambda p: p[0]):
            if not xs:
                xs, done, errors = [(t - dt - t0) / scale], [0], [0]
            n += int(rec.get("rows_ok") or 0) + int(rec.get("rows_error") or 0)
            e += int(rec.get("rows_error") or 0)
            xs.append((t - t0) / scale)
            done.append(n)
            errors.append(e)
        return xs, done, errors

    lines = {w: cumulative([p for run in points[w].values() for p in run]) for w in sorted(points)}
    if len(lines) > 1:
        lines["all"] = cumulative([p for runs in points.values() for run in runs.values() for p in run])
    return lines, unit


def plot(info: dict, path: Path) -> Path | None:
    """report.png: rows written (and error rows) and throughput against time, then each drafter's mean
    acceptance length and pulls. None (with a line on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("spin-batch: the PNG needs matplotlib: pip install 'spin-batch[plot]'", file=sys.stderr)
        return None
    fig = figure(info, plt)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def figure(info: dict, plt):
    """The report's figure (2 x 2 axes): rows over time, tokens/s over time, acceptance length, pulls."""
    fig, grid = plt.subplots(2, 2, figsize=(13, 8.4))
    rows_ax, speed_ax, accept_ax, pulls_ax = grid.flat
    stats = info["stats"]
    unit = "s"
    if stats.height and "tokens_per_s" in stats.columns:
        lines, unit = timelines(stats)
        for worker, (xs, ys) in lines.items():
            speed_ax.plot(xs, ys, marker=".", label=worker)
        if len(lines) > 1:
            speed_ax.legend(title="worker", fontsize=8)
    if stats.height and "rows_ok" in stats.columns:
        counts, unit = row_timelines(stats)
        for worker, (xs, done, errors) in counts.items():
            line, = rows_ax.plot(xs, done, drawstyle="steps-post", label=f"{worker} rows",
                                 linewidth=2.5 if worker == "all" else 1.5)
            if any(errors):
                rows_ax.plot(xs, errors, drawstyle="steps-post", linestyle="--", color=line.get_color(),
                             label=f"{worker} error rows")
        rows_ax.legend(fontsize=8)
    elapsed = f"elapsed time ({'minutes' if unit == 'min' else 'seconds'} since the first interval began)"
    rows_ax.set_title(f"Rows written: {info['rows']} ({info['status'].get('error', 0)} errors)")
    rows_ax.set_xlabel(elapsed)
    rows_ax.set_ylabel("rows (all runs)")
    speed_ax.set_title("Throughput per stats interval")
    speed_ax.set_xlabel(elapsed)
    speed_ax.set_ylabel("generated tokens/s")
    names = sorted(n for n, d in info["drafters"].items() if d.get("drafted"))
    accept_ax.bar(names, [(info["drafters"][n]["accepted"] + info["drafters"][n].get("spec_steps", 0))
                          / max(info["drafters"][n].get("spec_steps", 0), 1) for n in names])
    accept_ax.set_title("Mean acceptance length per drafter")
    all_names = sorted(info["drafters"])
    pulls_ax.bar(all_names, [info["drafters"][n].get("pulls", 0) for n in all_names])
    pulls_ax.set_title("Drafter usage (pulls)")
    for ax in (accept_ax, pulls_ax):
        ax.tick_params(axis="x", labelsize=8, rotation=30)
    fig.tight_layout()
    return fig
