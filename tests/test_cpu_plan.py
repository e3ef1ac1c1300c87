"""The CPU path each model runs on (spin_batch/models/cpu_plan.py): measured once per kind of machine and
model shape, cached, never the slower path; forced by the job's execution (target.kernels c or torch, or
SPIN_BATCH_CPU_GEMM); bfloat16 on CPUs whose oneDNN refuses it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spin_batch.models import cpu_decoder, cpu_plan, execution
from spin_batch.models.execution import Execution
from spin_batch.models.loader import load_model, read_spec
from spin_batch.models.segments import Segments

from conftest import write_job


@pytest.fixture
def auto(monkeypatch, tmp_path):
    """Auto mode with a cache folder of its own (so nothing was measured yet)."""
    monkeypatch.setenv("SPIN_BATCH_CPU_GEMM", "auto")
    monkeypatch.setenv("SPIN_BATCH_CACHE", str(tmp_path / "cache"))
    cpu_decoder.reset()
    yield tmp_path / "cache"
    monkeypatch.undo()
    cpu_decoder.reset()


def test_c_is_kept_unless_another_path_is_clearly_faster():
    assert cpu_plan._pick({"c": 10.2, "torch": 10.0}) == "c"  # within C_MARGIN: C keeps batch invariance
    assert cpu_plan._pick({"c": 11.0, "torch": 10.0}) == "torch"
    assert cpu_plan._pick({"c": 10.0, "torch+c_attention": 9.0, "torch": 12.0}) == "torch+c_attention"
    assert cpu_plan._pick({"torch": 3.0}) == "torch"


def test_auto_measures_once_then_reads_the_choice_back(auto, tiny_dir):
    spec = read_spec(tiny_dir)
    loop = cpu_plan.workloads(3, 4)
    measured = Execution(cpu="auto")
    first = cpu_plan.plan(spec, torch.float32, torch.device("cpu"), loop, measured)
    assert first.why.startswith("measured now") and set(first.ms["layers"]) == set(execution.LAYERS)
    assert first.layers == cpu_plan._pick(first.ms["layers"]) and first.lm_head == cpu_plan._pick(first.ms["lm_head"])
    stored = json.loads((auto / "cpu_decoder" / "plans.json").read_text())
    (key, record), = stored.items()
    assert cpu_decoder.build_key() in key and "3x1;3x5" in key and record["layers"] == first.layers
    again = cpu_plan.plan(spec, torch.float32, torch.device("cpu"), loop, measured)
    assert again.why.startswith("measured on this machine earlier") and again.ms == first.ms
    other = cpu_plan.plan(spec, torch.float32, torch.device("cpu"), cpu_plan.workloads(8, 0), measured)
    assert other.why.startswith("measured now")  # other row counts: measured for them
    assert len(json.loads((auto / "cpu_decoder" / "plans.json").read_text())) == 2


def _force_timings(monkeypatch, layers: dict, head: dict) -> None:
    monkeypatch.setattr(cpu_plan, "_time_layers", lambda *a: dict(layers))
    monkeypatch.setattr(cpu_plan, "_time_head", lambda *a: dict(head))


@pytest.mark.parametrize("layers,head,want", [
    ({"c": 60.0, "torch+c_attention": 9.0, "torch": 5.0}, {"c": 30.0, "torch": 2.0}, ("torch", "torch")),
    ({"c": 60.0, "torch+c_attention": 5.0, "torch": 9.0}, {"c": 1.0, "torch": 2.0}, ("torch+c_attention", "c")),
    ({"c": 4.0, "torch+c_attention": 5.0, "torch": 9.0}, {"c": 1.0, "torch": 2.0}, ("c", "c")),
])
def test_a_slow_c_build_is_never_the_default(auto, monkeypatch, tiny_dir, layers, head, want):
    """What a Zen3 met with the old AVX2 build (C 16x slower than torch): the measurement keeps the faster
    path, and the model is built on it with the same results."""
    _force_timings(monkeypatch, layers, head)
    model = load_model(tiny_dir, loop=cpu_plan.workloads(2, 3))
    assert (model.plan.cpu.layers, model.plan.cpu.lm_head) == want
    assert (model.c_decoder is not None) == (want[0] == "c")
    assert (model.plan.attention == "c") == (want[0] != "torch")
    assert all((lin.panel is not None) == (want[0] == "c") for lin in (model.layers[0].qkv, model.layers[0].down))
    assert (model.lm_head.panel is not None) == (want[1] == "c")
    reference = load_model(tiny_dir, plan=execution.forced("c"))
    seg = Segments([0, 1], [0, 3, 5], [0, 0])
    tokens = torch.tensor([5, 9, 11, 7, 3])
    got = model.forward(tokens, seg, model.allocate_cache(2, 16))
    ref = reference.forward(tokens, seg, reference.allocate_cache(2, 16))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_forced_and_unmeasurable_plans_say_why(tiny_dir):
    spec = read_spec(tiny_dir)
    cpu = torch.device("cpu")
    off = Execution(cpu="torch", overrides=("SPIN_BATCH_CPU_GEMM=off",))
    assert cpu_plan.plan(spec, torch.float32, cpu, None, off) == execution.CpuPlan("torch", "torch", "SPIN_BATCH_CPU_GEMM=off")
    job_torch = Execution(kernels="torch", cpu="torch")
    assert cpu_plan.plan(spec, torch.float32, cpu, None, job_torch).why == "target.kernels: torch"
    job_c = Execution(kernels="c", cpu="c")
    assert cpu_plan.plan(spec, torch.float32, cpu, None, job_c) == execution.CpuPlan("c", "c", "target.kernels: c")
    half = cpu_plan.plan(spec, torch.float16, cpu, None, job_c)
    assert half.layers == "torch" and "float16" in half.why
    assert load_model(tiny_dir, "float16").c_decoder is None
    assert cpu_plan.plan(spec, torch.float32, torch.device("meta"), None, job_c) == execution.TORCH  # not on CPU
    with pytest.raises(ValueError, match="CPU path 'fast'"):
        execution.forced("fast")


def test_the_plan_is_in_the_summary(tmp_path, tiny_dir):
    from click.testing import CliRunner

    from spin_batch.cli import main

    job = _job(tmp_path, tiny_dir, "float32")
    res = CliRunner().invoke(main, ["run", str(job), "--no-progress"])
    assert res.exit_code == 0, res.output
    backends = json.loads((tmp_path / "out" / "summary.json").read_text())["backends"]
    assert backends["target"]["layers"] == "c" and backends["target"]["why"] == "SPIN_BATCH_CPU_GEMM=on"
    assert backends["target"]["c_build"]["isa"] in ("avx512", "avx2", "neon", "generic")
    assert (backends["target"]["kernels"], backends["target"]["triton"]) == ("auto", False)
    assert backends["target"]["overridden_by"] == ["SPIN_BATCH_CPU_GEMM=on"]  # the environment (conftest) wins
    res = CliRunner().invoke(main, ["env", str(job)])
    assert res.exit_code == 0 and "c kernels" in res.output and "target\tlayers c" in res.output, res.output
    res = CliRunner().invoke(main, ["env", str(job), "--set", "target.quantize=int8"])  # the int8 target: no float plan
    assert res.exit_code == 0 and "target\tint8 weights and inputs" in res.output, res.output
    assert "target\tlayers" not in res.output


def _job(tmp_path: Path, model_dir: Path, dtype: str) -> Path:
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(["red green blue red", "once upon a time", "def add("])]
    return write_job(tmp_path, model_dir, rows=rows, out=tmp_path / "out", target={"dtype": dtype},
                     drafters=[{"name": "ngram", "kind": "ngram"}], batch={"slots": 2}, sampling={"max_tokens": 6})


# oneDNN held to AVX2 and torch's kernels to AVX2: what a Zen3 gives torch. oneDNN then refuses to prepack a
# bfloat16 weight ("bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq").
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


@pytest.mark.slow
@pytest.mark.parametrize("path", ["torch", "c"])
def test_bfloat16_runs_where_onednn_refuses_it(tmp_path, tiny_dir, path):
    """A bfloat16 job on an AVX2-only CPU, on the torch path (torch's own GEMM, said once) and on the C path
    built for x86-64-v3 where the CPU is x86 (the widening bfloat16 GEMM): every row ok, no traceback."""
    env = {**os.environ, **AVX2_ONLY, "SPIN_BATCH_CPU_GEMM": "off" if path == "torch" else "on",
           "SPIN_BATCH_CACHE": str(tmp_path / "cache")}
    if path == "c" and os.uname().machine == "x86_64":
        env["SPIN_BATCH_CPU_ARCH"] = "x86-64-v3"
    job = _job(tmp_path, tiny_dir, "bfloat16")
    refused = subprocess.run([sys.executable, "-c", "import torch; w = torch.ones(4, 4).bfloat16(); "
                              "torch.ops.mkldnn._reorder_linear_weight(w, None)"], env=env, capture_output=True, text=True)
    assert refused.returncode != 0 and "bf16 path needs" in refused.stderr  # the emulation holds
    res = subprocess.run([str(Path(sys.executable).with_name("spin-batch")), "run", str(job), "--no-progress"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    said = res.stderr.count("oneDNN's bfloat16 GEMM needs AVX-512")
    assert said == (1 if path == "torch" else 0)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["rows_ok"], summary["rows_error"]) == (3, 0)
    assert summary["backends"]["target"]["layers"] == path
    if path == "c" and os.uname().machine == "x86_64":
        assert summary["backends"]["target"]["c_build"] == {"march": "x86-64-v3", "isa": "avx2",
                                                            "bf16_gemm": "widened to float32",
                                                            "int8_gemm": "avx2"}


def test_candidates_are_timed_in_alternation():
    """A slow spell of the machine must hit every candidate alike: their calls alternate (a b, b a, ...)
    after one warm-up call each, and each gets its own best time."""
    calls = []

    def fake(name: str, seconds: float):
        def run():
            calls.append(name)
            time.sleep(seconds)
        return run

    ms = cpu_plan.best_ms({"c": fake("c", 0.002), "torch": fake("torch", 0.0)}, reps=4)
    assert calls == ["c", "torch"] + ["c", "torch", "torch", "c"] * 2
    assert ms["c"] >= 2.0 > ms["torch"]
