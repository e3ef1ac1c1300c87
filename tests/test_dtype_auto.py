"""target.dtype auto: bfloat16 where the CPU has bfloat16 dot products and the C kernels run it, else float32;
resolved before anything runs, and said by validate and env."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from spin_batch.cli import main
from spin_batch.config import ConfigError, parse_job
from spin_batch.models import cpu_decoder, loader
from spin_batch.preflight import resolve_dtype


def job(**target):
    return parse_job({"input": {"paths": ["in.jsonl"]}, "output": {"dir": "out"}, "target": target})


def test_auto_parses_and_a_wrong_dtype_names_it():
    assert job(dtype="auto").target.dtype == "auto"
    assert job(dtype="bf16").target.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="'auto' or one of 'float32'"):
        job(dtype="int3")


def test_auto_follows_the_cpu_and_the_c_kernels(monkeypatch):
    lib = cpu_decoder.library()
    want = "bfloat16" if lib is not None and lib.spin_gemm_bf16_native() else "float32"
    assert loader.auto_dtype(torch.device("cpu"))[0] == want
    said = []
    resolved = resolve_dtype(job(dtype="auto", device="cpu"), say=said.append)
    assert resolved.target.dtype == want and said and want in said[0]
    assert resolve_dtype(job(dtype="float16")).target.dtype == "float16"  # as given
    for off in ({"kernels": "torch"}, {"backend": "transformers"}):  # off the C kernels bfloat16 is not exact
        assert resolve_dtype(job(dtype="auto", device="cpu", **off)).target.dtype == "float32"

    class NoBf16:  # a CPU without AVX512-BF16: its bfloat16 GEMM widens the weights
        def spin_gemm_bf16_native(self):
            return 0

    monkeypatch.setattr(cpu_decoder, "library", lambda: NoBf16())
    dtype, why = loader.auto_dtype(torch.device("cpu"))
    assert dtype == "float32" and "AVX512-BF16" in why
    monkeypatch.setattr(cpu_decoder, "library", lambda: None)
    assert loader.auto_dtype(torch.device("cpu"))[0] == "float32"


def test_env_says_what_auto_means_here():
    result = CliRunner().invoke(main, ["env"])
    assert result.exit_code == 0, result.output
    line = next(l for l in result.output.splitlines() if l.startswith("dtype auto"))
    assert loader.auto_dtype(torch.device("cpu"))[0] in line
