"""The job's kernels (target.kernels: auto | c | torch | triton): parsed in config/sections.py, resolved once in
loader.resolve_execution (the environment overriding), checked by validate before any model loads, and
received by every model, which reads no environment itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from spin_batch.cli import main
from spin_batch.config import ConfigError, job_to_dict, parse_job
from spin_batch.models import loader
from spin_batch.models.execution import CHOICES, ENV_CPU, ENV_GRAPHS, ENV_TRITON, CpuPlan, Execution, ModelPlan
from spin_batch.models.llama import LlamaModel
from spin_batch.models.loader import ExecutionError, load_model, resolve_execution
from spin_batch.models.segments import Segments

from conftest import write_job

CPU = torch.device("cpu")


@pytest.fixture
def no_env(monkeypatch):
    """No environment override (conftest sets SPIN_BATCH_CPU_GEMM=on for the other tests)."""
    for name in (ENV_CPU, ENV_TRITON, ENV_GRAPHS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _job(**target) -> dict:
    return {"input": {"paths": "in.jsonl"}, "output": {"dir": "out"}, "target": target}


# -- config/sections.py-----------------------------------------------------------------------------


def test_target_kernels_parses_and_defaults_to_auto():
    assert parse_job(_job()).target.kernels == "auto"
    for choice in CHOICES:  # config/sections.py spells the choices out; execution.py's must be the same
        job = parse_job(_job(kernels=choice))
        assert job.target.kernels == choice
        assert parse_job(job_to_dict(job)) == job
    assert parse_job(_job(), ["target.kernels=torch"]).target.kernels == "torch"


@pytest.mark.parametrize("target,problem", [
    ({"kernels": "cuda"}, "target.kernels: must be one of 'auto', 'c', 'torch', 'triton', got str 'cuda'"),
    ({"kernels": True}, "target.kernels: must be one of 'auto', 'c', 'torch', 'triton', got bool True"),
    ({"kernels": "c", "device": "cuda:1"}, "target.kernels: c is the C decoder on CPU; target.device is cuda:1"),
])
def test_target_kernels_errors(target, problem):
    with pytest.raises(ConfigError) as info:
        parse_job(_job(**target))
    assert info.value.problems == (problem,)


# -- resolve_execution -------------------------------------------------------------------------


@pytest.mark.parametrize("kernels,cpu,triton", [
    ("auto", "auto", False), ("c", "c", False), ("torch", "torch", False), ("triton", "torch", True),
])
def test_each_choice_on_cpu(no_env, kernels, cpu, triton):
    ex = resolve_execution(kernels, CPU)
    assert ex == Execution(kernels, cpu, triton, False, ())
    assert ex.cpu_reason() == f"target.kernels: {kernels}"


@pytest.mark.parametrize("kernels,env,cpu,triton", [
    ("torch", {ENV_CPU: "on"}, "c", False),
    ("c", {ENV_CPU: " OFF "}, "torch", False),
    ("auto", {ENV_CPU: "auto"}, "auto", False),  # auto leaves the job's choice
    ("triton", {ENV_TRITON: "off"}, "torch", False),
    ("torch", {ENV_CPU: "on", ENV_TRITON: "on"}, "c", True),  # each variable for its own part
])
def test_the_environment_overrides_the_job(no_env, kernels, env, cpu, triton):
    for name, value in env.items():
        no_env.setenv(name, value)
    ex = resolve_execution(kernels, CPU)
    assert (ex.kernels, ex.cpu, ex.triton) == (kernels, cpu, triton)
    said = tuple(f"{n}={v.strip().lower()}" for n, v in env.items() if v != "auto")
    assert ex.overrides == said
    assert ex.describe().get("overridden_by", []) == list(said)
    if ENV_CPU in env and env[ENV_CPU] != "auto":
        assert ex.cpu_reason() == f"{ENV_CPU}={env[ENV_CPU].strip().lower()}"


def test_impossible_choices_are_refused(no_env, monkeypatch):
    with pytest.raises(ExecutionError, match="target.kernels: c is the C decoder on CPU; target.device is cuda"):
        resolve_execution("c", torch.device("cuda"))
    with pytest.raises(ExecutionError, match="use one of auto, c, torch, triton"):
        resolve_execution("fast", CPU)
    no_env.setenv(ENV_TRITON, "maybe")
    with pytest.raises(ExecutionError, match=f"{ENV_TRITON}='maybe': use on, off or auto"):
        resolve_execution("auto", CPU)
    no_env.delenv(ENV_TRITON)
    monkeypatch.setattr(loader, "_triton_problem", lambda device: "Triton is not importable here")
    with pytest.raises(ExecutionError, match="^target.kernels: triton: the Triton kernels cannot run here: Triton is"):
        resolve_execution("triton", CPU)
    no_env.setenv(ENV_TRITON, "on")
    with pytest.raises(ExecutionError, match=f"^{ENV_TRITON}=on: the Triton kernels cannot run here"):
        resolve_execution("torch", CPU)
    no_env.delenv(ENV_TRITON)
    # auto takes what runs: CUDA without Triton is torch, without graphs
    assert resolve_execution("auto", torch.device("cuda")) == Execution("auto", "auto", False, False, ())


def test_auto_on_cuda_is_triton_with_graphs(no_env, monkeypatch):
    monkeypatch.setattr(loader, "_triton_problem", lambda device: None)
    assert resolve_execution("auto", torch.device("cuda")) == Execution("auto", "auto", True, True, ())
    assert resolve_execution("torch", torch.device("cuda")) == Execution("torch", "torch", False, False, ())
    no_env.setenv(ENV_GRAPHS, "off")
    assert not resolve_execution("triton", torch.device("cuda")).cuda_graphs


# -- the choice reaching the model -------------------------------------------------------------


def test_the_model_runs_what_the_job_chose(no_env, tiny_dir):
    torch_model = load_model(tiny_dir, execution=resolve_execution("torch", CPU))
    assert torch_model.plan.execution.kernels == "torch" and torch_model.plan.why == "target.kernels: torch"
    assert torch_model.cpu_lib is None and torch_model.c_decoder is None and torch_model.kernels is None
    assert all(lin.panel is None for lin in (torch_model.layers[0].qkv, torch_model.lm_head))
    c_model = load_model(tiny_dir, execution=resolve_execution("c", CPU))
    assert c_model.c_decoder is not None and c_model.plan.cpu == CpuPlan("c", "c", "target.kernels: c")
    triton_model = load_model(tiny_dir, execution=resolve_execution("triton", CPU))
    assert triton_model.kernels is not None and triton_model.kernels.__name__ == "spin_kernels"
    assert triton_model.c_decoder is None and triton_model.graphs is None
    seg = Segments([0, 1], [0, 3, 5], [0, 0])
    tokens = torch.tensor([5, 9, 11, 7, 3])
    want = torch_model.forward(tokens, seg, torch_model.allocate_cache(2, 16))
    for model in (c_model, triton_model):
        got = model.forward(tokens, seg, model.allocate_cache(2, 16))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernels,attention,path,linears", [
    ("torch", "torch", "torch", False), ("c", "c", "c_decoder", True), ("triton", "triton", "triton", False)])
def test_one_plan_per_model_decides_its_path(no_env, tiny_dir, kernels, attention, path, linears):
    """The model's whole path is one frozen ModelPlan made when it loads: the model's kernels, C library and
    forward path are read from it, and its int8 copy's plan is derived from it."""
    model = load_model(tiny_dir, execution=resolve_execution(kernels, CPU))
    plan = model.plan
    assert isinstance(plan, ModelPlan) and plan.backend == "native" and plan.dtype == torch.float32
    assert (plan.attention, model.path, plan.linears) == (attention, path, linears)
    assert model.cpu_lib is plan.lib and (model.kernels is not None) == plan.triton
    assert plan.execution.kernels == kernels and plan.why == plan.cpu.why
    with pytest.raises(AttributeError):
        plan.attention = "torch"  # frozen: decided once
    copy = model.int8_copy(loader.load_state_dict(tiny_dir))
    assert copy.plan.execution is plan.execution and copy.plan.c_library == plan.c_library
    assert copy.plan.cpu.layers == ("c" if plan.c_library else "torch")


def test_a_model_reads_no_environment(monkeypatch, tiny_dir):
    """The environment reaches a model only through resolve_execution: one built outside the loader (its
    default plan, on Execution()) ignores SPIN_BATCH_KERNELS and SPIN_BATCH_CPU_GEMM."""
    monkeypatch.setenv(ENV_TRITON, "on")
    monkeypatch.setenv(ENV_CPU, "off")
    sd = loader.load_state_dict(tiny_dir)
    model = LlamaModel.from_state_dict(loader.read_spec(tiny_dir), sd, torch.float32, CPU)
    assert model.kernels is None and model.c_decoder is not None and model.cpu_lib is not None


def _job_file(tmp_path: Path, model_dir: Path, kernels: str) -> Path:
    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(["red green blue red", "once upon a time"])]
    return write_job(tmp_path, model_dir, rows=rows, out=tmp_path / "out", target={"kernels": kernels},
                     drafters=[{"name": "early", "kind": "early_exit", "layers": 1}], batch={"slots": 2},
                     sampling={"max_tokens": 4})


def test_the_summary_records_the_jobs_choice(no_env, tmp_path, tiny_dir):
    res = CliRunner().invoke(main, ["run", str(_job_file(tmp_path, tiny_dir, "torch")), "--no-progress"])
    assert res.exit_code == 0, res.output
    target = json.loads((tmp_path / "out" / "summary.json").read_text())["backends"]["target"]
    assert target == {"backend": "native", "layers": "torch", "lm_head": "torch", "why": "target.kernels: torch",
                      "kernels": "torch", "triton": False, "cuda_graphs": False}


def test_validate_refuses_kernels_that_cannot_run(no_env, monkeypatch, tmp_path, tiny_dir):
    job = _job_file(tmp_path, tiny_dir, "triton")
    monkeypatch.setattr(loader, "_triton_problem", lambda device: "Triton is not importable here")
    monkeypatch.setattr(loader, "load_state_dict", lambda *a: pytest.fail("a model loaded"))
    res = CliRunner().invoke(main, ["validate", str(job)])
    assert res.exit_code == 1
    assert "target.kernels: triton: the Triton kernels cannot run here: Triton is not importable here" in res.output
    assert "Traceback" not in res.output
    monkeypatch.undo()
    res = CliRunner().invoke(main, ["validate", str(_job_file(tmp_path, tiny_dir, "c"))])
    assert res.exit_code == 0, res.output
