"""`spin-batch bench`'s pictures: throughput against slots and acceptance per drafter (matplotlib, the `plot`
extra; without it, a line saying so and no pictures)."""

from __future__ import annotations

import sys
from pathlib import Path

from .bench_methods import MethodRun


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
    for m in dict.fromkeys(r["method"] for r in rows):  # the table's order (bench.table)
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
