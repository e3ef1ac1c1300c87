"""OpenAI batch response lines (spin_batch/io/openai_batch.py): `export --format openai` and the
results.jsonl that output.format openai/both writes, each body parsed by the `openai` package's types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spin_batch.config import ConfigError, parse_job
from spin_batch.export import RESULTS_JSONL, RESULTS_PARQUET, write_results
from spin_batch.io.schema import completion_row
from spin_batch.io.writer import OutputWriter
from spin_batch.records import Completion, Request

from test_cli_e2e import _describe, _isolate_process_state, invoke  # noqa: F401

openai = pytest.importorskip("openai")  # in the test extra (pyproject.toml): CI installs it

from openai.types import BatchError  # noqa: E402
from openai.types import Completion as TextCompletion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

CHAT = ({"role": "user", "content": "hi"},)


def no_unknown_fields(model) -> None:
    """The openai types accept extra keys: make sure every key we write is one they declare."""
    assert not model.model_extra, f"{type(model).__name__} got unknown fields {model.model_extra}"
    for value in dict(model).values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, openai.BaseModel):
                no_unknown_fields(item)


def parse_line(line: dict):
    """One response line checked against the OpenAI batch output shape; returns its parsed body or error."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert set(line["response"]) == {"status_code", "request_id", "body"}
    assert line["id"].startswith("batch_req_") and line["response"]["request_id"].startswith("req_")
    if line["error"] is not None:
        assert line["response"]["status_code"] == 400 and line["response"]["body"] is None
        error = BatchError.model_validate(line["error"])
        no_unknown_fields(error)
        return error
    assert line["response"]["status_code"] == 200
    body = line["response"]["body"]
    kind = {"chat.completion": ChatCompletion, "text_completion": TextCompletion}[body["object"]]
    parsed = kind.model_validate(body)
    no_unknown_fields(parsed)
    return parsed


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def out(tmp_path) -> Path:
    """Rows as a run writes them: a chat line with its own model, a prompt cut at max_tokens, an error
    row, from two workers and out of input order; a kept input column beside them."""
    out = tmp_path / "out"
    rows = [
        completion_row(Completion(Request("/in/a.jsonl#1", "b", "once upon", None, keep={"topic": "tale"}),
                                  " a time", "length", 3, 2), model="builtin:tiny", created=1700000001),
        completion_row(Completion.failed(Request("/in/a.jsonl#2", "c", "x " * 900, None), "prompt too long", 901),
                       model="builtin:tiny", created=1700000002),
    ]
    with OutputWriter(out, worker="w0001") as w:
        for row in rows:
            w.add(row)
    first = Request("/in/a.jsonl#0", "a", None, CHAT, endpoint="chat", model="my-model")
    with OutputWriter(out, worker="w0000") as w:
        w.add(completion_row(Completion(first, "hello!", "stop", 5, 3), model="builtin:tiny", created=1700000000))
    return out


def test_export_openai_lines_parse_with_the_openai_types(tmp_path, out):
    dest = tmp_path / "results.jsonl"
    result = invoke("export", out, "--to", dest, "--format", "openai")
    assert result.exit_code == 0, _describe(result)
    lines = lines_of(dest)
    assert [line["custom_id"] for line in lines] == ["a", "b", "c"]  # input order
    chat, text, error = (parse_line(line) for line in lines)
    assert chat.object == "chat.completion" and chat.model == "my-model" and chat.created == 1700000000
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == "hello!"
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].index == 0
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (5, 3, 8)
    assert chat.id.startswith("chatcmpl-")
    assert text.object == "text_completion" and text.model == "builtin:tiny" and text.id.startswith("cmpl-")
    assert text.choices[0].text == " a time" and text.choices[0].finish_reason == "length"
    assert error.code == "invalid_request_error" and error.message == "prompt too long"
    assert len({line["id"] for line in lines}) == 3
    again = tmp_path / "again.jsonl"
    assert invoke("export", out, "--to", again, "--format", "openai").exit_code == 0
    assert again.read_bytes() == dest.read_bytes()  # the same rows give the same lines
    assert invoke("export", out, "--to", again, "--format", "openai", "--no-errors").exit_code == 0
    assert [line["custom_id"] for line in lines_of(again)] == ["a", "b"]


def test_rows_without_a_model_name_the_jobs_target(tmp_path):
    """Rows of parts written before rows carried a model: the summary's target, or --model."""
    out = tmp_path / "out"
    with OutputWriter(out) as w:
        w.add({"id": "a", "source": "/in/a.jsonl#0", "text": "x", "finish_reason": "stop"})
    (out / "summary.json").write_text(json.dumps({"job": {"target": {"model": "/models/llama"}}}))
    dest = tmp_path / "r.jsonl"
    assert invoke("export", out, "--to", dest, "--format", "openai").exit_code == 0
    body = parse_line(lines_of(dest)[0])
    assert body.model == "/models/llama" and body.object == "text_completion" and body.created == 0
    assert invoke("export", out, "--to", dest, "--format", "openai", "--model", "other").exit_code == 0
    assert parse_line(lines_of(dest)[0]).model == "other"


def test_write_results_follows_output_format(tmp_path, out):
    assert write_results(out, "parquet", "m") == []
    assert not (out / RESULTS_JSONL).exists()
    assert write_results(out, "openai", "m") == [out / RESULTS_JSONL]
    assert not (out / RESULTS_PARQUET).exists()
    assert [parse_line(line).__class__ for line in lines_of(out / RESULTS_JSONL)] == \
        [ChatCompletion, TextCompletion, BatchError]
    assert write_results(out, "both", "m") == [out / RESULTS_JSONL, out / RESULTS_PARQUET]
    import pyarrow.parquet as pq

    table = pq.read_table(out / RESULTS_PARQUET)
    assert table.column("id").to_pylist() == ["a", "b", "c"]
    assert table.column("topic").to_pylist() == [None, "tale", None]  # the kept input column
    empty = tmp_path / "empty"  # a run with no rows (an empty input) still ends with the files
    assert write_results(empty, "openai", "m") == [empty / RESULTS_JSONL]
    assert (empty / RESULTS_JSONL).read_bytes() == b""


def test_export_jsonl_and_parquet_carry_the_kept_columns(tmp_path, out):
    dest = tmp_path / "rows.jsonl"
    assert invoke("export", out, "--to", dest).exit_code == 0
    rows = lines_of(dest)
    assert [(r["id"], r["endpoint"], r["model"], r["topic"]) for r in rows] == [
        ("a", "chat", "my-model", None), ("b", "completion", "builtin:tiny", "tale"),
        ("c", "completion", "builtin:tiny", None)]
    result = invoke("export", out, "--to", tmp_path / "rows.txt")
    assert result.exit_code == 1 and "unknown extension" in result.output
    assert invoke("export", out, "--to", tmp_path / "rows.txt", "--format", "jsonl").exit_code == 0


def test_output_format_and_keep_columns_in_the_job():
    def output(**section):
        return parse_job({"input": {"paths": ["in.jsonl"]}, "output": {"dir": "out", **section}}).output

    assert (output().format, output().keep_columns, output().column_prefix) == ("parquet", "all", "input_")
    assert output(format="both", keep_columns=["a", "b"]).keep_columns == ("a", "b")
    for bad, key in (({"format": "csv"}, "output.format"), ({"keep_columns": "some"}, "output.keep_columns"),
                     ({"keep_columns": ["a", "a"]}, "output.keep_columns"),
                     ({"column_prefix": ""}, "output.column_prefix")):
        with pytest.raises(ConfigError, match=key):
            output(**bad)
