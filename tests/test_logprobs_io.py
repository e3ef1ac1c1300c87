"""Logprobs through a job: the keys, a params column, OpenAI lines in and out (parsed by the `openai`
package's types), the Parquet columns, and scoring jobs (max_tokens 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from spin_batch.config import parse_job
from spin_batch.io.params import body_params, column_params
from spin_batch.io.schema import OUTPUT_SCHEMA, LOGPROB_TYPE
from spin_batch.io.openai_batch import response_line
from spin_batch.records import RowParams

from conftest import write_jsonl
from conftest import make_job
from test_cli_e2e import _isolate_process_state, read_rows, run_ok  # noqa: F401
from test_openai_output import lines_of, parse_line

BASE = {"input": {"paths": ["a.jsonl"]}, "output": {"dir": "out"}, "target": {"model": "m"}}


def test_job_keys():
    s = parse_job({**BASE, "sampling": {"logprobs": 20, "prompt_logprobs": 0, "logprobs_mode": "processed_logprobs",
                                        "max_tokens": 0}}).sampling
    assert (s.logprobs, s.prompt_logprobs, s.logprobs_mode, s.max_tokens) == (20, 0, "processed_logprobs", 0)
    s = parse_job(BASE).sampling
    assert (s.logprobs, s.prompt_logprobs, s.logprobs_mode) == (None, None, "raw_logprobs")


def test_request_fields():
    """Chat asks with logprobs: true and top_logprobs; completions with logprobs: K; both may add prompt_logprobs."""
    assert body_params({"logprobs": True, "top_logprobs": 4}, "messages") == RowParams(logprobs=4)
    assert body_params({"logprobs": True}, "messages") == RowParams(logprobs=0)
    assert body_params({"logprobs": False, "top_logprobs": 0}, "messages") == RowParams()
    assert body_params({"logprobs": 3, "prompt_logprobs": 1}, "prompt") == RowParams(logprobs=3, prompt_logprobs=1)
    assert body_params({"max_tokens": 0, "prompt_logprobs": 2}, "prompt") == RowParams(max_tokens=0, prompt_logprobs=2)
    assert column_params({"logprobs": 2}, "p") == RowParams(logprobs=2)


def test_the_output_schema_has_typed_logprob_columns():
    assert OUTPUT_SCHEMA.field("logprobs").type.value_type == LOGPROB_TYPE
    assert OUTPUT_SCHEMA.field("prompt_logprobs").type.value_type == LOGPROB_TYPE
    assert [f.name for f in LOGPROB_TYPE] == ["token_id", "token", "logprob", "rank", "top_ids", "top_tokens",
                                              "top_logprobs"]


def test_a_params_column_asks_per_row(tmp_path, tiny_dir):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "once upon a time", "p": {"logprobs": 3}},
                                              {"id": "b", "prompt": "the quick brown fox"},
                                              {"id": "c", "prompt": "red green", "p": {"logprobs": 21}}])
    job, out = make_job(tmp_path, tiny_dir, [src], input={"params_column": "p"})
    run_ok(job)
    rows = {r["id"]: r for r in read_rows(out)}
    a = rows["a"]["logprobs"]
    assert len(a) == rows["a"]["completion_tokens"] and all(len(e["top_ids"]) == 3 for e in a)
    assert all(e["logprob"] <= 0 and e["rank"] >= 1 and e["top_logprobs"] == sorted(e["top_logprobs"], reverse=True)
               for e in a)
    assert rows["b"]["logprobs"] is None and rows["b"]["prompt_logprobs"] is None
    assert rows["c"]["status"] == "error" and "p.logprobs must be an integer in [0, 20], got 21" in rows["c"]["error"]
    part = pq.read_table(sorted((out / "outputs").glob("part-*.parquet"))[0])
    assert part.schema.field("logprobs").type.value_type == LOGPROB_TYPE


def test_openai_lines_answer_in_openais_logprobs_shapes(tmp_path, tiny_dir):
    messages = [{"role": "user", "content": "list three colours"}]
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": messages, "logprobs": True, "top_logprobs": 3}},
        {"custom_id": "text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "once upon a time", "logprobs": 2, "prompt_logprobs": 1}},
        {"custom_id": "plain", "method": "POST", "url": "/v1/completions", "body": {"prompt": "the moon"}},
    ]
    src = write_jsonl(tmp_path / "in" / "batch.jsonl", lines)
    job, out = make_job(tmp_path, tiny_dir, [src], output={"format": "openai"}, sampling={"max_tokens": 6},
                        target={"served_model_name": ["tiny"]})  # the lines' model name, as vLLM serves it
    run_ok(job)
    got = {line["custom_id"]: line for line in lines_of(out / "results.jsonl")}
    chat = parse_line(got["chat"]).choices[0].logprobs
    assert len(chat.content) == 6 and all(len(t.top_logprobs) == 3 for t in chat.content)
    for t in chat.content:
        assert t.bytes == list(t.token.encode("utf-8")) and t.logprob <= 0
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    body = got["text"]["response"]["body"]
    prompt_lps = body.pop("prompt_logprobs")  # vLLM's extension, not an OpenAI field: checked by hand
    got["text"]["response"]["body"] = body
    text = parse_line(got["text"]).choices[0]
    lp = text.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(d) <= 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    assert "".join(lp.tokens) == text.text  # the tiny tokenizer decodes token by token
    assert prompt_lps[0] is None and len(prompt_lps) == body["usage"]["prompt_tokens"]
    for entry in prompt_lps[1:]:
        first = next(iter(entry.values()))
        assert first["logprob"] <= 0 and first["rank"] >= 1 and isinstance(first["decoded_token"], str)
        assert 1 <= len(entry) <= 2
    assert parse_line(got["plain"]).choices[0].logprobs is None


def test_minus_infinity_is_written_as_vllms_floor():
    row = {"source": "s", "id": "x", "status": "ok", "text": "a", "finish_reason": "stop", "prompt_tokens": 1,
           "completion_tokens": 1, "endpoint": "chat", "created": 1,
           "logprobs": [{"token_id": 1, "token": "a", "logprob": -0.5, "rank": 1, "top_ids": [1, 2],
                         "top_tokens": ["a", "b"], "top_logprobs": [-0.5, float("-inf")]}]}
    line = response_line(row, "m")
    text = json.dumps(line, allow_nan=False)  # valid JSON
    assert parse_line(json.loads(text)).choices[0].logprobs.content[0].top_logprobs[1].logprob == -9999.0


def test_max_tokens_0_scores_1000_rows(tmp_path, tiny_dir):
    """A scoring job: prefill only; every row has its prompt logprobs, their sum, mean and perplexity."""
    words = ["red", "green", "blue", "fox", "dog", "moon", "tide", "robot", "count", "tone"]
    rows = [{"id": f"r{i}", "prompt": " ".join(words[(i * j) % 10] for j in range(2 + i % 7))} for i in range(1000)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 0, "prompt_logprobs": 2},
                        batch={"slots": 16, "max_model_len": 64, "max_num_batched_tokens": 64})
    run_ok(job)
    got = read_rows(out)
    assert len(got) == 1000 and len({r["id"] for r in got}) == 1000
    for r in got:
        assert r["status"] == "ok" and r["completion_tokens"] == 0 and r["text"] == "" and r["logprobs"] is None
        lps = r["prompt_logprobs"]
        assert len(lps) == r["prompt_tokens"] and lps[0] is None and all(len(e["top_ids"]) == 2 for e in lps[1:])
        total = math.fsum(e["logprob"] for e in lps[1:])
        assert r["prompt_logprob_sum"] == pytest.approx(total)
        assert r["prompt_logprob_mean"] == pytest.approx(total / (len(lps) - 1))
        assert r["prompt_perplexity"] == pytest.approx(math.exp(-total / (len(lps) - 1)))
