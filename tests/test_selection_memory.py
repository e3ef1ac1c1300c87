"""The selection memory (spin_batch/memory.py): what a run learnt starts the next run of its kind on this machine."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from spin_batch.memory import SelectionMemory, recall
from spin_batch.selection.bandit import PROBE_PULLS, BanditPolicy
from spin_batch.selection.gate import GATE_WARMUP, StepGate

from test_bandit import World, run_requests


def trained(world: World, slots: int = 8, requests: int = 6, steps: int = 40, seed: int = 0) -> BanditPolicy:
    policy = BanditPolicy(["cheap", "good"], max_gamma=6, seed=seed, gated=frozenset({"good"}))
    run_requests(policy, world, requests, steps, slots=slots)
    return policy


def test_a_restored_policy_prices_and_rates_as_the_one_that_saved_it():
    world = World({"cheap": 0.3, "good": 0.9}, {"cheap": 0.0002, "good": 0.002}, c0=0.01, c1=0.001)
    old = trained(world)
    state = json.loads(json.dumps(old.snapshot()))  # JSON data: what the file holds
    new = BanditPolicy(["cheap", "good"], max_gamma=6, seed=1, gated=frozenset({"good"}))
    new.restore(state)
    # the same fitted lines, the same goodput, the same pooled rates ...
    assert new.state.cost.verify_coeffs() == pytest.approx(old.state.cost.verify_coeffs())
    for d in ("cheap", "good"):
        assert new.state.cost.draft_coeffs(d) == pytest.approx(old.state.cost.draft_coeffs(d))
        observed = [(b.alpha - 1.0) / (b.n - 2.0) for b in (new.state.pooled[d], old.state.pooled[d])]  # beyond the Beta(1, 1)
        assert observed[0] == pytest.approx(observed[1])
        assert 2.0 < new.state.pooled[d].n < old.state.pooled[d].n  # ... worth less than they were, so this run soon moves them
        assert new.state.pulls[d] == min(old.state.pulls[d], PROBE_PULLS)  # probed already: not probed again
    assert new.state.cost.lam(8) == pytest.approx(old.state.cost.lam(8))
    assert new.state.pricing.goes_on("good") == pytest.approx(old.state.pricing.goes_on("good"), rel=0.05)
    assert not new.state.requests  # the requests' own arms belong to requests that are done


def test_a_restored_policy_drafts_well_from_its_first_step_where_a_cold_one_learns():
    world = World({"cheap": 0.3, "good": 0.95}, {"cheap": 0.0002, "good": 0.0004}, c0=0.02, c1=0.0005, seed=3)
    state = trained(world, slots=4, requests=8).snapshot()

    def first_steps(policy: BanditPolicy) -> list:
        for s in range(4):
            policy.on_admit(s)
        return [c for _ in range(6) for c in World(world.rates, world.draft_cost, world.c0, world.c1,
                                                   seed=7).step(policy, list(range(4)))]

    cold = BanditPolicy(["cheap", "good"], max_gamma=6, seed=0, gated=frozenset({"good"}))
    warm = BanditPolicy(["cheap", "good"], max_gamma=6, seed=0, gated=frozenset({"good"}))
    warm.restore(state)
    good_warm = sum(c.drafter == "good" and c.gamma >= 3 for c in first_steps(warm))
    good_cold = sum(c.drafter == "good" and c.gamma >= 3 for c in first_steps(cold))
    assert good_warm >= 20 and good_warm > good_cold + 6, (good_warm, good_cold)


def _gate_run(gate: StepGate, steps: int, spec_goodput: float, plain_goodput: float, slots: int = 16) -> list[bool]:
    modes = []
    for _ in range(steps):
        mode = gate.decide(slots)
        modes.append(mode)
        gate.observe(slots, mode, spec_goodput if mode else plain_goodput, 1.0)
    return modes


def test_a_band_where_plain_decoding_won_starts_plain_and_still_checks():
    old = StepGate()
    _gate_run(old, 200, spec_goodput=8.0, plain_goodput=10.0)
    band = StepGate.band(16)
    assert not old.verdict(band)
    new = StepGate()
    new.restore(json.loads(json.dumps(old.snapshot())), 0.25)
    modes = _gate_run(new, 40, spec_goodput=8.0, plain_goodput=10.0)
    assert not modes[0] and sum(modes) <= 6, modes  # plain from the start, bar the bursts that re-check it
    cold = _gate_run(StepGate(), 40, spec_goodput=8.0, plain_goodput=10.0)
    assert sum(cold[:GATE_WARMUP]) == GATE_WARMUP  # a cold gate speculates through its warm-up first
    # where speculation now wins here, the restored verdict is overturned by its bursts
    new = StepGate()
    new.restore(old.snapshot(), 0.25)
    modes = _gate_run(new, 300, spec_goodput=14.0, plain_goodput=10.0)
    assert sum(modes[-50:]) >= 45


def test_a_band_warm_without_a_verdict_warms_up_again():
    gate = StepGate()
    gate.restore({"log_ratio": {}, "warm": {str(StepGate.band(16)): GATE_WARMUP}}, 0.25)
    assert _gate_run(gate, GATE_WARMUP, 8.0, 10.0) == [True] * GATE_WARMUP


def test_the_memory_file_round_trip_and_what_it_refuses(tmp_path, capsys):
    key = {"version": 1, "machine": "m"}
    memory = SelectionMemory(key, tmp_path)
    policy = BanditPolicy(["d"], max_gamma=4)
    assert not recall(memory, policy) and memory.runs == 0  # nothing yet
    memory.save(policy.snapshot())
    memory.save(policy.snapshot())
    again = SelectionMemory(key, tmp_path)
    assert recall(again, BanditPolicy(["d"], max_gamma=4)) and again.runs == 2
    other = SelectionMemory({"version": 1, "machine": "n"}, tmp_path)
    assert other.path != memory.path and other.load() is None
    memory.path.write_text("{not json")
    assert SelectionMemory(key, tmp_path).load() is None
    assert "cannot read the selection memory" in capsys.readouterr().err
    memory.path.write_text(json.dumps({"key": key, "runs": 1, "state": {"pricing": {}}}))
    fresh = BanditPolicy(["d"], max_gamma=4)
    assert not recall(SelectionMemory(key, tmp_path), fresh)
    assert "does not fit this policy" in capsys.readouterr().err


def test_jobs_save_and_start_from_their_memory_and_the_text_never_changes(tmp_path, tiny_dir, monkeypatch):
    from spin_batch.build import build_engine
    from spin_batch.config import load_job
    from spin_batch.memory import memory_folder

    from conftest import make_job, run_all, token_ids
    from spin_batch.records import Request

    rows = [{"id": f"r{i}", "prompt": f"count {i} {i + 1} {i + 2} {i + 3}"} for i in range(6)]
    job_path, _ = make_job(tmp_path, tiny_dir, rows, drafters=[{"name": "ngram", "kind": "ngram"}],
                           spin={"selector": "ucb", "num_speculative_tokens": 4}, batch={"slots": 4},
                           sampling={"max_tokens": 12})
    job = load_job(job_path)
    texts = []
    for run in range(3):
        engine = build_engine(job)
        assert engine.memory is not None and engine.memory.runs == run
        reqs = [Request(source=f"m#{r['id']}", id=r["id"], prompt=r["prompt"], messages=None) for r in rows]
        texts.append(token_ids(run_all(engine.loop, reqs)))
    assert texts[0] == texts[1] == texts[2]
    saved = json.loads(next(memory_folder().glob("*.json")).read_text())
    assert saved["runs"] == 3 and saved["key"]["drafters"][0]["name"] == "ngram"
    assert math.isfinite(saved["state"]["pricing"]["cost"]["goodput"][1])
    # another slot count is another kind of run (its verify line is fitted over other step sizes)
    engine = build_engine(replace(job, batch=replace(job.batch, slots=2)))
    assert engine.memory.runs == 0 and len(list(memory_folder().glob("*.json"))) == 1
    # off: nothing read, nothing written
    for f in memory_folder().glob("*.json"):
        f.unlink()
    off = replace(job, spin=replace(job.spin, warm_start=False))
    engine = build_engine(off)
    assert engine.memory is None
    run_all(engine.loop, [Request(source=f"m#{r['id']}", id=r["id"], prompt=r["prompt"], messages=None) for r in rows])
    assert not list(memory_folder().glob("*.json"))


def test_a_bench_variant_of_the_spin_settings_is_not_the_kind_the_memory_holds(tmp_path):
    spin = {"selector": "ucb", "num_speculative_tokens": 8, "confidence_gate": True, "backoff": True,
            "tree_nodes": 16}
    memory = SelectionMemory({"version": 1, "spin": spin}, tmp_path)
    assert memory.fits(8, True, True, 16)
    assert not memory.fits(8, True, False, 16)  # spin-nobackoff: would save a state with no gate verdicts
    assert not memory.fits(8, False, True, 16) and not memory.fits(8, True, True, 0) and not memory.fits(4, True, True, 16)
