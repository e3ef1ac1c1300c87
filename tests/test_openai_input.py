"""OpenAI batch files as input (input.format openai, or detected under auto), and the per-row
sampling settings shared with a plain row's params column (spin_batch.io.params)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spin_batch import preflight
from spin_batch.config import ConfigError, parse_job
from spin_batch.io.params import ParamError, body_params, column_params, row_params
from spin_batch.io.checks import check_columns, check_input
from spin_batch.io.reader import iter_requests
from spin_batch.io.rows import row_spec
from spin_batch.io.shards import InputError, list_shards
from spin_batch.records import NO_PARAMS, RowParams

from conftest import make_job, spec_of, write_jsonl
from test_cli_e2e import _isolate_process_state, read_rows, run_ok  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_batch.jsonl"
HI = [{"role": "user", "content": "hi"}]


def chat(custom_id: str = "c1", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": HI, **body}}


def completion(custom_id: str = "p1", prompt="once upon a time", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": prompt, **body}}


def read(tmp_path: Path, lines: list, fmt: str = "auto", **kwargs) -> list:
    path = write_jsonl(tmp_path / "batch.jsonl", lines)
    kwargs["fmt"] = fmt
    return list(iter_requests(list_shards([str(path)], fmt), spec_of(kwargs), **kwargs))


def one(tmp_path: Path, line, fmt: str = "auto") -> object:
    (request,) = read(tmp_path, [line], fmt)
    return request


# --------------------------------------------------------------------------
# good lines
# --------------------------------------------------------------------------


def test_chat_and_completion_lines_become_requests(tmp_path: Path) -> None:
    lines = [
        chat("r1", max_completion_tokens=64, temperature=0.7),
        "",
        completion("r2", stop="\n", top_p=0.9, top_k=5, seed=7),
    ]
    r1, r2 = read(tmp_path, lines)
    assert (r1.id, r1.endpoint, r1.model, r1.prompt, r1.messages) == ("r1", "chat", "m", None, tuple(HI))
    assert r1.params == RowParams(max_tokens=64, temperature=0.7)
    assert (r2.id, r2.endpoint, r2.prompt, r2.messages) == ("r2", "completion", "once upon a time", None)
    assert r2.params == RowParams(top_p=0.9, top_k=5, stop=("\n",), seed=7)
    assert r2.source.endswith("batch.jsonl#2")  # the blank line still counts
    assert r1.ok and r2.ok and r1.keep is None and r2.keep is None


def test_a_body_without_sampling_fields_takes_the_jobs_settings(tmp_path: Path) -> None:
    request = one(tmp_path, {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": HI}})
    assert request.ok and request.params == NO_PARAMS and request.model is None


def test_text_neutral_fields_are_accepted(tmp_path: Path) -> None:
    line = chat(user="u1", metadata={"k": "v"}, store=False, stream=False, stream_options=None, n=1,
                logprobs=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, tools=[],
                tool_choice="none", response_format={"type": "text"}, service_tier="auto", top_k=-1)
    request = one(tmp_path, line)
    assert request.ok, request.error
    # -1 is vLLM's "off", as sampling.top_k; zero penalties and an empty bias are the row's own (they change
    # nothing); n: 1 asked
    assert request.params == RowParams(top_k=0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=(), n=1)


def test_max_tokens_and_max_completion_tokens(tmp_path: Path) -> None:
    assert one(tmp_path, chat(max_tokens=20)).params.max_tokens == 20
    assert one(tmp_path, chat(max_tokens=20, max_completion_tokens=20)).params.max_tokens == 20
    bad = one(tmp_path, chat(max_tokens=20, max_completion_tokens=30))
    assert bad.error == ("body.max_tokens (20) and body.max_completion_tokens (30) differ; give one of them")


def test_stop_list_and_empty_list(tmp_path: Path) -> None:
    assert one(tmp_path, chat(stop=["a", "bb", "c", "d", "e"])).params.stop == ("a", "bb", "c", "d", "e")
    assert one(tmp_path, chat(stop=[])).params.stop == ()  # no stop strings for this row (not the job's)
    assert one(tmp_path, chat(stop=None)).params.stop is None


# --------------------------------------------------------------------------
# bad lines: an error row naming the field, never a silent default
# --------------------------------------------------------------------------


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": -1}, "body.max_tokens must be an integer >= 0, got -1"),
    ({"max_completion_tokens": "64"}, 'body.max_completion_tokens must be an integer, got "64"'),
    ({"max_tokens": 12.0}, "body.max_tokens must be an integer, got 12.0"),
    ({"temperature": -0.1}, "body.temperature must be a number >= 0, got -0.1"),
    ({"temperature": True}, "body.temperature must be a number, got true"),
    ({"temperature": "hot"}, 'body.temperature must be a number, got "hot"'),
    ({"top_p": 0}, "body.top_p must be a number in (0, 1], got 0"),
    ({"top_p": 1.5}, "body.top_p must be a number in (0, 1], got 1.5"),
    ({"top_k": -2}, "body.top_k must be -1 or 0 (off) or an integer >= 1, got -2"),
    ({"top_k": 2.5}, "body.top_k must be an integer, got 2.5"),
    ({"stop": ""}, 'body.stop must be a non-empty string, got ""'),
    ({"stop": ["a", ""]}, 'body.stop[1] must be a non-empty string, got ""'),
    ({"stop": ["a", 3]}, "body.stop[1] must be a non-empty string, got 3"),
    ({"stop": 5}, "body.stop must be a string or a list of strings, got 5"),
    ({"seed": 1.5}, "body.seed must be an integer, got 1.5"),
    ({"seed": 2**63}, "body.seed must be a 64-bit signed integer"),
    ({"n": 0}, "body.n must be an integer in 1..128, got 0"),
    ({"best_of": 3}, "body.best_of = 3 is not supported"),
    ({"logprobs": 3}, "body.logprobs must be true or false, got 3"),
    ({"top_logprobs": 5}, "body.top_logprobs needs body.logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "body.top_logprobs must be an integer in [0, 20], got 21"),
    ({"prompt_logprobs": -1}, "body.prompt_logprobs must be an integer in [0, 20], got -1"),
    ({"stream": True}, "body.stream = true is not supported"),
    ({"echo": True}, "body.echo = true is not supported"),
    ({"suffix": "end"}, 'body.suffix = "end" is not supported'),
    ({"presence_penalty": 2.5}, "body.presence_penalty must be a number in [-2, 2], got 2.5"),
    ({"frequency_penalty": "x"}, 'body.frequency_penalty must be a number, got "x"'),
    ({"repetition_penalty": 0}, "body.repetition_penalty must be a number > 0, got 0"),
    ({"min_p": 1.5}, "body.min_p must be a number in [0, 1], got 1.5"),
    ({"min_tokens": -1}, "body.min_tokens must be an integer >= 0, got -1"),
    ({"stop_token_ids": 5}, "body.stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": [1, -2]}, "body.stop_token_ids[1] must be a token id (an integer >= 0), got -2"),
    ({"logit_bias": {"x": 1}}, 'body.logit_bias key must be a token id (an integer), got "x"'),
    ({"logit_bias": {"5": "big"}}, 'body.logit_bias["5"] must be a number, got "big"'),
    ({"logit_bias": [1, 2]}, "body.logit_bias must be an object of token id -> bias"),
    ({"chat_template_kwargs": [1]}, "body.chat_template_kwargs must be an object"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "body.messages[0].content[0] must be a text part"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "body.tools = "),
    ({"response_format": {"type": "xml"}}, 'body.response_format must be {"type": "text"}'),
    ({"n": True}, "body.n must be an integer, got true"),  # a bool is not the number 1
    ({"reasoning_effort": "low"}, "body.reasoning_effort is not supported"),
    ({"prompt": "also"}, "body.prompt does not belong in this request: its endpoint reads body.messages"),
    ({"model": 5}, "body.model must be a string, got int"),
])
def test_a_bad_body_field_is_an_error_row_naming_it(tmp_path: Path, body: dict, message: str) -> None:
    request = one(tmp_path, chat("bad", **body))
    assert not request.ok
    assert message in request.error, request.error
    assert (request.id, request.endpoint) == ("bad", "chat")  # the output can still name the line
    assert request.prompt is None and request.messages is None


@pytest.mark.parametrize("raw, message", [
    ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "temperature": NaN}}',
     "body.temperature must be a finite number, got NaN"),
    ('{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "top_p": Infinity}}',
     "body.top_p must be a finite number, got Infinity"),
])
def test_nan_and_infinity_are_error_rows(tmp_path: Path, raw: str, message: str) -> None:
    assert one(tmp_path, raw).error == message


@pytest.mark.parametrize("line, message", [
    ({"method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}, "missing custom_id"),
    ({"custom_id": None, "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}, "missing custom_id"),
    ({"custom_id": " ", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a"}}, "empty custom_id"),
    ({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}},
     'method must be "POST", got "GET"'),
    ({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "a"}}, 'missing method (it must be "POST")'),
    ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}},
     'url "/v1/embeddings" is not supported; spin-batch serves /v1/chat/completions and /v1/completions'),
    ({"custom_id": "x", "method": "POST", "body": {"prompt": "a"}},
     "missing url (/v1/chat/completions and /v1/completions are served)"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions"}, "missing body"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": "a"}, "body must be an object, got str"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {}},
     "body.messages is missing; /v1/chat/completions needs it"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}},
     "body.messages must not be empty"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
      "body": {"messages": [{"role": "user", "content": 5}]}},
     "body.messages[0].content must be a string or a list of text parts, got int"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}},
     "body.prompt is missing; /v1/completions needs it"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},
     "body.prompt must be one string; a list of prompts or of token ids is not supported"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "  "}}, "body.prompt is empty"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "messages": HI}},
     "body.messages does not belong in this request: its endpoint reads body.prompt"),
])
def test_a_malformed_line_is_an_error_row(tmp_path: Path, line: dict, message: str) -> None:
    request = one(tmp_path, line, "openai")  # auto would not take a lone line without a custom_id for OpenAI
    assert request.error == message


def test_duplicate_custom_ids(tmp_path: Path) -> None:
    first, second = read(tmp_path, [chat("same"), completion("same")])
    assert first.ok
    assert (second.error, second.id, second.endpoint, second.model) == ("duplicate id 'same'", "same",
                                                                        "completion", "m")


# --------------------------------------------------------------------------
# format: detection, openai, and what the other formats do
# --------------------------------------------------------------------------


def test_auto_detects_openai_by_the_first_object_line(tmp_path: Path) -> None:
    lines = ["", "not json", completion("a")]  # a broken first line does not hide what the file is
    requests = read(tmp_path, lines)
    assert [r.error for r in requests] == ["invalid JSON: Expecting value (column 1)", None]
    assert requests[1].endpoint == "completion"


def test_plain_files_are_not_taken_for_openai(tmp_path: Path) -> None:
    request = one(tmp_path, {"id": "a", "prompt": "p", "custom_id": "x"})  # no url or body
    assert request.ok and request.endpoint is None and request.prompt == "p"


def test_format_jsonl_reads_an_openai_file_as_plain_rows(tmp_path: Path) -> None:
    request = read(tmp_path, [completion("a")], fmt="jsonl")[0]
    assert request.error == "missing id"
    with pytest.raises(InputError, match=r"an OpenAI batch file\? set input.format to openai or auto"):
        check_columns([tmp_path / "batch.jsonl"], row_spec(fmt="jsonl"))


def test_format_openai_reads_every_line_as_a_request(tmp_path: Path) -> None:
    requests = read(tmp_path, [{"id": "a", "prompt": "p"}, completion("b")], fmt="openai")
    assert requests[0].error == "missing custom_id"
    assert requests[1].ok
    check_columns([tmp_path / "batch.jsonl"], row_spec(fmt="openai"))  # no plain columns to look for


def test_column_options_do_not_apply_to_openai_lines(tmp_path: Path) -> None:
    (request,) = read(tmp_path, [completion("a")], id_column="key", prompt_column="text", params_column="p")
    assert request.ok and request.id == "a"


def test_an_openai_job_rejects_parquet(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [completion("a")])
    pq.write_table(pa.table({"id": ["x"], "prompt": ["p"]}), tmp_path / "b.parquet")
    for named in (tmp_path / "b.parquet", tmp_path, tmp_path / "*"):  # the file, its folder, a glob
        with pytest.raises(InputError, match="b.parquet: is a Parquet file, but input.format openai reads"):
            list_shards([str(named)], "openai")
    assert [p.name for p in list_shards([str(tmp_path)], "auto")] == ["a.jsonl", "b.parquet"]


def test_keep_columns_of_openai_lines(tmp_path: Path) -> None:
    line = {**completion("a"), "note": {"batch": 3}}
    assert read(tmp_path, [line], keep_columns=True)[0].keep is None  # the body is the request
    assert read(tmp_path, [line], keep_columns=["note", "absent"])[0].keep == {"note": {"batch": 3}, "absent": None}


# --------------------------------------------------------------------------
# validate: the first bad line, by its line number
# --------------------------------------------------------------------------


def test_check_input_names_the_first_bad_line(tmp_path: Path) -> None:
    lines = [chat("a"), completion("b"), "", chat("c", echo=True), chat("d", best_of=3), chat("e", temperature=-1)]
    path = write_jsonl(tmp_path / "batch.jsonl", lines).resolve()
    problems = check_input([path])
    assert problems[0] == (f"2 bad rows (unsupported field); first at {path}#3 (line 4): body.echo = true is "
                           "not supported: it would change the output, and spin-batch takes only false or null")
    assert problems[1].startswith(f"1 bad row (bad params); first at {path}#5 (line 6): body.temperature")
    assert len(problems) == 2


def test_validate_reports_a_malformed_openai_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "batch.jsonl", [completion("a"), completion("b", prompt=[1, 2, 3])])
    job = parse_job({"input": {"paths": [str(path)], "format": "openai"}, "output": {"dir": str(tmp_path / "o")}})
    problems = preflight.validate_job(job, check_models_too=False)
    assert problems == [f"1 bad row (bad prompt type); first at {path.resolve()}#1 (line 2): body.prompt must be one "
                        "string; a list of prompts or of token ids is not supported"]


def test_validate_rejects_parquet_in_an_openai_job(tmp_path: Path) -> None:
    pq.write_table(pa.table({"id": ["x"], "prompt": ["p"]}), tmp_path / "b.parquet")
    job = parse_job({"input": {"paths": [str(tmp_path)], "format": "openai"}, "output": {"dir": str(tmp_path / "o")}})
    (problem,) = preflight.validate_job(job, check_models_too=False)
    assert "is a Parquet file, but input.format openai reads OpenAI batch files" in problem


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------


def test_config_format_openai_and_params_column(tmp_path: Path) -> None:
    base = {"output": {"dir": "o"}}
    job = parse_job({**base, "input": {"paths": ["a.jsonl"], "format": "openai", "params_column": "sampling"}})
    assert (job.input.format, job.input.params_column) == ("openai", "sampling")
    assert parse_job({**base, "input": {"paths": ["a.jsonl"]}}).input.params_column is None
    with pytest.raises(ConfigError) as err:
        parse_job({**base, "input": {"paths": ["a.jsonl"], "format": "batch", "params_column": ""}})
    text = str(err.value)
    assert "input.format: must be one of 'auto', 'jsonl', 'parquet', 'openai'" in text
    assert "input.params_column: must be a non-empty string" in text


# --------------------------------------------------------------------------
# the shared checks (io.params)
# --------------------------------------------------------------------------


def test_one_check_for_bodies_and_params_columns() -> None:
    for value in ({"top_p": 2}, {"temperature": float("nan")}, {"seed": "1"}):
        with pytest.raises(ParamError) as from_body:
            body_params(value, "prompt")
        with pytest.raises(ParamError) as from_column:
            column_params(value, "params")
        assert from_body.value.message.removeprefix("body.") == from_column.value.message.removeprefix("params.")
    assert row_params({"temperature": 1, "max_tokens": 5}) == RowParams(max_tokens=5, temperature=1.0)
    assert column_params(None, "params") is NO_PARAMS
    with pytest.raises(ParamError, match="params.best_of is not a sampling field"):
        column_params({"best_of": 1}, "params")  # a params column takes only the sampling fields
    assert column_params({"n": 3}, "params") == RowParams(n=3)
    with pytest.raises(ParamError, match="params must be an object with sampling fields"):
        column_params([0.5], "params")


def test_the_example_batch_file_reads_clean() -> None:
    requests = list(iter_requests(list_shards([str(EXAMPLE)])))
    assert requests and all(r.ok for r in requests), [r.error for r in requests if not r.ok]
    assert {r.endpoint for r in requests} == {"chat", "completion"}
    temperatures = {r.params.temperature for r in requests}  # some lines sample, the others take the job's
    assert None in temperatures and len(temperatures) > 1
    assert check_input(list_shards([str(EXAMPLE)], "openai"), row_spec(fmt="openai")) == []


# --------------------------------------------------------------------------
# a run
# --------------------------------------------------------------------------


def test_a_run_over_an_openai_file(tmp_path: Path, tiny_dir: Path) -> None:
    """Every line gets a row under its custom_id; a /v1/completions prompt is not wrapped in the chat
    template (the tokenizer has one, and input.chat_template is auto), a chat line's messages are."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    messages = [{"role": "user", "content": "list three colours"}]
    lines = [
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": messages, "max_completion_tokens": 4}},
        completion("text-1", prompt="the quick brown fox", max_tokens=4),
        completion("bad-1", prompt="the moon", logprobs=True),  # a completions body counts its top tokens
    ]
    src = write_jsonl(tmp_path / "in" / "batch.jsonl", lines)
    job, out = make_job(tmp_path, tiny_dir, [src], sampling={"max_tokens": 6},
                        target={"served_model_name": ["m", "tiny"]})  # the lines' body.model
    run_ok(job)
    rows = {r["id"]: r for r in read_rows(out)}
    assert sorted(rows) == ["bad-1", "chat-1", "text-1"]
    assert rows["text-1"]["status"] == "ok"
    assert rows["text-1"]["prompt_tokens"] == len(tok.encode("the quick brown fox"))
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rows["chat-1"]["prompt_tokens"] == len(tok.encode(templated, add_special_tokens=False))
    assert rows["bad-1"]["status"] == "error" and "body.logprobs must be an integer, got true" in rows["bad-1"]["error"]
