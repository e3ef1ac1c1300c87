"""Structured output as it is asked for: OpenAI's response_format, vLLM's structured_outputs and older guided_*
fields in an OpenAI batch file (end to end through `spin-batch run`), a params column, and the job's
sampling.structured; bad constraints are error rows (or a job error), the engine missing is named with the fix."""

from __future__ import annotations

import json
import re

import pytest

from conftest import write_jsonl
from spin_batch import grammars
from spin_batch.config import ConfigError, parse_job
from spin_batch.io.params import ParamError, body_params, column_params
from test_cli_e2e import _isolate_process_state, invoke, make_job, read_rows, run_ok  # noqa: F401

pytest.importorskip("llguidance")

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["bug", "feature"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "n"], "additionalProperties": False}


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


LINES = [
    line("schema", CHAT_URL, messages=chat("file a report"), max_tokens=64, temperature=0,
         response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": SCHEMA, "strict": True}}),
    line("object", CHAT_URL, messages=chat("any object"), max_tokens=8, temperature=0,
         response_format={"type": "json_object"}),
    line("text", CHAT_URL, messages=chat("free text"), max_tokens=4, temperature=0, response_format={"type": "text"}),
    line("choice", COMPLETIONS_URL, prompt="the moon is", max_tokens=16, temperature=0.8, seed=3,
         structured_outputs={"choice": ["full", "new", "half full"]}),
    line("regex", COMPLETIONS_URL, prompt="a code:", max_tokens=16, temperature=0,
         structured_outputs={"regex": "[a-c]{2}-[0-9]{2}"}),
    line("guided", CHAT_URL, messages=chat("yes or no?"), max_tokens=16, guided_choice=["yes", "no"]),
    line("guided-json", COMPLETIONS_URL, prompt="json:", max_tokens=64, temperature=0, guided_json=SCHEMA),
    line("grammar", COMPLETIONS_URL, prompt="digits:", max_tokens=16, temperature=0,
         structured_outputs={"grammar": 'root ::= "(" [0-9] ")"'}),  # GBNF, as llama.cpp writes it
    line("bad-schema", CHAT_URL, messages=chat("x"), response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "foo"}}}),
    line("bad-regex", COMPLETIONS_URL, prompt="x", structured_outputs={"regex": "(ab"}),
    line("bad-format", CHAT_URL, messages=chat("x"), response_format={"type": "xml"}),
    line("two", CHAT_URL, messages=chat("x"), response_format={"type": "json_object"}, guided_choice=["a"]),
    line("bad-key", COMPLETIONS_URL, prompt="x", structured_outputs={"choice": ["a"], "structural_tag": "t"}),
]


def test_openai_lines_with_structured_output_end_to_end(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in" / "batch.jsonl", LINES)
    job, out = make_job(tmp_path, tiny_dir, [src], name="openai", output={"format": "openai"},
                        spin={"selector": "fixed:ngram", "num_speculative_tokens": 3},
                        drafters=[{"name": "ngram", "kind": "ngram"}])
    run_ok(job)
    got = {x["custom_id"]: x for x in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(got) == {x["custom_id"] for x in LINES}

    def text(cid: str) -> str:
        body = got[cid]["response"]["body"]
        assert got[cid]["error"] is None, got[cid]
        choice = body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]

    for cid in ("schema", "guided-json"):
        value = json.loads(text(cid))
        assert set(value) == {"label", "n"} and value["label"] in ("bug", "feature") and 0 <= value["n"] <= 9
    assert text("object").startswith("{")  # any object; 8 tokens may cut it short, as in vLLM
    assert text("choice") in ("full", "new", "half full") and text("guided") in ("yes", "no")
    assert re.fullmatch("[a-c]{2}-[0-9]{2}", text("regex")) and re.fullmatch(r"\([0-9]\)", text("grammar"))
    assert text("text")
    errors = {cid: got[cid]["error"]["message"] for cid in got if got[cid]["error"] is not None}
    assert set(errors) == {"bad-schema", "bad-regex", "bad-format", "two", "bad-key"}
    assert "json constraint does not compile" in errors["bad-schema"] and "foo" in errors["bad-schema"]
    assert "regex constraint does not compile" in errors["bad-regex"]
    assert "response_format" in errors["bad-format"] and "xml" in errors["bad-format"]
    assert "give one of them" in errors["two"] and "structural_tag is not supported" in errors["bad-key"]


def test_a_params_column_and_the_job_key_constrain_rows(tmp_path, tiny_dir):
    rows = [{"id": "a", "prompt": "the moon", "params": {"structured_outputs": {"choice": ["up", "down"]}}},
            {"id": "b", "prompt": "the sun", "params": None},
            {"id": "c", "prompt": "x", "params": {"guided_regex": "(ab"}}]
    src = write_jsonl(tmp_path / "in" / "rows.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], input={"params_column": "params"},
                        sampling={"max_tokens": 24, "structured": {"regex": "[0-9]{3}"}})
    run_ok(job)
    got = {r["id"]: r for r in read_rows(out)}
    assert got["a"]["text"] in ("up", "down") and re.fullmatch("[0-9]{3}", got["b"]["text"])
    assert got["c"]["status"] == "error" and "regex constraint does not compile" in got["c"]["error"]


def job_dict(tmp_path, structured) -> dict:
    return {"input": {"paths": [str(tmp_path)]}, "output": {"dir": str(tmp_path / "out")},
            "target": {"model": "builtin:smollm2-135m"}, "sampling": {"structured": structured}}


@pytest.mark.parametrize("structured,message", [
    ({"json": {"type": "foo"}}, "json constraint does not compile"),
    ({"regex": "(ab"}, "unclosed group"),
    ({"choice": "yes"}, "non-empty list of strings"),
    ({"choice": ["a"], "json_object": True}, "exactly one of"),
])
def test_a_bad_job_constraint_is_a_job_error(tmp_path, structured, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        parse_job(job_dict(tmp_path, structured))
    assert "sampling.structured" in str(info.value)


def test_the_job_constraint_round_trips(tmp_path):
    from spin_batch.config import job_to_dict

    job = parse_job(job_dict(tmp_path, {"json": SCHEMA}))
    assert parse_job(job_to_dict(job)).sampling.structured == {"json": SCHEMA}


def test_without_the_engine_rows_and_jobs_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(grammars.importlib.util, "find_spec", lambda name: None)
    grammars.problem.cache_clear()
    try:
        with pytest.raises(ParamError, match=re.escape("pip install llguidance")):
            body_params({"prompt": "x", "guided_choice": ["a", "b"]}, "prompt")
        with pytest.raises(ParamError, match="pip install llguidance"):
            column_params({"response_format": {"type": "json_object"}}, "params")
        with pytest.raises(ConfigError, match=re.escape("pip install llguidance")):
            parse_job(job_dict(tmp_path, {"choice": ["a"]}))
        assert body_params({"prompt": "x", "response_format": {"type": "text"}}, "prompt").structured is None
    finally:
        grammars.problem.cache_clear()


def test_the_fields_read_as_vllm_and_openai_mean_them():
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    got = body_params({"messages": [], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}}, "messages").structured
    assert got.kind == "json" and list(got.schema["properties"]) == ["b", "a"]  # the schema's key order kept
    assert body_params({"prompt": "", "guided_json": json.dumps(schema)}, "prompt").structured == got
    assert body_params({"prompt": "", "structured_outputs": {"json": schema}}, "prompt").structured == got
    assert column_params({"guided_choice": ["x", "y"]}, "params").structured.choices == ("x", "y")
    assert body_params({"prompt": "", "structured_outputs": {"json_object": True}}, "prompt").structured.kind == "json_object"
