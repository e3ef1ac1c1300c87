"""Run counters: observed once per step, derived in one place (interval records, summary)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

STAGES = ("select", "draft", "verify", "accept", "commit", "learn")
# Every interval record has these totals' columns, observed or not, so that all stats parts of a
# job share one schema (a resume with nothing to do wrote 4 columns where a run wrote 28, and
# reading stats/*.parquet as one table failed).
TOTALS = ("steps", "forward_tokens", "prefill_tokens", "reused_tokens", "generated_tokens", "packed_cells", "padded_cells",
          "active_slot_steps", *(f"time_{stage}_s" for stage in STAGES), "rows_ok", "rows_error", "prompt_tokens")
DRAFTER_KEYS = ("drafted", "accepted", "spec_steps", "pulls")


@dataclass
class StepRecord:
    """What one BatchLoop.step did. Filled by the loop; read only here."""

    active: int  # slots busy during the step
    forward_tokens: int  # N of the packed target forward
    prefill_tokens: int  # of which prompt chunk tokens
    generated: int  # tokens committed to outputs this step
    packed_cells: int  # query x key cells computed
    padded_cells: int  # query x key cells a padded batch would have cost
    stage_s: dict[str, float]
    drafted: dict[str, int] = field(default_factory=dict)  # per drafter: draft tokens proposed
    accepted: dict[str, int] = field(default_factory=dict)  # per drafter: draft tokens accepted
    spec_steps: dict[str, int] = field(default_factory=dict)  # per drafter: verified segments with >= 1 draft
    pulls: dict[str, int] = field(default_factory=dict)  # per drafter (or "none"): times chosen
    reused_tokens: int = 0  # prompt tokens copied into slots (prefix cache, a sibling sample) instead of prefilled


class RunStats:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.t0 = clock()
        self.totals: dict[str, float] = defaultdict(float)
        self.per_drafter: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.drafter_names: list[str] = []  # whose columns every interval record has (declare_drafters)
        self._last_interval = dict(self.totals)
        self._last_drafter: dict[str, int] = {}
        self._last_t = self.t0

    def declare_drafters(self, names) -> None:
        """Give every interval record the per-drafter columns of these names ("none" and the job's
        drafters), pulled or not."""
        self.drafter_names = list(dict.fromkeys([*self.drafter_names, *names]))

    def restart_clock(self) -> None:
        """Start timing now (throughput excludes what came before, e.g. model load)."""
        self.t0 = self._last_t = self.clock()

    def observe(self, rec: StepRecord) -> None:
        t = self.totals
        t["steps"] += 1
        t["forward_tokens"] += rec.forward_tokens
        t["prefill_tokens"] += rec.prefill_tokens
        t["reused_tokens"] += rec.reused_tokens
        t["generated_tokens"] += rec.generated
        t["packed_cells"] += rec.packed_cells
        t["padded_cells"] += rec.padded_cells
        t["active_slot_steps"] += rec.active
        for stage, s in rec.stage_s.items():
            t[f"time_{stage}_s"] += s
        for key, src in (("drafted", rec.drafted), ("accepted", rec.accepted), ("spec_steps", rec.spec_steps),
                         ("pulls", rec.pulls)):
            for name, v in src.items():
                self.per_drafter[name][key] += v

    def observe_row(self, status: str, prompt_tokens: int) -> None:
        self.totals[f"rows_{status}"] += 1
        self.totals["prompt_tokens"] += prompt_tokens

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def tokens_per_s(self) -> float:
        e = self.elapsed()
        return self.totals["generated_tokens"] / e if e > 0 else 0.0

    def interval_record(self) -> dict:
        """Deltas since the previous call, flat, for the stats Parquet."""
        now = self.clock()
        dt = now - self._last_t
        rec = {"time_s": now - self.t0, "interval_s": dt}
        for k in dict.fromkeys([*TOTALS, *self.totals]):
            rec[k] = self.totals.get(k, 0.0) - self._last_interval.get(k, 0.0)
        rec["tokens_per_s"] = rec.get("generated_tokens", 0.0) / dt if dt > 0 else 0.0
        steps = rec.get("steps", 0.0)
        rec["mean_active_slots"] = rec.get("active_slot_steps", 0.0) / steps if steps else 0.0
        for name in dict.fromkeys([*self.drafter_names, *self.per_drafter]):
            d = self.per_drafter.get(name, {})
            for key in dict.fromkeys([*DRAFTER_KEYS, *d]):
                col = f"{key}.{name}"
                v = d.get(key, 0)
                rec[col] = v - self._last_drafter.get(col, 0)
                self._last_drafter[col] = v
        self._last_interval = dict(self.totals)
        self._last_t = now
        return rec

    def summary(self) -> dict:
        t = self.totals
        wall = self.elapsed()
        steps = t["steps"]
        drafters = {}
        for name, d in sorted(self.per_drafter.items()):
            spec = d.get("spec_steps", 0)
            drafters[name] = {
                "pulls": d.get("pulls", 0),
                "spec_steps": spec,
                "draft_tokens": d.get("drafted", 0),
                "accepted_draft_tokens": d.get("accepted", 0),
                "acceptance_rate": d["accepted"] / d["drafted"] if d.get("drafted") else None,
                "mean_acceptance_length": (d.get("accepted", 0) + spec) / spec if spec else None,
            }
        return {
            "wall_time_s": wall,
            "rows_ok": int(t["rows_ok"]),
            "rows_error": int(t["rows_error"]),
            "prompt_tokens": int(t["prompt_tokens"]),
            "generated_tokens": int(t["generated_tokens"]),
            "generated_tokens_per_s": t["generated_tokens"] / wall if wall > 0 else 0.0,
            "steps": int(steps),
            "target_forward_tokens": int(t["forward_tokens"]),
            # prompt tokens the target computed, and those copied in instead (prefix cache, n samples)
            "prompt_tokens_prefilled": int(t["prefill_tokens"]),
            "prompt_tokens_reused": int(t["reused_tokens"]),
            "prefix_hit_rate": (t["reused_tokens"] / (t["reused_tokens"] + t["prefill_tokens"])
                                if t["reused_tokens"] + t["prefill_tokens"] else 0.0),
            "target_forwards_per_generated_token": steps / t["generated_tokens"] if t["generated_tokens"] else None,
            "mean_active_slots": t["active_slot_steps"] / steps if steps else 0.0,
            "padded_attention_cells": int(t["padded_cells"]),
            "packed_attention_cells": int(t["packed_cells"]),
            "padding_saved_fraction": 1 - t["packed_cells"] / t["padded_cells"] if t["padded_cells"] else 0.0,
            "stage_time_s": {s: t.get(f"time_{s}_s", 0.0) for s in STAGES},
            # host view: share of step time outside the verify forward and its acceptance
            "target_idle_fraction": (1 - (t.get("time_verify_s", 0.0) + t.get("time_accept_s", 0.0)) / stage_total
                                     if (stage_total := sum(t.get(f"time_{s}_s", 0.0) for s in STAGES)) else 0.0),
            "drafters": drafters,
        }
