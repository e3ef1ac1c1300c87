"""`spin-batch bench`'s device methods (device:autoregressive, device:<drafter>) on a tiny model: they run through
the normal bench, and their greedy outputs equal the autoregressive loop's."""

from __future__ import annotations

import pytest

from spin_batch import bench
from spin_batch.config import parse_job
from conftest import write_jsonl

PROMPTS = ["the quick brown fox", "red green blue red green", "def add(a, b):", "once upon a time", "12 12 12"]
DEVICE = ["device:autoregressive", "device:ngram", "device:exit2", "device:int8", "device:draft", "device:both",
          "device:vote"]


@pytest.fixture(scope="module")
def job(tiny_dir, tiny_draft_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench-device")
    shard = write_jsonl(tmp / "in.jsonl", [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)])
    return parse_job({
        "input": {"paths": [str(shard)]},
        "output": {"dir": str(tmp / "out")},
        "target": {"model": str(tiny_dir), "device": "cpu", "dtype": "float32"},
        "drafters": [{"name": "ngram", "kind": "ngram"}, {"name": "exit2", "kind": "early_exit", "layers": 2},
                     {"name": "int8", "kind": "early_exit", "quantize": "int8"},
                     {"name": "draft", "kind": "model", "model": str(tiny_draft_dir)},
                     {"name": "both", "kind": "cascade", "members": ["ngram", "draft"]},
                     {"name": "vote", "kind": "vote", "members": ["ngram", "exit2", "draft"]}],
        "spin": {"num_speculative_tokens": 4},
        "sampling": {"max_tokens": 10},
    })


def test_device_methods_run_in_the_bench_with_identical_greedy_outputs(job):
    runs = bench.run_bench(job, ["autoregressive", *DEVICE], [1, 3], limit=None, repeat=1, progress=False)
    assert bench.mismatches(runs) == []
    assert {(r.method, r.slots) for r in runs} == {(m, s) for m in ["autoregressive", *DEVICE] for s in (1, 3)}
    rows = {(r["method"], r["slots"]): r for r in bench.table(runs)}
    for m in DEVICE:
        for s in (1, 3):
            row = rows[m, s]
            assert row["ratio_vs_autoregressive"] is not None and row["generated_tokens"] == 50
            if m == "device:autoregressive":
                assert row["mean_acceptance_length"] is None
            else:  # the drafts were verified (acceptance length >= 1: the bonus token counts)
                assert row["drafted_per_step"] and row["mean_acceptance_length"] >= 1
    run = next(r for r in runs if r.method == "device:exit2" and r.slots == 3)
    assert run.summary["device_step"]["host_reads"] > 0 and "exit2" in run.summary["drafters"]
    assert set(run.summary["device_step"]["buckets"]) <= {"1x4", "2x4", "4x4"}  # rows x draft width


def test_device_methods_are_checked_before_any_model_loads(job):
    bench.check_methods(DEVICE, job)
    for bad, why in (("device:fixed:ngram", "unknown bench method"), ("device:nope", "unknown bench method"),
                     ("device:ngram+prefix", "our loop's methods only")):
        with pytest.raises(ValueError, match=why):
            bench.check_methods([bad], job)
    with pytest.raises(ValueError, match="unknown") as e:
        bench.check_methods(["device:nope"], job)
    assert "device:autoregressive" in str(e.value) and "device:draft" in str(e.value)
