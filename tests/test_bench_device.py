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


def test_device_spin_runs_the_bandit_over_the_jobs_drafters(job):
    """device:spin: every drafter of the job on the device step, each slot's chosen by the bandit; the same greedy
    outputs as the autoregressive loop, the drafters tried, and the chains' sub-buckets and replay times reported."""
    from dataclasses import replace

    spin_job = replace(job, drafters=tuple(d for d in job.drafters if d.kind not in ("cascade", "vote")))
    methods = ["autoregressive", "device:autoregressive", "device:spin"]
    runs = bench.run_bench(spin_job, methods, [1, 3], limit=None, repeat=1, progress=False)
    assert bench.mismatches(runs) == []
    rows = {(r["method"], r["slots"]): r for r in bench.table(runs)}
    for s in (1, 3):
        assert rows["device:spin", s]["generated_tokens"] == 50 and rows["device:spin", s]["drafted_per_step"]
    run = next(r for r in runs if r.method == "device:spin" and r.slots == 3)
    step = run.summary["device_step"]
    assert {"ngram", "exit2", "int8", "draft"} <= set(step["pulls"])  # the bandit tried each drafter
    assert set(step["chains"]) == {"exit2", "int8", "draft"} and any(k.startswith("verify") for k in step["replay_ms"])


def test_device_spin_is_refused_before_any_model_loads_where_a_drafter_has_no_device_draft(job):
    with pytest.raises(ValueError, match=r"device:spin.*'both' \(kind cascade\)"):
        bench.check_methods(["device:spin"], job)
    from dataclasses import replace

    mixable = tuple(d for d in job.drafters if d.kind not in ("cascade", "vote"))
    bench.check_methods(["device:spin"], replace(job, drafters=mixable))


def test_device_ngram_drafts_trees_where_the_job_gives_them(job):
    """spin.tree_nodes (16 by default, the n-gram drafter gated): device:ngram verifies trees in tree buckets;
    tree_nodes 0: chains."""
    from dataclasses import replace

    for nodes, label in ((16, "2x16t"), (0, "2x4")):
        spun = replace(job, spin=replace(job.spin, tree_nodes=nodes))
        runs = bench.run_bench(spun, ["autoregressive", "device:ngram"], [2], limit=None, repeat=1, progress=False)
        assert bench.mismatches(runs) == []
        run = next(r for r in runs if r.method == "device:ngram")
        buckets = set(run.summary["device_step"]["buckets"])
        assert label in buckets and buckets <= {"1x0", "2x0", label, label.replace("2x", "1x")}, buckets
        assert run.summary["drafters"]["ngram"]["draft_tokens"] > 0
