"""Failure that fails (issue 45, item 3, and the model-loading half of item 4): a run whose rows are
errors exits non-zero; an empty tokenizer, a tokenizer with its own code, or a max_model_len the model
or the memory cannot take are job errors before any weights load, and transformers never prompts.

Each test runs the CLI on the tiny random model, in-process through click's CliRunner.
"""

from __future__ import annotations

import builtins
import json
import shutil

import pytest
import yaml

from conftest import write_jsonl
from test_cli_e2e import _isolate_process_state  # noqa: F401 (autouse: signal handlers, SLURM_*, threads)
from conftest import make_job
from test_cli_e2e import _describe, invoke, prompt_rows, read_rows

# --------------------------------------------------------------------------
# --max-error-rate
# --------------------------------------------------------------------------


def _mixed_rows(n_ok: int, n_bad: int) -> list[dict]:
    return prompt_rows(n_ok) + [{"id": f"bad{i}", "prompt": "   "} for i in range(n_bad)]


def test_a_run_whose_every_row_is_an_error_exits_65_after_writing_every_row(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in" / "p.jsonl", _mixed_rows(0, 5))
    job, out = make_job(tmp_path, tiny_dir, [src])
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 65, _describe(result)
    assert sorted(r["id"] for r in read_rows(out)) == [f"bad{i}" for i in range(5)]
    assert "5 of 5 rows of this run are error rows (100%, every row failed); the first: empty prompt" in result.output
    assert (out / "summary.json").exists()
    # a rerun has nothing left to do: no row of its own, so nothing failed
    assert invoke("run", job, "--no-progress").exit_code == 0
    # redoing the same error rows fails again
    assert invoke("run", job, "--no-progress", "--retry-errors").exit_code == 65
    # --max-error-rate 1: error rows never fail the run
    job1, _ = make_job(tmp_path, tiny_dir, [src], name="lenient")
    assert invoke("run", job1, "--no-progress", "--max-error-rate", "1").exit_code == 0


@pytest.mark.parametrize("rate, code", [(None, 0), ("0.25", 0), ("0.2", 65), ("0", 65)])
def test_max_error_rate_bounds_the_error_rows_of_a_run(tmp_path, tiny_dir, rate, code):
    src = write_jsonl(tmp_path / "in" / "p.jsonl", _mixed_rows(3, 1))
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 2})
    result = invoke("run", job, "--no-progress", *(["--max-error-rate", rate] if rate else []))
    assert result.exit_code == code, _describe(result)
    assert len(read_rows(out)) == 4
    if code:
        assert f"1 of 4 rows of this run are error rows (25%, more than --max-error-rate {float(rate):g})" \
            in result.output


def test_max_error_rate_outside_0_1_is_refused(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(1))
    job, out = make_job(tmp_path, tiny_dir, [src])
    result = invoke("run", job, "--max-error-rate", "1.5")
    assert result.exit_code == 2 and "--max-error-rate" in result.output and not out.exists()


# --------------------------------------------------------------------------
# tokenizers: empty ones, and ones that ship code
# --------------------------------------------------------------------------


def _without_tokenizer(src, dst):
    """A copy of a model folder with config and weights only."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def test_a_model_folder_whose_tokenizer_encodes_nothing_is_refused(tmp_path, tiny_qwen_dir, monkeypatch):
    import spin_batch.runner as runner

    # transformers builds a Qwen2 tokenizer with an empty vocabulary from a folder without tokenizer files
    model = _without_tokenizer(tiny_qwen_dir, tmp_path / "no-tokenizer")
    src = write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(3))
    job, out = make_job(tmp_path, model, [src])
    result = invoke("validate", job)
    assert result.exit_code == 1 and "no tokenizer files" in result.output, _describe(result)

    def no_engine(*a, **k):
        raise AssertionError("the engine was built for a job whose tokenizer encodes nothing")

    monkeypatch.setattr(runner, "build_engine", no_engine)
    result = invoke("run", job, "--no-progress")
    assert result.exit_code == 1 and "no tokenizer files" in result.output, _describe(result)
    assert not (out / "outputs").exists()


def test_a_tokenizer_that_encodes_nothing_is_refused_even_with_tokenizer_files(tmp_path, tiny_dir):
    from spin_batch.models import loader

    model = tmp_path / "empty-vocab"
    shutil.copytree(tiny_dir, model)
    tok = json.loads((model / "tokenizer.json").read_text())
    tok["model"]["vocab"], tok["model"]["merges"], tok["added_tokens"] = {}, [], []
    (model / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(loader.TokenizerError, match="encodes 'Hello, world. 1 \\+ 2 = 3' to no tokens"):
        loader.load_tokenizer(model)


def _tokenizer_with_code(tmp_path, tiny_dir):
    """The tiny model, its tokenizer_config naming a class in tok.py of the folder (auto_map); running that
    code writes a marker file."""
    model = tmp_path / "own-code"
    shutil.copytree(tiny_dir, model)
    marker = tmp_path / "code-ran"
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="MyTok", auto_map={"AutoTokenizer": [None, "tok.MyTok"]})
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "tok.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass MyTok(PreTrainedTokenizerFast):\n    pass\n")
    return model, marker


def test_a_tokenizer_with_its_own_code_never_prompts_and_runs_only_when_trusted(tmp_path, tiny_dir, monkeypatch):
    asked = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    model, marker = _tokenizer_with_code(tmp_path, tiny_dir)
    src = write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(2))
    job, out = make_job(tmp_path, model, [src])
    for command in ("validate", "run"):
        result = invoke(command, job)
        assert result.exit_code == 1, _describe(result)
        assert "custom code" in result.output and "trust_remote_code: true" in result.output, _describe(result)
    assert asked == [] and not marker.exists()
    trusted, _ = make_job(tmp_path, model, [src], name="trusted", target={"trust_remote_code": True})
    result = invoke("validate", trusted)
    assert result.exit_code == 0, _describe(result)
    assert asked == [] and marker.read_text() == "ran"


# --------------------------------------------------------------------------
# batch.max_model_len against the model and the memory
# --------------------------------------------------------------------------


@pytest.mark.parametrize("max_len", [1_000_000, 513])
def test_a_max_model_len_past_the_models_positions_is_a_job_error(tmp_path, tiny_dir, monkeypatch, max_len):
    from spin_batch.models import loader

    def no_weights(*a, **k):
        raise AssertionError("weights loaded for a max_model_len the model cannot take")

    monkeypatch.setattr(loader, "load_model", no_weights)
    src = write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(2))
    job, out = make_job(tmp_path, tiny_dir, [src], batch={"max_model_len": max_len})
    for command in ("validate", "run"):
        result = invoke(command, job)
        assert result.exit_code == 1, _describe(result)
        assert (f"batch.max_model_len: {max_len} positions is more than the model takes: 512 "
                "(max_position_embeddings in ") in result.output, _describe(result)
        assert "set batch.max_model_len to 512 or less" in result.output
    assert not (out / "outputs").exists()


def test_a_max_model_len_left_at_its_default_is_fitted_to_a_smaller_model(tmp_path, tiny_dir):
    from spin_batch.config import load_job
    from spin_batch.preflight import fit_context

    src = write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(2))
    job, out = make_job(tmp_path, tiny_dir, [src])
    spec = yaml.safe_load(job.read_text())
    del spec["batch"]["max_model_len"]
    job.write_text(yaml.safe_dump(spec))
    loaded = load_job(str(job), ())
    assert loaded.batch.max_model_len == 1024  # the job default, past the tiny model's 512 positions
    assert fit_context(loaded).batch.max_model_len == 512
    result = invoke("run", job)
    assert result.exit_code == 0, _describe(result)
    assert fit_context(load_job(str(job), ("batch.max_model_len=300",))).batch.max_model_len == 300


def test_a_kv_cache_larger_than_free_memory_is_a_job_error(tmp_path, tiny_dir, monkeypatch):
    from spin_batch.models import capacity, loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    # the tiny model: 3 layers x 2 kv heads x 16 dims x K,V x 4 bytes = 768 bytes a position a slot
    weights = capacity.weights_bytes(tiny_dir)
    monkeypatch.setattr(capacity, "available_memory", lambda device: weights + 768 * 3 * 100)
    src = write_jsonl(tmp_path / "in" / "p.jsonl", prompt_rows(2))
    job, out = make_job(tmp_path, tiny_dir, [src], batch={"max_model_len": 256})  # 3 slots
    result = invoke("validate", job)
    assert result.exit_code == 1, _describe(result)
    assert "batch.max_model_len: 256 positions x 3 slots need a KV cache of 0.0 GiB (float32)" in result.output
    assert "at most 100 positions per slot fit at 3 slots" in result.output
    ok, _ = make_job(tmp_path, tiny_dir, [src], name="fits", batch={"max_model_len": 100})
    assert invoke("validate", ok).exit_code == 0


@pytest.mark.parametrize("config, limit", [
    ({"max_position_embeddings": 8192}, (8192, "max_position_embeddings")),
    ({"max_position_embeddings": 8192, "seq_length": 4096}, (4096, "seq_length")),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}},
     (8192, "max_position_embeddings x rope_scaling.factor 2")),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     (131072, "max_position_embeddings")),
    ({"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 32768}},
     (131072, "rope_scaling.original_max_position_embeddings x rope_scaling.factor 4")),
    ({"text_config": {"max_position_embeddings": 2048}}, (2048, "max_position_embeddings")),
    ({}, None),
])
def test_the_position_limit_is_read_as_vllm_reads_it(config, limit):
    from spin_batch.models import capacity

    assert capacity.position_limit(config) == limit
