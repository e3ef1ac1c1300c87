"""scripts/gpu_bench.py's summary: the paired ratios against autoregressive on the device step and on the loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _script():
    path = Path(__file__).parents[1] / "scripts" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_ratios_pair_runs_of_the_same_repeat():
    rows = [{"method": m, "slots": s, "repeat": r, "tokens_per_s": t} for m, s, r, t in [
        ("autoregressive", 1, 0, 100.0), ("device:autoregressive", 1, 0, 200.0), ("spin", 1, 0, 300.0),
        ("autoregressive", 1, 1, 50.0), ("device:autoregressive", 1, 1, 100.0), ("spin", 1, 1, 100.0),
        ("spin", 16, 0, 10.0)]]  # no base at 16 slots: no ratio
    got = _script().paired_ratios(rows)
    assert got == {1: {"spin": {"vs device:autoregressive": 1.25, "vs autoregressive": 2.5},
                       "device:autoregressive": {"vs autoregressive": 2.0},
                       "autoregressive": {"vs device:autoregressive": 0.5}}}
