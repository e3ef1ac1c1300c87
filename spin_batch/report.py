"""`spin-batch report OUTPUT_DIR`: a finished or running job at a glance (table + PNG)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from .io.writer import read_outputs, read_stats


def load(out_dir: Path) -> dict:
    """Everything the report shows, from outputs, stats parts and summaries (any may be missing)."""
    outputs = read_outputs(out_dir)
    stats = read_stats(out_dir)
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
        "stats": stats,
    }


def text_table(info: dict) -> str:
    lines = [
        f"job output: {info['out_dir']}",
        f"rows: {info['rows']}  " + "  ".join(f"{k}={v}" for k, v in sorted(info["status"].items(), key=str)),
        "finish: " + "  ".join(f"{k}={v}" for k, v in sorted(info["finish_reason"].items(), key=str)),
        f"tokens: prompt {info['prompt_tokens']}, completion {info['completion_tokens']}",
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
    if stats.height and "tokens_per_s" in stats.columns:
        axes[0].plot(range(stats.height), stats["tokens_per_s"].to_list(), marker=".")
    axes[0].set_title("Throughput per stats interval")
    axes[0].set_xlabel("interval")
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
