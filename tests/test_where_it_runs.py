"""What runs where by default (docs/gpu.md "What runs where"): micro-batch pipelining only where a job asks for it,
and no int8 copy on CUDA."""

from __future__ import annotations

import torch

from spin_batch import build, preflight
from spin_batch.config import parse_job
from spin_batch.models import capacity, loader


def job(**spin):
    return parse_job({"input": {"paths": ["x.jsonl"]}, "output": {"dir": "out"},
                      "drafters": [{"name": "q8", "kind": "early_exit", "quantize": "int8"}], "spin": spin})


def test_pipelining_is_off_unless_the_job_turns_it_on_on_every_device():
    for device in ("cpu", "cuda"):
        assert not build.loop_settings(job(), frozenset(), torch.device(device)).pipeline
        assert build.loop_settings(job(pipeline="on"), frozenset(), torch.device(device)).pipeline


def test_the_int8_copy_is_refused_on_cuda_before_any_model_loads(monkeypatch, tiny_dir):
    """On a CUDA device (faked here: only the device is asked), a quantize: int8 drafter is a job error; on CPU not."""
    j = parse_job({"input": {"paths": ["x.jsonl"]}, "output": {"dir": "out"}, "target": {"model": str(tiny_dir)},
                   "drafters": [{"name": "q8", "kind": "early_exit", "quantize": "int8"}]})
    assert not [p for p in preflight.check_models(j) if "q8" in p]
    monkeypatch.setattr(loader, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(loader, "resolve_execution", lambda kernels, device: None)
    monkeypatch.setattr(capacity, "available_memory", lambda device: 80 * 2**30)
    problems = [p for p in preflight.check_models(j) if "q8" in p]
    assert problems and "no int8 kernel on CUDA" in problems[0], problems
